"""fastgrad's :class:`~verify.candidates.api.pipeline.PipelineTraining`: ``fastgrad.ddp`` under
``fastgrad.pipeline``'s 1F1B (``fastgrad.pipeline_interleaved``'s interleaved 1F1B at
VPP > 1, one DDP per model chunk), with ``fastgrad.deferred_wgrad``'s output layer and the
tied-embedding all-reduce, on a grid built by ``ParallelDims.build``.

A :class:`~verify.candidates.api.Fault` breaks the rank's own objects, never a library
class: :attr:`Fault.REVERSED_MICROBATCHES` feeds each replica's microbatches in reverse,
:attr:`Fault.LIFO_DRAIN` / :attr:`Fault.EMBEDDING_GRAD_FIRST` / :attr:`Fault.DROPPED_HEAD_WGRAD`
give the last stage a broken output layer (``verify.candidates.fastgrad.pipeline_model``),
:attr:`Fault.CROSSED_EMBEDDING_GROUP` (TP 2, tied) pairs each first-stage TP rank with the
other TP rank's last stage for the embedding all-reduce (same shard shape, wrong rows).

The preflight twin trains the same stages step by step under fastgrad's optimizer
(:meth:`FastgradPipeline.model`: ``verify.candidates.fastgrad.stages``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from fastgrad.comm import all_gather_into
from fastgrad.ddp import DistributedDataParallel
from fastgrad.pipeline import forward_backward_1f1b
from fastgrad.pipeline_interleaved import forward_backward_interleaved
from fastgrad.timeline import Timeline
from gradvocab import ParallelDims
from refgrad.pipeline import sgd_update
from verify.candidates.api import Fault
from verify.candidates.api.pipeline import (
    ModelSupport,
    PipelineCase,
    PipelineModel,
    PipelineTraining,
    RankResult,
    StageSettings,
    StepProgress,
    rank_microbatches,
    total_losses,
    updated_once,
)
from verify.candidates.fastgrad.pipeline_model import (
    build_stage_model,
    case_ddp_config,
    drained_head,
    external_grad_params,
)
from verify.candidates.fastgrad.stages import FastgradStages


@dataclass(frozen=True)
class FastgradPipeline(PipelineTraining):
    """fastgrad's DDP and 1F1B schedules, as published (``fault=None``) or with ``fault``
    (its ``with`` scope is empty: fastgrad needs no per-process setup)."""

    fault: Fault | None = None

    def grid(self, dims: ParallelDims) -> AbstractContextManager[ParallelDims | None]:
        """Every group of the grid, collectively (``ParallelDims.build``); nothing to tear
        down (torch keeps the groups until the process group is destroyed)."""
        return nullcontext(dims.build())

    def train(self, case: PipelineCase, grid: ParallelDims, *, overlap: bool,
              progress: StepProgress | None = None) -> RankResult:
        """Train ``case`` on this rank (see :func:`run_case_on_rank`)."""
        return run_case_on_rank(case, with_fault_groups(case, grid, self.fault), overlap,
                                progress, self.fault)

    def model(self, case: PipelineCase, grid: ParallelDims, settings: StageSettings) -> PipelineModel:
        """``verify.candidates.fastgrad.stages.FastgradStages`` on ``grid`` as the fault has it."""
        return FastgradStages(case, with_fault_groups(case, grid, self.fault), settings, self.fault)

    def model_support(self) -> ModelSupport:
        """fastgrad builds every part of the model here."""
        return ModelSupport()


def with_fault_groups(case: PipelineCase, grid: ParallelDims, fault: Fault | None) -> ParallelDims:
    """``grid`` as ``fault`` has it: with :attr:`Fault.CROSSED_EMBEDDING_GROUP` (TP 2) the
    embedding group of the first stage's TP rank ``t`` is the last stage's TP rank ``1 - t``
    (only the pair's two ranks create it). Every other case: ``grid`` unchanged."""
    if (fault is not Fault.CROSSED_EMBEDDING_GROUP or grid.pp_size == 1 or grid.tp_size != 2
            or not (grid.is_first_stage or grid.is_last_stage)):
        return grid
    peer_stage = grid.pp_size - 1 if grid.is_first_stage else 0
    peer = grid.global_rank(peer_stage, grid.dp_rank, 1 - grid.tp_rank)
    ranks = tuple(sorted((grid.rank, peer)))
    group = dist.new_group(list(ranks), use_local_synchronization=True)
    return replace(grid, place=replace(grid.place, embedding_group=group, embedding_ranks=ranks))


def _fault_microbatches(case: PipelineCase, grid: ParallelDims, step: int, m: int,
                        fault: Fault | None) -> tuple[list, list, Any]:
    """The neutral data, fed in reverse under :attr:`Fault.REVERSED_MICROBATCHES`."""
    inputs, targets, loss_fn = rank_microbatches(case, grid, step, m)
    if fault is Fault.REVERSED_MICROBATCHES:
        inputs, targets = inputs[::-1], targets[::-1]
    return inputs, targets, loss_fn


def _full_reduced_grads(ddp: DistributedDataParallel, case: PipelineCase, dp_group: Any) -> None:
    """With the distributed optimizer only the local shard is reduced: gather the others."""
    if not case.use_distributed_optimizer or case.dp_size == 1:
        return
    for bucket in ddp.buffer.buckets:
        gathered = torch.empty_like(bucket.grad_data)
        all_gather_into(gathered, bucket.local_grad_shard.clone(), group=dp_group)
        bucket.grad_data.copy_(gathered)


class _RecordingSync:
    """Forward to one chunk's DDP; at its enable, note which chunks already launched a reduce."""

    def __init__(self, ddps: list[DistributedDataParallel], chunk: int, log: list) -> None:
        self.ddp, self.ddps, self.chunk, self.log = ddps[chunk], ddps, chunk, log

    def enable_grad_sync(self) -> None:
        self.log.append((self.chunk, tuple(d.any_reduce_in_flight for d in self.ddps)))
        self.ddp.enable_grad_sync()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ddp, name)


def _step_marker(progress: StepProgress | None, case: PipelineCase, stage: int, overlap: bool,
                 step: int) -> Any:
    """A timeline listener naming case, stage and step, so a stalled rank says where it was."""
    if progress is None:
        return None
    return progress.timeline_listener(
        f"{case.name} overlap {'on' if overlap else 'off'}, stage {stage}, step {step}: ")


def run_case_on_rank(case: PipelineCase, grid: ParallelDims, overlap: bool,
                     progress: StepProgress | None = None, fault: Fault | None = None) -> RankResult:
    """Train ``case`` on this rank of its built ``grid`` (one DDP per model chunk: 1F1B at
    VPP 1, interleaved 1F1B above); return what it saw. ``progress`` (a
    ``verify.distributed.RankProgress``) is told each event as it happens."""
    return _train(case, grid, overlap, progress, fault, interleaved=case.virtual_stages > 1)


def run_interleaved_case_on_rank(case: PipelineCase, grid: ParallelDims, overlap: bool,
                                 progress: StepProgress | None = None) -> RankResult:
    """:func:`run_case_on_rank` through the interleaved schedule even at VPP 1 (its
    degenerate warmup), recording each chunk's grad-sync enable."""
    return _train(case, grid, overlap, progress, None, interleaved=True)


def _train(case: PipelineCase, grid: ParallelDims, overlap: bool, progress: StepProgress | None,
           fault: Fault | None, *, interleaved: bool) -> RankResult:
    chunks, stage = case.virtual_stages, grid.stage
    built = [build_stage_model(case, grid, c, fault) for c in range(chunks)]
    modules = [module for module, *_ in built]
    named = {n: p for _, per_chunk, _, _ in built for n, p in per_chunk.items()}
    heads = [head for _, _, head, _ in built]
    head = next((h for h in heads if h is not None), None)  # last virtual stage only
    tied = [p for *_, per_chunk in built for p in per_chunk]
    ddps = [DistributedDataParallel(module, config=case_ddp_config(case, overlap, stage, c),
                                    parallel_dims=grid, average=case.reduction != "sum",
                                    external_grad_params=external_grad_params(case.spec, heads[c]))
            for c, module in enumerate(modules)]
    result = RankResult(stage=stage, dp_rank=grid.dp_rank, tp_rank=grid.tp_rank)
    timeline = Timeline(grid.rank)
    for step, plan in enumerate(case.plans):
        timeline.listener = _step_marker(progress, case, stage, overlap, step)
        for name, p in named.items():
            p.requires_grad_(name not in plan.frozen)
        for ddp in ddps:
            ddp.zero_grad_buffer()
        if head is not None:
            head.start_step()
        m = plan.num_microbatches
        inputs, targets, loss_fn = _fault_microbatches(case, grid, step, m, fault)
        timeline.clear()
        if case.pp_size > 1:
            dist.barrier(group=grid.pp_group)
        log: list[tuple[int, tuple[bool, ...]]] = []
        common = dict(parallel_dims=grid, num_microbatches=m,
                      activation_shape=case.spec.stage_activation_shape, loss_fn=loss_fn,
                      inputs=inputs if grid.is_first_stage else None,
                      targets=targets if grid.is_last_stage else None, timeline=timeline,
                      deferred_wgrad=drained_head(case.spec, head), embedding_params=tied)
        if interleaved:
            losses = forward_backward_interleaved(
                modules, grad_syncs=[_RecordingSync(ddps, c, log) for c in range(chunks)], **common)
        else:
            losses = forward_backward_1f1b(modules[0], grad_sync=ddps[0], **common)
        result.events.append(list(timeline.events))
        for ddp in ddps:
            _full_reduced_grads(ddp, case, grid.dp_group)
        result.losses.append(total_losses(case, grid, losses))
        result.grads.append({n: p.main_grad.detach().clone() for n, p in named.items()})
        result.launch_sites.append(tuple(s for ddp in ddps for s in ddp.last_launch_sites))
        if interleaved:
            result.chunk_enables.append(log)
        with torch.no_grad():
            for p in updated_once(named, plan.frozen):
                p.copy_(sgd_update(p, p.main_grad, case.lr))
        result.params.append({n: p.detach().clone() for n, p in named.items()})
    result.relearn_count = sum(ddp.relearn_count for ddp in ddps)
    for ddp in ddps:
        ddp.remove_hooks()
    return result

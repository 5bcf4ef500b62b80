"""fastgrad's :class:`~verify.candidates.interfaces.PipelineTraining`: ``fastgrad.ddp`` under
``fastgrad.pipeline``'s 1F1B (``fastgrad.pipeline_interleaved``'s interleaved 1F1B at
VPP > 1, one DDP per model chunk), with ``fastgrad.deferred_wgrad``'s output layer and the
tied-embedding all-reduce, on a grid built by ``ParallelDims.build``.

What each rank builds and feeds is :class:`FastgradPipeline`'s to say (the output layer
class, :meth:`~FastgradPipeline.rank_grid`, :meth:`~FastgradPipeline.microbatches`), so that a
test's deliberately broken subclass changes this rank's own objects, never a library class.

The preflight twin trains the same stages step by step under fastgrad's optimizer
(:meth:`FastgradPipeline.model`: ``verify.candidates.fastgrad.stages``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fastgrad.comm import all_gather_into
from fastgrad.ddp import DistributedDataParallel
from fastgrad.deferred_wgrad import ColumnParallelOutputLayer
from fastgrad.pipeline import forward_backward_1f1b
from fastgrad.pipeline_interleaved import forward_backward_interleaved
from fastgrad.timeline import Timeline
from gradvocab import ParallelDims, RankResult
from verify.candidates.fastgrad.pipeline_model import (
    build_stage_model,
    case_ddp_config,
    case_microbatches,
    drained_head,
    external_grad_params,
    total_losses,
)
from verify.candidates.fastgrad.stages import FastgradStages
from verify.candidates.interfaces import (
    ModelSupport,
    PipelineCase,
    PipelineModel,
    PipelineTraining,
    StageSettings,
    StepProgress,
    sgd_update,
    updated_once,
)


@dataclass(frozen=True)
class FastgradPipeline(PipelineTraining):
    """fastgrad's DDP and 1F1B schedules (its ``with`` scope is empty: fastgrad needs no
    per-process setup). ``output_layer_class``: the last stage's output layer (fastgrad's;
    a test's broken candidate names a subclass, as it may override :meth:`rank_grid` or
    :meth:`microbatches`)."""

    output_layer_class: type[ColumnParallelOutputLayer] = ColumnParallelOutputLayer

    def grid(self, dims: ParallelDims) -> AbstractContextManager[ParallelDims | None]:
        """Every group of the grid, collectively (``ParallelDims.build``); nothing to tear
        down (torch keeps the groups until the process group is destroyed)."""
        return nullcontext(dims.build())

    def train(self, case: PipelineCase, grid: ParallelDims, *, overlap: bool,
              progress: StepProgress | None = None) -> RankResult:
        """Train ``case`` on this rank (see :func:`run_case_on_rank`)."""
        return run_case_on_rank(case, self.rank_grid(case, grid), overlap, progress, self)

    def model(self, case: PipelineCase, grid: ParallelDims, settings: StageSettings) -> PipelineModel:
        """``verify.candidates.fastgrad.stages.FastgradStages`` on :meth:`rank_grid`."""
        return FastgradStages(case, self.rank_grid(case, grid), settings,
                              output_layer_class=self.output_layer_class,
                              microbatches=self.microbatches)

    def model_support(self) -> ModelSupport:
        """fastgrad builds every part of the model here."""
        return ModelSupport()

    def rank_grid(self, case: PipelineCase, grid: ParallelDims) -> ParallelDims:
        """The groups this rank trains ``case`` with: the built ``grid`` as it is."""
        del case
        return grid

    def microbatches(self, case: PipelineCase, grid: ParallelDims, step: int, m: int
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
        """This rank's ``(inputs, targets, loss_fn)`` of step ``step``: refgrad's
        (:func:`~verify.candidates.fastgrad.pipeline_model.case_microbatches`)."""
        return case_microbatches(case, grid, step, m)


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
                     progress: StepProgress | None = None,
                     training: FastgradPipeline | None = None) -> RankResult:
    """Train ``case`` on this rank of its built ``grid`` (one DDP per model chunk: 1F1B at
    VPP 1, interleaved 1F1B above), with ``training``'s output layer and microbatches
    (None: fastgrad's own); return what it saw. ``progress`` (a
    ``verify.distributed.RankProgress``) is told each event as it happens."""
    return _train(case, grid, overlap, progress, training or FastgradPipeline(),
                  interleaved=case.virtual_stages > 1)


def run_interleaved_case_on_rank(case: PipelineCase, grid: ParallelDims, overlap: bool,
                                 progress: StepProgress | None = None) -> RankResult:
    """:func:`run_case_on_rank` through the interleaved schedule even at VPP 1 (its
    degenerate warmup), recording each chunk's grad-sync enable."""
    return _train(case, grid, overlap, progress, FastgradPipeline(), interleaved=True)


def _train(case: PipelineCase, grid: ParallelDims, overlap: bool, progress: StepProgress | None,
           training: FastgradPipeline, *, interleaved: bool) -> RankResult:
    chunks, stage = case.virtual_stages, grid.stage
    built = [build_stage_model(case, grid, c, training.output_layer_class) for c in range(chunks)]
    modules = [module for module, *_ in built]
    named = {n: p for _, per_chunk, _, _ in built for n, p in per_chunk.items()}
    heads = [head for _, _, head, _ in built]
    head = next((h for h in heads if h is not None), None)  # last virtual stage only
    tied = [p for *_, per_chunk in built for p in per_chunk]
    ddps = [DistributedDataParallel(module, config=case_ddp_config(case, overlap, stage, c),
                                    parallel_dims=grid, averaging=case.reduction,
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
        inputs, targets, loss_fn = training.microbatches(case, grid, step, m)
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

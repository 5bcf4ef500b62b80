"""The pipeline check's multi-rank worker: one rank's 1F1B (or interleaved) run of every case, overlap on and off."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from refgrad.pipeline import (
    EMBEDDING_PARAM,
    HEAD_PARAM,
    StageModule,
    head_weight_init,
    microbatch_data,
    sgd_update,
    stage_param_name,
)
from refgrad.pipeline_embedding import vocab_block
from refgrad.pipeline_tp import head_shard, loss_target, sequence_shard, splits_loss, stage_loss
from verify.checks.pipeline.cases import PipelineCase, RankResult
from verify.checks.pipeline.shared_weight import (
    drained_head,
    external_grad_params,
    share_head_weight,
    updated_once,
)


def case_ddp_config(case: PipelineCase, overlap: bool, stage: int, chunk: int = 0):
    """The DDP config of one model chunk of ``case`` on ``stage``."""
    from fastgrad.config import DDPConfig

    return DDPConfig(
        use_distributed_optimizer=case.use_distributed_optimizer,
        reduce_scatter_with_fp32_accumulation=case.reduce_scatter_with_fp32_accumulation,
        average_in_collective=case.reduction == "avg",
        overlap_grad_reduce=overlap,
        bucket_size=case.bucket_size_for(stage, chunk),
    )


def _full_reduced_grads(ddp: Any, case: PipelineCase, dp_group: Any) -> None:
    """With the distributed optimizer only the local shard is reduced: gather the others."""
    if not case.use_distributed_optimizer or case.dp_size == 1:
        return
    from fastgrad.comm import all_gather_into

    for bucket in ddp.buffer.buckets:
        gathered = torch.empty_like(bucket.grad_data)
        all_gather_into(gathered, bucket.local_grad_shard.clone(), group=dp_group)
        bucket.grad_data.copy_(gathered)


class BodyWithHead(torch.nn.Module):
    """The last stage with an output head: ``head(body(x))``."""

    def __init__(self, body: torch.nn.Module, head: torch.nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class _RecordingSync:
    """Forward to one chunk's DDP; at its enable, note which chunks already launched a reduce."""

    def __init__(self, ddps: list[Any], chunk: int, log: list) -> None:
        self.ddp, self.ddps, self.chunk, self.log = ddps[chunk], ddps, chunk, log

    def enable_grad_sync(self) -> None:
        self.log.append((self.chunk, tuple(d.any_reduce_in_flight for d in self.ddps)))
        self.ddp.enable_grad_sync()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ddp, name)


def rank_microbatches(case: PipelineCase, groups: Any, step: int, m: int) -> tuple[list, list, Any]:
    """This rank's ``(inputs, targets, loss_fn)`` for one step: its replica's data, its
    sequence shard of the inputs under SP, the part of each target its (partial) loss covers."""
    spec = case.spec
    inputs, targets = microbatch_data(spec, groups.dp_rank, step, m)
    if case.fault == "reversed_microbatches":
        inputs, targets = inputs[::-1], targets[::-1]
    if spec.vocab_parallel_embedding:  # every row, this rank's vocabulary columns
        inputs = [vocab_block(spec, x, groups.tp_rank) for x in inputs]
    else:
        inputs = [sequence_shard(spec, x, groups.tp_rank) for x in inputs]
    targets = [loss_target(spec, t, groups.tp_rank) for t in targets]
    return inputs, targets, lambda out, target: stage_loss(spec, out, target, m)


def total_losses(case: PipelineCase, groups: Any, losses: list[torch.Tensor]) -> list[float]:
    """The step's losses: partial losses summed over the TP group (production's all-reduce)."""
    if losses and splits_loss(case.spec):
        stacked = torch.stack(losses)
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=groups.tp_group)
        losses = list(stacked)
    return [float(v) for v in losses]


def _mark_replicated(case: PipelineCase, groups: Any, module: torch.nn.Module) -> None:
    """The blocks are replicated across TP. Under SP their grads are summed over TP after the
    DP sync (``sequence_parallel``); on TP ranks > 0 they are duplicates, left out of a grad
    norm summed over the model-parallel group (``shared``, as Megatron-Core's
    ``param_is_not_tensor_parallel_duplicate``)."""
    for p in module.parameters():
        if case.spec.sequence_shards > 1:
            p.sequence_parallel = True
        if groups.tp_rank > 0:
            p.shared = True


class VocabParallelFirstLayer(torch.nn.Module):
    """The first stage's first layer when tied at TP > 1, on this rank: fastgrad's
    vocab-parallel embedding (``weight``: this TP rank's rows, tied to its output-layer shard),
    then the replicated bias (refgrad: ``refgrad.pipeline_embedding``)."""

    def __init__(self, case: PipelineCase, groups: Any, bias: torch.Tensor) -> None:
        from fastgrad.vocab_parallel_embedding import VocabParallelEmbedding

        super().__init__()
        spec = case.spec
        self.embedding = VocabParallelEmbedding(
            head_shard(spec, head_weight_init(spec), groups.tp_rank), tp_group=groups.tp_group,
            sequence_parallel=spec.sequence_parallel)
        self.weight = self.embedding.weight  # named layers.0.weight, as refgrad's
        self.bias = torch.nn.Parameter(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding(x) + self.bias


def _vocab_parallel_first_layer(case: PipelineCase, groups: Any, body: StageModule) -> None:
    """Swap the tied first layer for this rank's vocab-parallel one. Its weight is split over
    TP, not replicated: no TP sum of its grad, and it counts in the grad norm on every TP rank."""
    layer = VocabParallelFirstLayer(case, groups, body.layers[0].bias)
    for p in layer.parameters():  # the bias: replicated, as body.layers[0].bias was
        p.sequence_parallel = getattr(body.layers[0].bias, "sequence_parallel", False)
        p.shared = getattr(body.layers[0].bias, "shared", False)
    layer.weight.sequence_parallel = False
    layer.weight.shared = False
    body.layers[0] = layer


def with_fault_groups(case: PipelineCase, groups: Any) -> Any:
    """``groups`` as the case's fault has them: with ``"crossed_embedding_group"`` (TP 2) the
    embedding group of the first stage's TP rank ``t`` is the last stage's TP rank ``1 - t``
    (only the pair's two ranks create it). Every other case: ``groups`` unchanged."""
    if (case.fault != "crossed_embedding_group" or groups.pp_size == 1 or groups.tp_size != 2
            or not (groups.is_first_stage or groups.is_last_stage)):
        return groups
    from dataclasses import replace

    from fastgrad.pipeline_groups import global_rank

    peer_stage = groups.pp_size - 1 if groups.is_first_stage else 0
    peer = global_rank(peer_stage, groups.dp_rank, groups.dp_size, case.first_rank,
                       groups.tp_size, 1 - groups.tp_rank)
    ranks = tuple(sorted((groups.rank, peer)))
    group = dist.new_group(list(ranks), use_local_synchronization=True)
    return replace(groups, embedding_group=group, embedding_ranks=ranks)


def _step_marker(progress: Any, case: PipelineCase, stage: int, overlap: bool, step: int) -> Any:
    """A timeline listener naming case, stage and step, so a stalled rank says where it was."""
    if progress is None:
        return None
    return progress.timeline_listener(
        f"{case.name} overlap {'on' if overlap else 'off'}, stage {stage}, step {step}: ")


def run_interleaved_case_on_rank(case: PipelineCase, groups: Any, overlap: bool,
                                 progress: Any = None) -> RankResult:
    """Train an interleaved ``case`` (one DDP engine per model chunk) on this rank.

    ``progress`` (a ``verify.distributed.RankProgress``) is told each event as it happens.
    """
    from fastgrad.ddp import DistributedDataParallel
    from fastgrad.pipeline_interleaved import forward_backward_interleaved
    from fastgrad.timeline import Timeline

    V, stage = case.virtual_stages, groups.stage
    built = [build_stage_model(case, groups, c) for c in range(V)]
    chunks = [module for module, *_ in built]
    named = {n: p for _, per_chunk, _, _ in built for n, p in per_chunk.items()}
    heads = [head for _, _, head, _ in built]
    head = next((h for h in heads if h is not None), None)  # last virtual stage only
    tied = [p for *_, per_chunk in built for p in per_chunk]
    ddps = [DistributedDataParallel(chunk, config=case_ddp_config(case, overlap, stage, c),
                                    dp_group=groups.dp_group, average=case.reduction != "sum",
                                    external_grad_params=external_grad_params(case.spec, heads[c]))
            for c, chunk in enumerate(chunks)]
    result = RankResult(stage=stage, dp_rank=groups.dp_rank, tp_rank=groups.tp_rank)
    timeline = Timeline(groups.rank)
    for step, plan in enumerate(case.plans):
        timeline.listener = _step_marker(progress, case, groups.stage, overlap, step)
        for name, p in named.items():
            p.requires_grad_(name not in plan.frozen)
        for ddp in ddps:
            ddp.zero_grad_buffer()
        if head is not None:
            head.start_step()
        m = plan.num_microbatches
        inputs, targets, loss_fn = rank_microbatches(case, groups, step, m)
        timeline.clear()
        dist.barrier(group=groups.pp_group)
        log: list[tuple[int, tuple[bool, ...]]] = []
        losses = forward_backward_interleaved(
            chunks,
            groups=groups,
            grad_syncs=[_RecordingSync(ddps, c, log) for c in range(V)],
            num_microbatches=m,
            activation_shape=case.spec.stage_activation_shape,
            loss_fn=loss_fn,
            inputs=inputs if groups.is_first_stage else None,
            targets=targets if groups.is_last_stage else None,
            timeline=timeline,
            deferred_wgrad=drained_head(case.spec, head),
            embedding_params=tied,
        )
        result.events.append(list(timeline.events))
        for ddp in ddps:
            _full_reduced_grads(ddp, case, groups.dp_group)
        result.losses.append(total_losses(case, groups, losses))
        result.grads.append({n: p.main_grad.detach().clone() for n, p in named.items()})
        result.launch_sites.append(tuple(s for ddp in ddps for s in ddp.last_launch_sites))
        result.chunk_enables.append(log)
        with torch.no_grad():
            for p in updated_once(named, plan.frozen):
                p.copy_(sgd_update(p, p.main_grad, case.lr))
        result.params.append({n: p.detach().clone() for n, p in named.items()})
    result.relearn_count = sum(ddp.relearn_count for ddp in ddps)
    for ddp in ddps:
        ddp.remove_hooks()
    return result


def output_layer_class(fault: str | None) -> type:
    """fastgrad's output layer, or (fault ``"lifo_drain"``) a subclass whose drain runs the
    deferred GEMMs newest first; the fault lives on this rank's instance only."""
    from fastgrad.deferred_wgrad import ColumnParallelOutputLayer
    from verify.checks.pipeline.shared_weight import SHARED_WEIGHT_FAULTS, faulty_output_layer

    if fault in SHARED_WEIGHT_FAULTS:
        return faulty_output_layer(ColumnParallelOutputLayer, fault)
    if fault != "lifo_drain":
        return ColumnParallelOutputLayer

    class LifoDrainOutputLayer(ColumnParallelOutputLayer):
        """A wrong drain: newest deferred (input, grad_output) pair first."""

        def drain_deferred_wgrad(self, reduce_in_flight: Any = None) -> int:
            self.activation_buffer.reverse()
            self.grad_output_buffer.reverse()
            return super().drain_deferred_wgrad(reduce_in_flight)

    return LifoDrainOutputLayer


def build_stage_model(case: PipelineCase, groups: Any,
                      chunk: int = 0) -> tuple[Any, dict[str, Any], Any, list[Any]]:
    """This rank's model chunk ``chunk`` (virtual stage ``chunk * P + stage``) of ``case``:
    ``(module, named params, deferred-wgrad head or None, tied-embedding params)``; the head
    is the last virtual stage's output layer (``output_head``)."""
    spec = case.spec
    stage = chunk * case.pp_size + groups.stage  # the virtual stage
    body = StageModule(spec, stage)
    _mark_replicated(case, groups, body)
    if spec.vocab_parallel_embedding and stage == 0:
        _vocab_parallel_first_layer(case, groups, body)
    named = {stage_param_name(stage, n): p for n, p in body.named_parameters()}
    module, head, tied = body, None, []
    if spec.output_head and stage == spec.num_stages - 1:
        from fastgrad.deferred_wgrad import EmbeddingWgradConfig

        tp = spec.tensor_parallel  # vocab-parallel: this TP rank's rows of the head
        weight = head_weight_init(spec) if tp == 1 else head_shard(spec, head_weight_init(spec),
                                                                   groups.tp_rank)
        head = output_layer_class(case.fault)(
            weight,
            EmbeddingWgradConfig(defer_embedding_wgrad_compute=spec.defer_output_wgrad,
                                 wgrad_deferral_limit=spec.wgrad_deferral_limit,
                                 pipeline_model_parallel_size=case.pp_size,
                                 tensor_model_parallel_size=tp,
                                 sequence_parallel=spec.sequence_parallel),
            tp_group=groups.tp_group,
        )
        share_head_weight(spec, body, head)  # tied at PP 1: one Parameter, two uses
        module = BodyWithHead(body, head)
        named[stage_param_name(stage, HEAD_PARAM)] = head.weight
        if spec.tied_embedding:
            tied = [head.weight]
    if spec.tied_embedding and stage == 0:
        tied = [named[stage_param_name(0, EMBEDDING_PARAM)]]
    if spec.shares_one_weight:
        tied = []  # one weight: nothing to all-reduce, no own bucket (production at PP 1)
    for param in tied:
        # Own bucket, same bucket-relative offsets on both stages: the DP shards of the
        # two copies line up, so the embedding all-reduce is right on every shard.
        param.shared_embedding = True
    return module, named, head, tied


def run_case_on_rank(case: PipelineCase, groups: Any, overlap: bool,
                     progress: Any = None) -> RankResult:
    """Train ``case`` on this rank of its grid; return what it saw.

    ``progress`` (a ``verify.distributed.RankProgress``) is told each event as it happens.
    """
    if case.virtual_stages > 1:
        return run_interleaved_case_on_rank(case, groups, overlap, progress)
    from fastgrad.ddp import DistributedDataParallel
    from fastgrad.pipeline import forward_backward_1f1b
    from fastgrad.timeline import Timeline

    stage = groups.stage
    module, named, head, tied = build_stage_model(case, groups)
    ddp = DistributedDataParallel(
        module,
        config=case_ddp_config(case, overlap, stage),
        dp_group=groups.dp_group,
        average=case.reduction != "sum",
        external_grad_params=external_grad_params(case.spec, head),
    )
    result = RankResult(stage=stage, dp_rank=groups.dp_rank, tp_rank=groups.tp_rank)
    timeline = Timeline(groups.rank)
    for step, plan in enumerate(case.plans):
        timeline.listener = _step_marker(progress, case, groups.stage, overlap, step)
        for name, p in named.items():
            p.requires_grad_(name not in plan.frozen)
        ddp.zero_grad_buffer()
        if head is not None:
            head.start_step()
        m = plan.num_microbatches
        inputs, targets, loss_fn = rank_microbatches(case, groups, step, m)
        timeline.clear()
        if case.pp_size > 1:
            dist.barrier(group=groups.pp_group)
        losses = forward_backward_1f1b(
            module,
            groups=groups,
            grad_sync=ddp,
            num_microbatches=m,
            activation_shape=case.spec.stage_activation_shape,
            loss_fn=loss_fn,
            inputs=inputs if groups.is_first_stage else None,
            targets=targets if groups.is_last_stage else None,
            timeline=timeline,
            deferred_wgrad=drained_head(case.spec, head),
            embedding_params=tied,
        )
        result.events.append(list(timeline.events))
        _full_reduced_grads(ddp, case, groups.dp_group)
        result.losses.append(total_losses(case, groups, losses))
        result.grads.append({n: p.main_grad.detach().clone() for n, p in named.items()})
        result.launch_sites.append(ddp.last_launch_sites)
        with torch.no_grad():
            for p in updated_once(named, plan.frozen):
                p.copy_(sgd_update(p, p.main_grad, case.lr))
        result.params.append({n: p.detach().clone() for n, p in named.items()})
    result.relearn_count = ddp.relearn_count
    ddp.remove_hooks()
    return result


def pipeline_worker(rank: int, world_size: int, phases: list[list[PipelineCase]], *,
                    progress: Any = None) -> dict:
    """Spawned entry point: run every phase's grids side by side; results by case name.

    The harness passes ``progress``: a rank that stalls is reported with its case,
    stage, step and last schedule event.
    """
    from fastgrad.pipeline import build_parallel_groups

    out: dict[str, dict[bool, RankResult]] = {}
    for phase in phases:
        mine = []
        for case in phase:
            groups = build_parallel_groups(case.pp_size, case.dp_size, first_rank=case.first_rank,
                                           tp_size=case.tp_size)
            if groups is not None:
                mine.append((case, groups))
        for case, groups in mine:
            out[case.name] = {
                overlap: run_case_on_rank(case, groups, overlap, progress)
                for overlap in (True, False)
            }
        dist.barrier()
    return out

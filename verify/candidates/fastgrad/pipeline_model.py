"""fastgrad's pipeline model for a :class:`~verify.candidates.interfaces.PipelineCase`: the
stage modules, this rank's data and losses, fastgrad's output layer (or the subclass the caller names) and vocab-parallel
embedding, and the DDP settings.

The tied embedding on one pipeline stage (production's PP 1) is one weight with two uses:
Megatron-Core gives the output layer the word embedding's own parameter
(``shared_embedding_or_output_weight()``); per microbatch the backward reaches the output
layer first, whose wgrad GEMM adds into the weight's ``main_grad`` (gradient-accumulation
fusion), then the embedding's grad arrives in ``param.grad`` and the DDP hook adds it; no
embedding-group all-reduce, the param counted once in the grad norm. Here the first layer's
weight is the output layer's (:func:`share_head_weight`), DDP holds it once, readiness comes
from its autograd hook (not ``mark_grad_ready``), and nothing is drained (deferral needs
PP > 1). The reference is ``refgrad.pipeline``'s ``LinearStackSpec.shares_one_weight``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastgrad.deferred_wgrad import ColumnParallelOutputLayer, EmbeddingWgradConfig
from fastgrad.vocab_parallel_embedding import VocabParallelEmbedding
from gradvocab import DDPConfig, ParallelDims
from verify.candidates.interfaces import (
    EMBEDDING_PARAM,
    HEAD_PARAM,
    LinearStackSpec,
    PipelineCase,
    StageModule,
    head_shard,
    head_weight_init,
    rank_microbatches,
    splits_loss,
    stage_param_name,
)


def case_microbatches(case: PipelineCase, grid: ParallelDims, step: int, m: int
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                 Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """This rank's ``(inputs, targets, loss_fn)`` of step ``step`` (refgrad's
    :func:`~refgrad.pipeline.rank_microbatches` at this rank's DP and TP coordinates)."""
    return rank_microbatches(case.spec, grid.dp_rank, grid.tp_rank, step, m)


def total_losses(case: PipelineCase, grid: ParallelDims, losses: Sequence[torch.Tensor]) -> list[float]:
    """The step's losses: partial losses summed over the TP group (production's all-reduce)."""
    if losses and splits_loss(case.spec):
        stacked = torch.stack(list(losses))
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=grid.tp_group)
        losses = list(stacked)
    return [float(v) for v in losses]


def case_ddp_config(case: PipelineCase, overlap: bool, stage: int, chunk: int = 0) -> DDPConfig:
    """The DDP config of one model chunk of ``case`` on ``stage`` (production's bucket rule)."""
    return DDPConfig(
        use_distributed_optimizer=case.use_distributed_optimizer,
        reduce_scatter_with_fp32_accumulation=case.reduce_scatter_with_fp32_accumulation,
        average_in_collective=case.reduction.megatron_flags().average_in_collective,
        overlap_grad_reduce=overlap,
        bucket_size=case.bucket_size_for(stage, chunk),
    )


class BodyWithHead(torch.nn.Module):
    """The last stage with an output head: ``head(body(x))``."""

    def __init__(self, body: torch.nn.Module, head: torch.nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class VocabParallelFirstLayer(torch.nn.Module):
    """The first stage's first layer when tied at TP > 1, on this rank: fastgrad's
    vocab-parallel embedding (``weight``: this TP rank's rows, tied to its output-layer shard),
    then the replicated bias (refgrad: ``refgrad.pipeline.embedding``)."""

    def __init__(self, spec: LinearStackSpec, grid: ParallelDims, bias: torch.Tensor) -> None:
        super().__init__()
        self.embedding = VocabParallelEmbedding(
            head_shard(spec, head_weight_init(spec), grid.tp_rank), parallel_dims=grid)
        self.weight = self.embedding.weight  # named layers.0.weight, as refgrad's
        self.bias = torch.nn.Parameter(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding(x) + self.bias


def _mark_replicated(spec: LinearStackSpec, grid: ParallelDims, module: torch.nn.Module) -> None:
    """The blocks are replicated across TP. Under SP their grads are summed over TP after the
    DP sync (``sequence_parallel``); on TP ranks > 0 they are duplicates, left out of a grad
    norm summed over the model-parallel group (``shared``, as Megatron-Core's
    ``param_is_not_tensor_parallel_duplicate``)."""
    for p in module.parameters():
        if spec.sequence_shards > 1:
            p.sequence_parallel = True
        if grid.tp_rank > 0:
            p.shared = True


def _vocab_parallel_first_layer(spec: LinearStackSpec, grid: ParallelDims, body: StageModule) -> None:
    """Swap the tied first layer for this rank's vocab-parallel one. Its weight is split over
    TP, not replicated: no TP sum of its grad, and it counts in the grad norm on every TP rank."""
    layer = VocabParallelFirstLayer(spec, grid, body.layers[0].bias)
    for p in layer.parameters():  # the bias: replicated, as body.layers[0].bias was
        p.sequence_parallel = getattr(body.layers[0].bias, "sequence_parallel", False)
        p.shared = getattr(body.layers[0].bias, "shared", False)
    layer.weight.sequence_parallel = False
    layer.weight.shared = False
    body.layers[0] = layer


def share_head_weight(spec: LinearStackSpec, body: StageModule, head: ColumnParallelOutputLayer) -> None:
    """Tied on one stage: make the output layer compute with the first layer's weight (one
    Parameter, its ``main_grad`` the DDP buffer's view); otherwise leave both alone."""
    if spec.shares_one_weight:
        head.weight = body.layers[0].weight


def external_grad_params(spec: LinearStackSpec, head: ColumnParallelOutputLayer | None) -> list[Any]:
    """The params whose ``main_grad`` only the output layer writes (made ready by the schedule's
    ``mark_grad_ready``): its weight, unless the first layer shares it (then autograd's hook
    makes it ready, after the output layer's wgrad)."""
    return [] if head is None or spec.shares_one_weight else [head.weight]


def drained_head(spec: LinearStackSpec, head: ColumnParallelOutputLayer | None
                 ) -> ColumnParallelOutputLayer | None:
    """What the schedule drains and marks ready: the output layer, or None when its weight is
    the first layer's (PP 1: nothing is deferred; the first layer's hook marks it ready)."""
    return None if spec.shares_one_weight else head


def build_stage_model(case: PipelineCase, grid: ParallelDims, chunk: int = 0,
                      output_layer_class: type[ColumnParallelOutputLayer] = ColumnParallelOutputLayer
                      ) -> tuple[torch.nn.Module, dict[str, Any], ColumnParallelOutputLayer | None,
                                 list[Any]]:
    """This rank's model chunk ``chunk`` (virtual stage ``chunk * P + stage``) of ``case``:
    ``(module, named params, deferred-wgrad head or None, tied-embedding params)``; the head
    is the last virtual stage's output layer (``output_head``), an ``output_layer_class``."""
    spec = case.spec
    stage = chunk * case.pp_size + grid.stage  # the virtual stage
    body = StageModule(spec, stage)
    _mark_replicated(spec, grid, body)
    if spec.vocab_parallel_embedding and stage == 0:
        _vocab_parallel_first_layer(spec, grid, body)
    named = {stage_param_name(stage, n): p for n, p in body.named_parameters()}
    module: torch.nn.Module = body
    head, tied = None, []
    if spec.output_head and stage == spec.num_stages - 1:
        tp = spec.tensor_parallel  # vocab-parallel: this TP rank's rows of the head
        weight = head_weight_init(spec) if tp == 1 else head_shard(spec, head_weight_init(spec),
                                                                   grid.tp_rank)
        head = output_layer_class(
            weight,
            EmbeddingWgradConfig(defer_embedding_wgrad_compute=spec.defer_output_wgrad,
                                 wgrad_deferral_limit=spec.wgrad_deferral_limit),
            parallel_dims=grid,
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

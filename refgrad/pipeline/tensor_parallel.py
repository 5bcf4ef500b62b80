"""The pipeline model split over tensor parallelism (TP) and sequence parallelism (SP).

``refgrad.pipeline``'s Linear+tanh stack split as production splits it over a
TP group of ``T`` ranks (bitwise claims hold for ``T <= 2``, see below):

- the **output head** is vocab- (column-) parallel: TP rank ``k`` holds rows
  ``k*V/T .. (k+1)*V/T`` of ``W_head`` and computes its logits block
  ``X · W_kᵀ`` as its own GEMM; its input gradient is ``sum_k G_k · W_k``
  (production: all-reduced over TP, or reduce-scattered under SP); its weight
  gradient ``G_kᵀ · X`` is accumulated per shard in the deferral order;
- the **Linear+tanh blocks** are replicated. Without SP every TP rank runs
  them on the whole microbatch (identical grads, nothing to sum). With SP TP
  rank ``k`` runs them on rows ``k*R/T .. (k+1)*R/T`` (its sequence shard; the
  head all-gathers them), so each rank's microbatch-ordered grad sum covers its
  rows only; after the DP reduction production all-reduces those grads over TP
  (``param.sequence_parallel``, as Megatron-Core does for layernorm params):
  ``R_0 + ... + R_{T-1}``;
- **tied** (``tied_embedding``), the first stage's first layer is a
  vocab-parallel embedding tied to the head, row block by row block
  (``refgrad.pipeline.embedding``): computed once on every row, so under SP
  each body copy starts from its rows of the TP sum, and its ``[V, H]`` grad
  is one sum, not one per shard; on one stage (``shares_one_weight``, PP 1)
  it is the head's weight itself, each microbatch adding every TP rank's head
  wgrad into that sum before the first layer's grad;
- the **loss** is separable over the split: with a head each TP rank's MSE
  covers its vocab block, with SP and no head its rows; each partial is
  ``sum (out - target)^2 / (R * V) / M`` and the reported loss is the TP sum of
  the partials (production all-reduces them).

This module holds the split: each rank's rows, vocab block, head shard and partial loss,
and one body copy per sequence shard (so their grads stay apart), each of the same shape as
on the rank; ``refgrad.pipeline.grad_sums`` runs them (one GEMM per vocab block) and
``refgrad.pipeline.reduction`` sums over TP. At ``T = 1`` the split is the whole model: one
body, one vocab block, the whole loss. Every TP sum above has ``T`` terms: for ``T = 2``
it is one addition, correctly rounded in either order, so fastgrad must match bitwise;
for ``T > 2`` the backend chooses the order and no bitwise claim is made here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from refgrad.pipeline.embedding import vocab_block
from refgrad.pipeline.spec import (
    EMBEDDING_PARAM,
    HEAD_PARAM,
    LinearStackSpec,
    microbatch_data,
    microbatch_loss,
    stage_param_name,
)


def splits_loss(spec: LinearStackSpec) -> bool:
    """Whether each TP rank computes a partial loss (a vocab block, or a sequence shard)."""
    return spec.tensor_parallel > 1 and (spec.output_head or spec.sequence_parallel)


def sequence_shard(spec: LinearStackSpec, rows: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s rows of a microbatch tensor under SP (all rows without)."""
    shards = spec.sequence_shards
    if shards == 1:
        return rows
    r = rows.shape[0] // shards
    return rows[tp_rank * r:(tp_rank + 1) * r].contiguous()


def loss_target(spec: LinearStackSpec, target: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """The part of a microbatch's target TP rank ``tp_rank``'s partial loss covers."""
    if not splits_loss(spec):
        return target
    if spec.output_head:
        block = spec.hidden // spec.tensor_parallel
        return target[:, tp_rank * block:(tp_rank + 1) * block].contiguous()
    return sequence_shard(spec, target, tp_rank)


def stage_loss(spec: LinearStackSpec, output: torch.Tensor, target_part: torch.Tensor,
               num_microbatches: int) -> torch.Tensor:
    """One rank's loss of one microbatch: the MSE over all of it without a split, else this
    rank's partial ``sum (out - target)^2 / (R * V) / M`` (the partials sum to the MSE)."""

    if not splits_loss(spec):
        return microbatch_loss(output, target_part, num_microbatches)
    total = spec.microbatch_size * spec.hidden
    return (output - target_part).square().sum() / total / num_microbatches


def rank_microbatches(spec: LinearStackSpec, dp_rank: int, tp_rank: int, step: int, m: int
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                 Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """One rank's ``(inputs, targets, loss_fn)`` for one step: its replica's data
    (:func:`microbatch_data`), its sequence shard of the inputs under SP (its vocabulary
    columns for the vocab-parallel first layer), and the part of each target its (partial)
    loss covers."""
    inputs, targets = microbatch_data(spec, dp_rank, step, m)
    if spec.vocab_parallel_embedding:  # every row, this rank's vocabulary columns
        inputs = [vocab_block(spec, x, tp_rank) for x in inputs]
    else:
        inputs = [sequence_shard(spec, x, tp_rank) for x in inputs]
    targets = [loss_target(spec, t, tp_rank) for t in targets]
    return inputs, targets, lambda out, target: stage_loss(spec, out, target, m)


def head_shard(spec: LinearStackSpec, head: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s rows of the output head's ``[V, H]`` weight, as its own tensor."""
    block = spec.hidden // spec.tensor_parallel
    return head.detach()[tp_rank * block:(tp_rank + 1) * block].clone()


def sequence_shard_bodies(spec: LinearStackSpec, stages: Sequence[nn.Module]
                          ) -> tuple[list[list[nn.Module]], list[dict[str, nn.Parameter]]]:
    """One copy of the stage bodies per sequence shard (the first is ``stages`` itself), and
    each copy's params by name."""

    bodies = [list(stages)] + [copy.deepcopy(list(stages)) for _ in range(1, spec.sequence_shards)]
    named = [{stage_param_name(s, n): p for s, st in enumerate(body) for n, p in st.named_parameters()}
             for body in bodies]
    return bodies, named


def forward_shards(spec: LinearStackSpec, bodies: Sequence[Sequence[nn.Module]],
                   x: torch.Tensor) -> list[torch.Tensor]:
    """Each sequence shard's body output for the microbatch ``x``. Under SP with the
    vocab-parallel first layer, that layer's product is computed once on every row (one
    wgrad GEMM over all rows, as the ranks run it) and each body starts from its rows of it."""
    embedded = (bodies[0][0].layers[0].embed(x)
                if spec.sequence_shards > 1 and spec.vocab_parallel_embedding else None)
    outs = []
    for k, body in enumerate(bodies):
        if embedded is None:
            out = body[0](sequence_shard(spec, x, k))
        else:
            out = body[0].after_embedding(sequence_shard(spec, embedded, k))
        for stage in body[1:]:
            out = stage(out)
        outs.append(out)
    return outs


def expected_on_rank(spec: LinearStackSpec, name: str, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """What TP rank ``tp_rank`` holds of the reference tensor ``full`` named ``name``: its row
    block of the vocab-parallel head (and, tied, of the vocab-parallel first layer), every
    other tensor whole (replicated)."""
    if spec.tensor_parallel == 1 or name not in vocab_split_names(spec):
        return full
    block = spec.hidden // spec.tensor_parallel
    return full[tp_rank * block:(tp_rank + 1) * block]


def vocab_split_names(spec: LinearStackSpec) -> frozenset[str]:
    """The parameters split over TP by vocabulary rows: the head, and (tied) the first layer."""

    names = {stage_param_name(spec.num_stages - 1, HEAD_PARAM)}
    if spec.vocab_parallel_embedding:
        names.add(stage_param_name(0, EMBEDDING_PARAM))
    return frozenset(names)

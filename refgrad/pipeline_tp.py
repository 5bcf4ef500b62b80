"""Reference for the pipeline model with tensor parallelism (TP) and sequence parallelism (SP).

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
  (``refgrad.pipeline_embedding``): computed once on every row, so under SP
  each body copy starts from its rows of the TP sum, and its ``[V, H]`` grad
  is one sum, not one per shard; on one stage (``shares_one_weight``, PP 1)
  it is the head's weight itself, each microbatch adding every TP rank's head
  wgrad into that sum before the first layer's grad;
- the **loss** is separable over the split: with a head each TP rank's MSE
  covers its vocab block, with SP and no head its rows; each partial is
  ``sum (out - target)^2 / (R * V) / M`` and the reported loss is the TP sum of
  the partials (production all-reduces them).

This module models the per-rank partial sums with one body copy per sequence
shard (so their grads stay apart) and one GEMM per vocab block, each of the
same shape as on the rank. Every TP sum above has ``T`` terms: for ``T = 2``
it is one fp32 addition, correctly rounded in either order, so fastgrad must
match bitwise; for ``T > 2`` the backend chooses the order and no bitwise claim
is made here.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from refgrad.pipeline_spec import (
    EMBEDDING_PARAM,
    HEAD_PARAM,
    HeadRecordingWgrad,
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


def tp_replica_grad_sums(
    spec: LinearStackSpec,
    stages: Sequence[nn.Module],
    named: dict[str, torch.Tensor],
    head: torch.Tensor | None,
    step: int,
    num_microbatches: int,
    dp_size: int,
) -> tuple[list[dict[str, torch.Tensor]], list[list[float]]]:
    """``refgrad.pipeline.replica_grad_sums`` at TP > 1 (see the module docstring).

    Under SP a block parameter's sum has a leading TP dimension (one microbatch-ordered
    sum per TP rank); the head's ``[V, H]`` sum is the row blocks of every TP rank.
    """

    shards, tp = spec.sequence_shards, spec.tensor_parallel
    head_name = stage_param_name(spec.num_stages - 1, HEAD_PARAM)
    tied_name = stage_param_name(0, EMBEDDING_PARAM)
    # TP-split like the head: one grad sum of all of it, never per sequence shard.
    split = vocab_split_names(spec)
    copies, copy_named = sequence_shard_bodies(spec, stages)
    body_names = [n for n in named if n != head_name]
    per_replica_sums: list[dict[str, torch.Tensor]] = []
    step_losses: list[list[float]] = []
    for dp_rank in range(dp_size):
        inputs, targets = microbatch_data(spec, dp_rank, step, num_microbatches)
        sums = {n: torch.zeros((shards, *named[n].shape)) if shards > 1 and n not in split
                else torch.zeros_like(named[n]) for n in body_names}
        if head is not None:
            sums[head_name] = torch.zeros_like(head)
        records: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = []
        losses: list[float] = []
        for x, target in zip(inputs, targets):
            for params in copy_named:
                for p in params.values():
                    p.grad = None
            outs = forward_shards(spec, copies, x)
            if head is not None:
                full = torch.cat(outs) if shards > 1 else outs[0]  # the all-gather
                # One record per vocab block: autograd may run the blocks' backwards in any order.
                record: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(tp)]
                partials = [stage_loss(spec, HeadRecordingWgrad.apply(full, head_shard(spec, head, k),
                                                                      record[k]),
                                       loss_target(spec, target, k), num_microbatches)
                            for k in range(tp)]
                records.append(record)
            elif shards > 1:
                partials = [stage_loss(spec, outs[k], loss_target(spec, target, k), num_microbatches)
                            for k in range(shards)]
            else:
                partials = [stage_loss(spec, outs[0], target, num_microbatches)]
            loss = partials[0]
            for part in partials[1:]:
                loss = loss + part  # the TP all-reduce of the partial losses
            loss.backward()
            losses.append(float(loss.detach()))
            if spec.shares_one_weight:  # one weight (one stage): each TP rank's head wgrad first
                wgrad = torch.cat([torch.mm(g.t(), x) for [(g, x)] in records.pop()])
                sums[tied_name] = sums[tied_name] + wgrad
            for k, params in enumerate(copy_named):
                for n, p in params.items():
                    if p.grad is None:
                        continue
                    if shards > 1 and n not in split:
                        sums[n][k] = sums[n][k] + p.grad
                    else:
                        sums[n] = sums[n] + p.grad
        if spec.shares_one_weight:
            sums[head_name] = sums[tied_name].clone()  # one parameter, reported under both names
        elif head is not None:
            for m in spec.head_wgrad_order(num_microbatches):
                wgrad = torch.cat([torch.mm(g.t(), x) for [(g, x)] in records[m]])
                sums[head_name] = sums[head_name] + wgrad
        step_losses.append(losses)
        per_replica_sums.append(sums)
    return per_replica_sums, step_losses


def sum_over_tensor_parallel(spec: LinearStackSpec, reduced: dict[str, torch.Tensor]) -> None:
    """In place: each block parameter's per-TP-rank DP-reduced grads summed in TP-rank order
    (the all-reduce of sequence-parallel grads after the DP sync; one add at TP 2)."""
    split = vocab_split_names(spec)
    for name, per_rank in reduced.items():
        if name in split:
            continue
        total = per_rank[0]
        for k in range(1, spec.sequence_shards):
            total = total + per_rank[k]
        reduced[name] = total


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

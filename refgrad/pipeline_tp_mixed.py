"""Reference for the TP 2 pipeline model with 16-bit (bf16/fp16) params and a main-grad buffer.

``refgrad.pipeline_tp``'s split (vocab-parallel output head, Linear+tanh
blocks replicated across TP, on sequence shards under SP) trained as
``refgrad.pipeline_mixed`` trains the TP 1 model, one process:

1. per TP rank, the same 16-bit ops on the same shapes as that rank: one body
   copy per sequence shard (the blocks' forward and backward in the param
   dtype on the rank's rows, or on every row without SP) and, per vocab block
   ``k``, the head's logits ``X · W_kᵀ`` and input gradient ``G_k · W_k`` as
   their own 16-bit GEMMs (the CPU kernels round identically for equal shapes);
   tied, the vocab-parallel first layer (``refgrad.pipeline_embedding``) runs
   each rank's 16-bit partial ``x_k · W_k`` on every row and their 16-bit TP
   sum (two terms, one rounding: production's all-reduce, or under SP its
   reduce-scatter, computed once here, each body copy starting from its rows),
   and each rank's wgrad ``x_kᵀ · G`` over every row (under SP ``G`` is the
   all-gather of the shards' grads) as its own 16-bit GEMM;
2. each TP rank's partial loss ``sum (out - target)^2 / (R * V) / M`` computed
   in fp32 on its 16-bit output block, times the loss scale ``S``; the reported
   loss is the fp32 sum of the partials (production all-reduces them);
3. the TP sum of the head's partial input gradients in the param dtype:
   production all-reduces (or, under SP, reduce-scatters) the 16-bit
   ``G_k · W_k`` over TP; two terms, one rounding, in any order, which is what
   autograd's 16-bit add of the two blocks' gradients computes here;
4. each TP rank's per-microbatch 16-bit grads added into its grad-dtype buffer
   (one rounding per add, microbatch order; the tied first layer, split over
   TP by rows, in one buffer even under SP), the head's per-block wgrad as an
   fp32 GEMM on the widened 16-bit values added in ``spec.head_wgrad_order``
   (``refgrad.pipeline_mixed``'s steps 3 and 4, per block);
5. the DP reduction in the grad dtype (``refgrad.pipeline_mixed``), then,
   under SP, each replicated block grad (not the head or the tied first
   layer: they are split over TP) summed over the TP ranks in the grad
   dtype: production's all-reduce of ``main_grad`` after the DP sync, two
   grad-dtype terms correctly rounded once (:func:`mixed_sum_over_tensor_parallel`).

Bitwise claims hold for ``tensor_parallel == 2`` only (every TP sum has two terms).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from refgrad.exact import correctly_rounded_sum

if TYPE_CHECKING:
    from refgrad.pipeline import LinearStackSpec


def check_tensor_parallel_2(spec: LinearStackSpec) -> None:
    """ValueError unless ``spec`` is the TP 2 model this module reproduces bitwise."""
    if spec.tensor_parallel != 2:
        raise ValueError("refgrad.pipeline_tp_mixed models tensor_parallel 2 only (a TP sum of more "
                         f"than two 16-bit terms has a backend-chosen order), got {spec.tensor_parallel}")


def mixed_tp_replica_grad_sums(
    spec: LinearStackSpec,
    stages: Sequence[nn.Module],
    named: dict[str, torch.Tensor],
    head: torch.Tensor | None,
    step: int,
    num_microbatches: int,
    dp_size: int,
    *,
    grad_dtype: torch.dtype,
    loss_scale: float | None = None,
) -> tuple[list[dict[str, torch.Tensor]], list[list[float]]]:
    """Each replica's grad-dtype buffers after one step (steps 1-4 of the module doc) and its
    unscaled losses. Under SP a block param's buffer has a leading TP dimension (one per TP
    rank's sequence shard); the head's ``[V, H]`` buffer is every TP rank's row block."""
    from refgrad.pipeline import (
        EMBEDDING_PARAM,
        HEAD_PARAM,
        HeadRecordingWgrad,
        microbatch_data,
        stage_param_name,
    )
    from refgrad.pipeline_tp import (
        forward_shards,
        head_shard,
        loss_target,
        sequence_shard_bodies,
        stage_loss,
        vocab_split_names,
    )

    check_tensor_parallel_2(spec)
    if head is None:
        raise ValueError("refgrad.pipeline_tp_mixed needs the output head (LinearStackSpec.output_head)")
    param_dtype = next(iter(named.values())).dtype
    scale = 1.0 if loss_scale is None else float(loss_scale)
    shards, tp = spec.sequence_shards, spec.tensor_parallel
    head_name = stage_param_name(spec.num_stages - 1, HEAD_PARAM)
    tied_name = stage_param_name(0, EMBEDDING_PARAM)
    bodies, copy_named = sequence_shard_bodies(spec, stages)
    split = vocab_split_names(spec)  # TP-split by vocabulary rows: one buffer, never per shard
    body_names = [n for n in named if n != head_name]
    per_replica: list[dict[str, torch.Tensor]] = []
    step_losses: list[list[float]] = []
    for dp_rank in range(dp_size):
        inputs, targets = microbatch_data(spec, dp_rank, step, num_microbatches)
        sums = {n: torch.zeros((shards, *named[n].shape) if shards > 1 and n not in split
                               else named[n].shape, dtype=grad_dtype) for n in body_names}
        records: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = []
        losses: list[float] = []
        for x, target in zip(inputs, targets):
            for params in copy_named:
                for p in params.values():
                    p.grad = None
            # SP with the vocab-parallel first layer: each rank's 16-bit partial x_k · W_k on every
            # row, their 16-bit TP sum computed once (the reduce-scatter: two terms, one rounding),
            # each body starting from its rows of it; backward, each rank's wgrad x_kᵀ · G over
            # every row (G: the all-gather of the shards' output grads) as its own 16-bit GEMM.
            outs = forward_shards(spec, bodies, x.to(param_dtype))  # (a row slice commutes with the cast)
            full = torch.cat(outs) if shards > 1 else outs[0]  # the all-gather (16 bits)
            record: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(tp)]
            partials = [stage_loss(spec, HeadRecordingWgrad.apply(full, head_shard(spec, head, k),
                                                                  record[k]).float(),
                                   loss_target(spec, target, k), num_microbatches)
                        for k in range(tp)]
            records.append(record)
            loss = partials[0] + partials[1]  # the TP all-reduce of the partial losses (fp32)
            # Each rank's backward starts from its own partial times S; the gradient of
            # (p0 + p1) * S with respect to each partial is S, exactly.
            (loss * scale).backward()
            losses.append(float(loss.detach()))
            with torch.no_grad():
                if spec.shares_one_weight:  # one weight (one stage): each TP rank's head wgrad first
                    wgrad = torch.cat([torch.mm(g.t().float(), x.float()) for [(g, x)] in records.pop()])
                    sums[tied_name] = (sums[tied_name].float() + wgrad).to(grad_dtype)
                for k, params in enumerate(copy_named):
                    for n, p in params.items():
                        if p.grad is None:
                            continue
                        if shards > 1 and n not in split:
                            sums[n][k] = sums[n][k].add(p.grad).to(grad_dtype)
                        else:
                            sums[n] = sums[n].add(p.grad).to(grad_dtype)
        with torch.no_grad():
            head_sum = torch.zeros(head.shape, dtype=grad_dtype)
            for m in spec.head_wgrad_order(num_microbatches) if records else ():
                wgrad = torch.cat([torch.mm(g.t().float(), x.float()) for [(g, x)] in records[m]])
                head_sum = (head_sum.float() + wgrad).to(grad_dtype)
            # One weight (one stage): reported under both names.
            sums[head_name] = sums[tied_name].clone() if spec.shares_one_weight else head_sum
        step_losses.append(losses)
        per_replica.append(sums)
    return per_replica, step_losses


def mixed_sum_over_tensor_parallel(spec: LinearStackSpec, reduced: dict[str, torch.Tensor]) -> None:
    """In place: each replicated block's two per-TP-rank DP-reduced grad-dtype buffers summed and
    rounded once to the grad dtype (production's all-reduce of sequence-parallel ``main_grad``
    over TP after the DP sync: two terms, one rounding in any order)."""
    from refgrad.pipeline_tp import vocab_split_names

    check_tensor_parallel_2(spec)
    split = vocab_split_names(spec)
    for name, per_rank in reduced.items():
        if name in split:  # the head (and, tied, the first layer): split over TP, not summed
            continue
        pair = [per_rank[0], per_rank[1]]
        if all(bool(t.isfinite().all()) for t in pair):
            reduced[name] = correctly_rounded_sum(pair, per_rank.dtype)
        else:  # an overflowed fp16 step (skipped by the scaler): IEEE inf/NaN propagation
            reduced[name] = (pair[0].float() + pair[1].float()).to(per_rank.dtype)

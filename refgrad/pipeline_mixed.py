"""Reference for the pipeline model with 16-bit (bf16/fp16) params and a main-grad buffer.

``refgrad.pipeline``'s Linear+tanh stack as production trains it under
``--bf16`` or ``--fp16``, one process, in this order (at tensor parallelism 2
steps 2-4 run per TP rank as ``refgrad.pipeline_tp_mixed`` describes, and
step 5 adds the sequence-parallel grads' TP sum in the grad dtype):

1. params: the fp32 initial values of ``refgrad.pipeline`` rounded once to the
   param dtype (the model is built in fp32 and cast, as Megatron-Core's
   ``Float16Module``); the optimizer's fp32 masters are those 16-bit values.
2. per microbatch, in microbatch order: the input rounded to the param dtype,
   the forward and backward of every stage *in the param dtype* (the same
   torch ops on the same shapes as the pipelined ranks, so the CPU kernels
   round identically), the MSE loss computed on the output widened to fp32
   (production's loss runs in fp32 on 16-bit logits), multiplied by the loss
   scale ``S`` before the backward (so the 16-bit grads are the scaled ones:
   they may overflow, which is what the dynamic scaler detects);
3. each parameter's 16-bit grad added into a zero main-grad buffer of
   ``grad_dtype`` (fp32 with ``--accumulate-allreduce-grads-in-fp32``, else
   the param dtype): one add per microbatch, computed in the wider of the two
   dtypes and rounded once to ``grad_dtype`` (torch's ``main_grad.add_(grad)``);
4. the output head's weight gradient of each microbatch as fastgrad's CPU
   output layer computes it: an fp32 GEMM on the exactly widened 16-bit
   ``grad_output`` and input, added in fp32 to the buffer and rounded once
   more when the buffer is 16-bit (``refgrad.deferred_wgrad``'s step 3), in
   ``spec.head_wgrad_order``; tied on one stage (``spec.shares_one_weight``,
   production's PP 1) the head and the first layer are one weight, and each
   microbatch adds the head's wgrad into its buffer before the first layer's
   grad (the backward reaches the head first);
5. the DP reduction of ``refgrad.pipeline.reduce_across_replicas`` in the
   grad dtype (pre-scaled by ``1/D`` in the grad dtype, then summed in rank
   order with fp32 accumulation and one rounding to the grad dtype: the
   correctly rounded sum for ``D <= 2``, fastgrad's fp32-accumulating
   reduce-scatter for any ``D``), then (TP 2 under SP) the replicated blocks'
   grads summed over TP, then the tied-embedding all-reduce of two grad-dtype
   values (one rounding; none for the one weight of ``shares_one_weight``).

The optimizer step on these grads (fp32 masters, the cast back to 16 bits)
is ``refgrad.optim``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from gradvocab.averaging import Averaging
from refgrad.exact import correctly_rounded_sum

if TYPE_CHECKING:
    from refgrad.pipeline import LinearStackSpec

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def cast_params_(params: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    """Round every param (in place, keeping the tensor objects) to ``dtype``."""
    with torch.no_grad():
        for p in params:
            p.data = p.data.to(dtype)


def _check(spec: LinearStackSpec, param_dtype: torch.dtype, grad_dtype: torch.dtype) -> None:
    if spec.tensor_parallel > 1:
        from refgrad.pipeline_tp_mixed import check_tensor_parallel_2

        check_tensor_parallel_2(spec)
    if param_dtype not in SIXTEEN_BIT:
        raise ValueError(f"param_dtype must be bf16 or fp16, got {param_dtype}")
    if grad_dtype not in (torch.float32, param_dtype):
        raise ValueError(f"grad_dtype must be fp32 or the param dtype {param_dtype}, got {grad_dtype}")


def mixed_replica_grad_sums(
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
    """Each replica's main-grad buffer after one step's microbatches (steps 2-4 of the module
    doc) and its unscaled losses. ``stages``, ``named`` and ``head`` hold 16-bit params."""
    from refgrad.pipeline import (
        EMBEDDING_PARAM,
        HEAD_PARAM,
        HeadRecordingWgrad,
        microbatch_data,
        microbatch_loss,
        stage_param_name,
    )

    param_dtype = next(iter(named.values())).dtype
    _check(spec, param_dtype, grad_dtype)
    if spec.tensor_parallel > 1:
        from refgrad.pipeline_tp_mixed import mixed_tp_replica_grad_sums

        return mixed_tp_replica_grad_sums(spec, stages, named, head, step, num_microbatches,
                                          dp_size, grad_dtype=grad_dtype, loss_scale=loss_scale)
    scale = 1.0 if loss_scale is None else float(loss_scale)
    head_name = stage_param_name(spec.num_stages - 1, HEAD_PARAM)
    tied_name = stage_param_name(0, EMBEDDING_PARAM)
    per_replica: list[dict[str, torch.Tensor]] = []
    step_losses: list[list[float]] = []
    for dp_rank in range(dp_size):
        inputs, targets = microbatch_data(spec, dp_rank, step, num_microbatches)
        sums = {name: torch.zeros(p.shape, dtype=grad_dtype) for name, p in named.items()}
        losses: list[float] = []
        record: list[tuple[torch.Tensor, torch.Tensor]] = []
        for x, target in zip(inputs, targets):
            for p in named.values():
                p.grad = None
            out = x.to(param_dtype)
            for stage in stages:
                out = stage(out)
            if head is not None:
                out = HeadRecordingWgrad.apply(out, head, record)
            loss = microbatch_loss(out.float(), target, num_microbatches)
            (loss * scale).backward()
            losses.append(float(loss.detach()))
            with torch.no_grad():
                if spec.shares_one_weight:  # the head's wgrad first (step 4), then the first layer's
                    grad_output, head_input = record.pop()
                    wgrad = torch.mm(grad_output.t().float(), head_input.float())
                    sums[tied_name] = (sums[tied_name].float() + wgrad).to(grad_dtype)
                for name, p in named.items():
                    if p.grad is not None:  # the head's stays None: HeadRecordingWgrad records it
                        sums[name] = sums[name].add(p.grad).to(grad_dtype)
        with torch.no_grad():
            for k in spec.head_wgrad_order(num_microbatches) if record else ():
                grad_output, head_input = record[k]
                wgrad = torch.mm(grad_output.t().float(), head_input.float())
                sums[head_name] = (sums[head_name].float() + wgrad).to(grad_dtype)
        if spec.shares_one_weight:
            sums[head_name] = sums[tied_name].clone()  # one parameter, reported under both names
        step_losses.append(losses)
        per_replica.append(sums)
    return per_replica, step_losses


def mixed_reduce_and_tie(
    spec: LinearStackSpec, per_replica: Sequence[dict[str, torch.Tensor]], reduction: Averaging
) -> dict[str, torch.Tensor]:
    """Step 5 of the module doc: the DP reduction in the grad dtype, then the tied embedding."""
    from refgrad.pipeline import (
        EMBEDDING_PARAM,
        HEAD_PARAM,
        reduce_across_replicas,
        stage_param_name,
    )

    reduced = {name: reduce_across_replicas([sums[name] for sums in per_replica], reduction)
               for name in per_replica[0]}
    if spec.sequence_shards > 1:  # TP 2 under SP: the replicated blocks' grads summed over TP
        from refgrad.pipeline_tp_mixed import mixed_sum_over_tensor_parallel

        mixed_sum_over_tensor_parallel(spec, reduced)
    if spec.tied_embedding and not spec.shares_one_weight:  # one stage: one weight, no all-reduce
        head_name = stage_param_name(spec.num_stages - 1, HEAD_PARAM)
        tied_name = stage_param_name(0, EMBEDDING_PARAM)
        pair = [reduced[tied_name], reduced[head_name]]
        if all(bool(t.isfinite().all()) for t in pair):
            tied = correctly_rounded_sum(pair, pair[0].dtype)
        else:  # an overflowed fp16 step (skipped by the scaler): IEEE inf/NaN propagation
            tied = (pair[0].float() + pair[1].float()).to(pair[0].dtype)
        reduced[tied_name] = tied
        reduced[head_name] = tied.clone()
    return reduced

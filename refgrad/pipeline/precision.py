"""Where the pipeline reference rounds: the param dtype, the grad dtype, and every addition.

One set of steps serves fp32 and production's ``--bf16`` / ``--fp16`` training; the param and
grad dtypes only change where the roundings land (with fp32 params and fp32 grads every
widening below is the identity and every cast a no-op, so the steps are the fp32 model's):

1. params: the fp32 initial values rounded once to the param dtype (the model is built in fp32
   and cast, as Megatron-Core's ``Float16Module``; :func:`cast_params_`); the optimizer's fp32
   masters are those values.
2. per microbatch, in microbatch order: the input rounded to the param dtype, the forward and
   backward of every stage *in the param dtype* (the same torch ops on the same shapes as the
   pipelined ranks, so the CPU kernels round identically), the MSE loss computed on the output
   widened to fp32 (production's loss runs in fp32 on 16-bit logits), multiplied by the loss
   scale ``S`` before the backward when one is given (so the 16-bit grads are the scaled ones:
   they may overflow, which is what the dynamic scaler detects).
3. each parameter's grad added into a zero main-grad buffer of the grad dtype (fp32 with
   ``--accumulate-allreduce-grads-in-fp32``, else the param dtype): one add per microbatch,
   computed in the wider of the two dtypes and rounded once to the grad dtype (torch's
   ``main_grad.add_(grad)``; :func:`accumulate`).
4. the output head's weight gradient as fastgrad's CPU output layer computes it: an fp32 GEMM
   on the exactly widened ``grad_output`` and input (:func:`head_wgrad`), added in fp32 to the
   buffer and rounded once more when the buffer is 16-bit (``refgrad.deferred_wgrad``'s step 3;
   :func:`add_in_fp32`).
5. every sum of two reduced grads (the TP sum of sequence-parallel grads at TP 2, the
   tied-embedding all-reduce): correctly rounded once to the grad dtype (:func:`add_rounded`).

At tensor parallelism 2 steps 2-4 run per TP rank (``refgrad.pipeline.tensor_parallel``);
16-bit params are modelled at TP 1 and TP 2 only (a TP sum of more than two 16-bit terms has a
backend-chosen order). The optimizer step on these grads (fp32 masters, the cast back to 16
bits) is ``refgrad.optim``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refgrad.exact import correctly_rounded_sum
from refgrad.pipeline.spec import LinearStackSpec

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
PARAM_DTYPES = (torch.float32, *SIXTEEN_BIT)


def cast_params_(params: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    """Round every param (in place, keeping the tensor objects) to ``dtype``."""
    with torch.no_grad():
        for p in params:
            p.data = p.data.to(dtype)


def check_precision(spec: LinearStackSpec, param_dtype: torch.dtype, grad_dtype: torch.dtype,
                    *, output_head: bool) -> None:
    """ValueError unless the reference models ``spec`` with these dtypes bitwise: params fp32,
    bf16 or fp16, grads fp32 or the param dtype, and 16-bit params at TP 2 only with the head
    (``output_head``: whether the head's weight is given)."""
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be fp32, bf16 or fp16, got {param_dtype}")
    if grad_dtype not in (torch.float32, param_dtype):
        raise ValueError(f"grad_dtype must be fp32 or the param dtype {param_dtype}, got {grad_dtype}")
    if param_dtype in SIXTEEN_BIT and spec.tensor_parallel > 1:
        if spec.tensor_parallel != 2:
            raise ValueError("refgrad.pipeline's 16-bit params: it models tensor_parallel 2 only (a "
                             "TP sum of more than two 16-bit terms has a backend-chosen order), "
                             f"got {spec.tensor_parallel}")
        if not output_head:
            raise ValueError("refgrad.pipeline's 16-bit params at TP 2 need the output head "
                             "(LinearStackSpec.output_head)")


def accumulate(acc: torch.Tensor, grad: torch.Tensor, grad_dtype: torch.dtype) -> torch.Tensor:
    """``acc + grad`` in the wider of the two dtypes, rounded once to ``grad_dtype`` (step 3)."""
    return acc.add(grad).to(grad_dtype)


def head_wgrad(blocks: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor:
    """One microbatch's head weight gradient, ``blocks[k]`` holding vocab block ``k``'s one
    recorded ``(G_k, X)``: each block's ``G_kᵀ · X`` an fp32 GEMM on the exactly widened
    values, the blocks stacked as the rows of ``[V, H]`` (step 4; one block at TP 1)."""
    return torch.cat([torch.mm(g.t().float(), x.float()) for [(g, x)] in blocks])


def add_in_fp32(acc: torch.Tensor, wgrad: torch.Tensor, grad_dtype: torch.dtype) -> torch.Tensor:
    """``acc + wgrad`` in fp32, rounded once to ``grad_dtype`` (step 4)."""
    return (acc.float() + wgrad).to(grad_dtype)


def add_rounded(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a + b`` rounded once to ``dtype`` (step 5): the correctly rounded sum of two terms, in
    either order; where a term is not finite (an overflowed fp16 step, skipped by the scaler)
    IEEE's inf/NaN propagation."""
    if bool(a.isfinite().all()) and bool(b.isfinite().all()):
        return correctly_rounded_sum([a, b], dtype)
    return (a.float() + b.float()).to(dtype)

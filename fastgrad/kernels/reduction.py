"""Single-pass Triton kernel: sum W shards in an fp32 register accumulator, write once.

The input is the all-to-all output, ``W`` contiguous shards of ``shard_numel``
16-bit elements each. Every program loads its block of shard 0, then of shard
1, ... shard W-1 (rank order, the order refgrad models), adding into an fp32
accumulator that never leaves registers, optionally divides by W with IEEE
round-to-nearest division (``div_rn``; a plain ``/`` may be approximate), and
stores the result rounded once (RNE) to the output dtype. Memory traffic is the
minimum: W reads and one write per element.

``PRESCALE``: every loaded element is first multiplied by the fp32 factor and
rounded to the shard dtype, exactly what torch's ``grad_data.mul_(factor)``
computes (fp32 "opmath" product, rounded to fp32, then to the dtype), so the
separate read-and-write pass over the bucket disappears. The product is rounded
to fp32 before the add even for fp32 shards: the kernel is compiled with
``enable_fp_fusion=False``, so the multiply and add are never contracted into an FMA.

Alignment: consecutive shards are ``shard_numel`` elements apart. Triton only
knows that a runtime integer is divisible by 16 when it is; otherwise it must
assume 2-byte alignment and emit scalar loads. The host passes the shard stride
as ``shard_numel // ALIGN`` times the constexpr ``ALIGN`` (the largest power of
two up to 8 dividing ``shard_numel``), so the compiler sees the true divisibility.

This module imports Triton at import time; ``fastgrad.reduce_scatter`` imports it
only when ``fastgrad.kernels.triton_available()`` and the tensors are on CUDA,
so CPU-only machines never load it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gradvocab import Averaging

_BLOCK = 2048
_NUM_WARPS = 8


_MAX_ALIGN = 8  # 16-byte vector loads of 16-bit data


@triton.jit
def _load_fp32(ptr, mask, prescale, PRESCALE: tl.constexpr):
    """One shard's block widened to fp32, pre-scaled and re-rounded as torch's ``mul_`` does."""
    value = tl.load(ptr, mask=mask, other=0.0)
    if PRESCALE:
        value = (value.to(tl.float32) * prescale).to(ptr.dtype.element_ty)
    return value.to(tl.float32)


@triton.jit
def _reduce_shards_fp32_kernel(
    src_ptr,
    out_ptr,
    shard_numel,
    shard_stride_in_aligns,
    world_size,
    divisor,
    prescale,
    AVERAGE: tl.constexpr,
    PRESCALE: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < shard_numel
    # == shard_numel, written so that the compiler knows it is a multiple of ALIGN.
    shard_stride = shard_stride_in_aligns.to(tl.int64) * ALIGN
    shard_ptr = src_ptr + offsets
    acc = _load_fp32(shard_ptr, mask, prescale, PRESCALE)
    for _ in range(1, world_size):
        # Advancing the pointer keeps the shard offset in 64-bit pointer arithmetic.
        shard_ptr += shard_stride
        acc += _load_fp32(shard_ptr, mask, prescale, PRESCALE)
    if AVERAGE:
        acc = tl.div_rn(acc, divisor)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def shard_alignment(shard_numel: int) -> int:
    """The largest power of two up to 8 that divides ``shard_numel`` (elements)."""
    align = _MAX_ALIGN
    while shard_numel % align:
        align //= 2
    return align


def reduce_shards_fp32(
    shards: torch.Tensor, output: torch.Tensor, *, op: Averaging, prescale: float | None = None
) -> None:
    """``output = round(sum_r fp32(round(shards[r] * prescale)) [/ W])`` in one pass (``/ W``
    for ``op=Averaging.AVG``).

    ``shards`` is a contiguous ``[W, n]`` CUDA tensor, ``output`` a contiguous
    ``[n]``-element tensor on the same device; the caller validates shapes and
    ``op`` (``Averaging.SUM`` or ``.AVG``) and ``prescale`` (``None``: no pre-scale).
    """
    world_size, shard_numel = shards.shape
    align = shard_alignment(shard_numel)
    grid = (triton.cdiv(shard_numel, _BLOCK),)
    _reduce_shards_fp32_kernel[grid](
        shards,
        output,
        shard_numel,
        shard_numel // align,
        world_size,
        float(world_size),
        1.0 if prescale is None else float(prescale),
        AVERAGE=op is Averaging.AVG,  # the kernel specialises on it
        PRESCALE=prescale is not None,
        ALIGN=align,
        BLOCK=_BLOCK,
        num_warps=_NUM_WARPS,
        enable_fp_fusion=False,
    )

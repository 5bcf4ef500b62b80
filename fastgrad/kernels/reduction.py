"""Single-pass Triton kernel: sum W shards in an fp32 register accumulator, write once.

The input is the all-to-all output, ``W`` contiguous shards of ``shard_numel``
16-bit elements each. Every program loads its block of shard 0, then of shard
1, ... shard W-1 (rank order, the order refgrad models), adding into an fp32
accumulator that never leaves registers, optionally divides by W with IEEE
round-to-nearest division (``div_rn``; a plain ``/`` may be approximate), and
stores the result rounded once (RNE) to the output dtype. Memory traffic is the
minimum: W reads and one write per element.

This module imports Triton at import time; ``fastgrad.reduce_scatter`` imports it
only when ``fastgrad.kernels.triton_available()`` and the tensors are on CUDA,
so CPU-only machines never load it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048
_NUM_WARPS = 8


@triton.jit
def _reduce_shards_fp32_kernel(
    src_ptr,
    out_ptr,
    shard_numel,
    world_size,
    divisor,
    AVERAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < shard_numel
    shard_ptr = src_ptr + offsets
    acc = tl.load(shard_ptr, mask=mask, other=0.0).to(tl.float32)
    for _ in range(1, world_size):
        # Advancing the pointer keeps the shard offset in 64-bit pointer arithmetic.
        shard_ptr += shard_numel
        acc += tl.load(shard_ptr, mask=mask, other=0.0).to(tl.float32)
    if AVERAGE:
        acc = tl.div_rn(acc, divisor)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_shards_fp32(shards: torch.Tensor, output: torch.Tensor, *, average: bool) -> None:
    """``output = round(sum_r fp32(shards[r]) [/ W])`` in one pass.

    ``shards`` is a contiguous ``[W, n]`` CUDA tensor, ``output`` a contiguous
    ``[n]``-element tensor on the same device; the caller validates shapes.
    """
    world_size, shard_numel = shards.shape
    grid = (triton.cdiv(shard_numel, _BLOCK),)
    _reduce_shards_fp32_kernel[grid](
        shards,
        output,
        shard_numel,
        world_size,
        float(world_size),
        AVERAGE=average,
        BLOCK=_BLOCK,
        num_warps=_NUM_WARPS,
    )

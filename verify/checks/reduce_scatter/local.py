"""The reduce_scatter check's local-reduction parts: order-sensitive inputs at several W, and the CUDA path."""

from __future__ import annotations

import torch

from gradvocab import Averaging
from refgrad import reduce_scatter as refc
from refgrad.formats import tensor_bit_patterns
from verify.candidates.interfaces import GradReduction, LocalReduction, Unsupported
from verify.check import CheckContext, CheckRecorder
from verify.checks.reduce_scatter.cases import (
    COLLECTIVE_AVERAGINGS,
    DTYPE_NAMES,
    ORDER_SENSITIVE_LOCAL_SIZES,
    order_sensitive_input,
)


def local_reductions(reduction: GradReduction, rec: CheckRecorder, part: str
                     ) -> dict[Averaging, LocalReduction]:
    """The candidate's local reduction per op (as averagings); an op it lacks is a skip of ``part``."""
    found = {}
    for averaging in COLLECTIVE_AVERAGINGS:
        try:
            found[averaging] = reduction.local_reduction(averaging.reduce_op)
        except Unsupported as unsupported:
            rec.skip(f"{part}, op={averaging}: {unsupported}")
    return found


def check_local_order_sensitive(ctx: CheckContext, rec: CheckRecorder,
                                reduction: GradReduction) -> None:
    """The candidate's local reduction on order-sensitive inputs vs refgrad fp32/rank, bitwise.

    First proves with refgrad that the inputs are order-sensitive: summing the same rows
    rotated by one rank, or reversed, gives other bits somewhere.
    """
    numel = 64 if ctx.quick else 512
    reductions = local_reductions(reduction, rec, "order-sensitive local reduction")
    for world_size in ORDER_SENSITIVE_LOCAL_SIZES:
        for dtype_name in DTYPE_NAMES:
            dtype = getattr(torch, dtype_name)
            rows = [order_sensitive_input(r, world_size, numel, dtype, 0, ctx.seed)
                    for r in range(world_size)]
            tag = f"W={world_size} {dtype_name}"
            in_rank_order = refc.all_reduce(rows, accumulate="fp32", order="rank")[0]
            differs = {}
            for order_name, permuted in (("rotated", rows[1:] + rows[:1]), ("reversed", rows[::-1])):
                other = refc.all_reduce(permuted, accumulate="fp32", order="rank")[0]
                differs[order_name] = int(
                    (tensor_bit_patterns(other) != tensor_bit_patterns(in_rank_order)).sum())
            rec.expect(
                f"order-sensitive inputs ({tag}): refgrad's fp32 sum in rotated and in reversed "
                "rank order differs from rank order",
                all(differs.values()),
                f"elements that differ (of {numel}): {differs}",
            )
            shards = torch.stack(rows)
            for op, local in reductions.items():
                out = torch.empty(numel, dtype=dtype)
                local(shards, out, op=op.reduce_op)
                expected = refc.all_reduce(rows, accumulate="fp32", order="rank", op=op)[0]
                rec.compare(f"order-sensitive local reduction vs refgrad fp32/rank: {tag} {op}",
                            expected, out)


def compare_local_reduction_on(device: str, rec: CheckRecorder, g: torch.Generator, sizes,
                               reduction: GradReduction) -> None:
    """The candidate's local fp32 reduction run on ``device`` vs refgrad, bitwise, fp16 and
    bf16, SUM and AVG (the ops it has).

    Values span 2^12 so fp32 accumulation and the single rounding both matter.
    """
    reductions = local_reductions(reduction, rec, f"{device} local reduction")
    for dtype in (torch.float16, torch.bfloat16):
        for world_size, numel in sizes:
            values = torch.randn(world_size, numel, generator=g)
            shards = (values * torch.exp2(-12 * torch.rand(world_size, numel, generator=g))).to(dtype)
            for op, local in reductions.items():
                out = torch.empty(numel, dtype=dtype, device=device)
                local(shards.to(device), out, op=op.reduce_op)
                expected = refc.all_reduce(list(shards), accumulate="fp32", order="rank", op=op)[0]
                rec.compare(f"{device} local reduction {dtype} W={world_size} n={numel} {op}",
                            expected, out.cpu())


def check_cuda_local_reduction(ctx: CheckContext, rec: CheckRecorder,
                               reduction: GradReduction) -> None:
    """With ``--device cuda``: the GPU local reduction (Triton kernel when available) vs refgrad.

    Shard lengths cover several kernel blocks and a ragged tail.
    """
    if ctx.device != "cuda":
        rec.skip("CUDA local reduction (Triton kernel) vs refgrad: run `verify run --device cuda`")
        return
    sizes = ((3, 257),) if ctx.quick else ((2, 2053), (3, 2053), (8, 1029), (64, 257))
    compare_local_reduction_on("cuda", rec, ctx.generator(404), sizes, reduction)

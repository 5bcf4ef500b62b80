"""Check ``reduce_scatter``: fastgrad's fp32-accumulating reduce-scatter vs refgrad, and error growth.

1. On real gloo groups of 2, 3 and 4 ranks (quick: 2 and 3), with rank-specific
   fp16/bf16 inputs and two iterations, every mode of
   ``fastgrad.reduce_scatter.reduce_scatter_with_fp32_accumulation`` (sync, async,
   caller scratch; SUM and AVG) must equal ``refgrad.reduce_scatter.reduce_scatter(
   accumulate="fp32", order="rank")`` bitwise.
2. The vectorised models used by ``verify accumulation`` (ring, rank, tree in the
   wire dtype; fp32 accumulation) must equal refgrad bitwise, and the sweep's
   fast exact reference must equal ``verify.oracle`` bitwise.
3. A small error-growth sweep against the exact oracle, with expectations that
   follow from proofs (fp32 accumulation of same-sign data is within 1 ULP) or
   from large statistical margins (the ring's error grows, fp32's does not).
4. Order-sensitive inputs (exponents spread wider than fp32's 24 bits, so fp32 partial
   sums round differently in another order; the check asserts this with refgrad): the
   candidate's local reduction at W=3, 4, 5, 8 and its reduce-scatter on gloo groups of
   3 (and 4) ranks must equal refgrad fp32/rank bitwise, so any change of summation
   order fails here.
5. Measured, reported as tables and findings: production's averaging (pre-scale
   by 1/W in the 16-bit dtype) vs dividing the fp32 sum, against the exact
   average; and whether production's ``torch.sum(dim=0, dtype=float32)`` local
   reduction follows rank order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from fastgrad.reduce_scatter import (
    AVG,
    SUM,
    reduce_scatter_with_fp32_accumulation,
    reduce_shards_fp32,
)
from refgrad import formats
from refgrad import reduce_scatter as refc
from refgrad.exact import exact_sum
from refgrad.formats import tensor_bit_patterns
from verify.check import Check, CheckContext, CheckRecorder
from verify.distributed import spawn
from verify.studies.reduce_scatter import growth as acc

OPS = {"sum": SUM, "avg": AVG}
MODES = ("sync", "async", "scratch", "in_place")
DTYPE_NAMES = ("float16", "bfloat16")
ITERATIONS = 2
# W at which the local reduction sees order-sensitive inputs (W=2 is commutative: a+b == b+a).
ORDER_SENSITIVE_LOCAL_SIZES = (3, 4, 5, 8)
# Per dtype: exponents of the cancelling pair (+B on one rank, -B on another) and of the
# small values on the other ranks. The gap is at least 2^25, more than fp32's 24 bits, so
# a small value added while the fp32 partial sum holds B is lost, and one added after B
# and -B have cancelled is kept. No sum can overflow: |B| < 2^15 (fp16), < 2^41 (bf16).
_ORDER_EXPONENTS = {"float16": ((13, 14), (-14, -12)), "bfloat16": ((30, 40), (-10, 0))}


@dataclass(frozen=True)
class ReduceScatterCandidate:
    """The reduce-scatter under test: the collective and the local fp32 reduction it uses.

    ``reduce_scatter(output, input, *, group, op, async_op=False, scratch=None)`` is
    called on every rank (it must be a module-level function: it is pickled into the
    spawned ranks); ``local_reduction(shards [W, n], out, *, average)`` is called directly.
    """

    reduce_scatter: Callable = reduce_scatter_with_fp32_accumulation
    local_reduction: Callable = reduce_shards_fp32

    def __post_init__(self) -> None:
        for name in ("reduce_scatter", "local_reduction"):
            if not callable(getattr(self, name)):
                raise TypeError(f"ReduceScatterCandidate.{name} must be callable")

    @classmethod
    def default(cls) -> ReduceScatterCandidate:
        """fastgrad's ``reduce_scatter_with_fp32_accumulation`` and ``reduce_shards_fp32``."""
        return cls()


def rank_input(
    rank: int, world_size: int, numel: int, dtype: torch.dtype, it: int, seed: int
) -> torch.Tensor:
    """Rank-specific gradient-like data with a few exact wire-dtype ties."""
    g = torch.Generator().manual_seed(seed * 7919 + 1000 * world_size + 100 * it + rank)
    x = torch.randn(numel, generator=g) * torch.exp2(-14 * torch.rand(numel, generator=g))
    x = x * (rank + 1)
    x[:3] = torch.tensor([1.0, 2.0**-11, -(2.0**-9)])
    return x.to(dtype)


def order_sensitive_input(
    rank: int, world_size: int, numel: int, dtype: torch.dtype, it: int, seed: int
) -> torch.Tensor:
    """Rank ``rank``'s values of a [W, numel] matrix whose fp32 sums depend on the rank order.

    In every column two random ranks hold +B and -B and the others small values 2^25 or
    more below B (random signs and mantissas), so the fp32 sum keeps exactly the small
    values that come after both B's: another order keeps others. The whole matrix comes
    from one generator (every rank derives the same one), and rank ``rank`` takes its row.
    """
    (big_lo, big_hi), (small_lo, small_hi) = _ORDER_EXPONENTS[str(dtype).removeprefix("torch.")]
    g = torch.Generator().manual_seed(seed * 7919 + 50_000 + 1000 * world_size + 100 * it)
    shape = (world_size, numel)

    def values(lo: int, hi: int) -> torch.Tensor:
        exponents = torch.randint(lo, hi + 1, shape, generator=g).to(torch.float64)
        mantissas = 1 + torch.rand(shape, generator=g, dtype=torch.float64)
        return mantissas * torch.exp2(exponents)

    big, small = values(big_lo, big_hi), values(small_lo, small_hi)
    signs = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    # Per column, the ranks holding +B and -B: the first two of a random permutation.
    holders = torch.argsort(torch.rand(shape, generator=g), dim=0)
    matrix = signs * small
    columns = torch.arange(numel)
    matrix[holders[0], columns] = big[0]
    matrix[holders[1], columns] = -big[0]
    return matrix[rank].to(dtype)


def _run_modes(candidate: Callable, rank: int, size: int, group, shard: int, seed: int):
    records = []
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for it in range(ITERATIONS):
            x = rank_input(rank, size, size * shard, dtype, it, seed)
            record = {"dtype": dtype_name, "it": it, "input": x.clone()}
            for op_name, op in OPS.items():
                out = torch.empty(shard, dtype=dtype)
                candidate(out, x, group=group, op=op)
                record[(op_name, "sync")] = out
                out = torch.empty(shard, dtype=dtype)
                candidate(out, x, group=group, op=op, async_op=True).wait()
                record[(op_name, "async")] = out
                out = torch.empty(shard, dtype=dtype)
                scratch = torch.empty(x.numel(), dtype=dtype)
                candidate(out, x, group=group, op=op, scratch=scratch)
                record[(op_name, "scratch")] = out
                buffer = x.clone()
                view = buffer[rank * shard : (rank + 1) * shard]
                candidate(view, buffer, group=group, op=op, async_op=True).wait()
                record[(op_name, "in_place")] = view.clone()
            records.append(record)
    return records


def _run_order_sensitive(candidate: Callable, rank: int, size: int, group, shard: int, seed: int):
    """Order-sensitive inputs through the candidate (sync, SUM and AVG) on one group."""
    records = []
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for it in range(ITERATIONS):
            x = order_sensitive_input(rank, size, size * shard, dtype, it, seed)
            record = {"dtype": dtype_name, "it": it, "input": x.clone()}
            for op_name, op in OPS.items():
                out = torch.empty(shard, dtype=dtype)
                candidate(out, x, group=group, op=op)
                record[op_name] = out
            records.append(record)
    return records


def _rank_worker(rank: int, world_size: int, sizes, shard: int, seed: int, candidate) -> dict:
    """One spawned rank: every mode on groups of ranks 0..size-1 for each size, then the
    order-sensitive inputs on groups of 3 or more ranks."""
    results, ordered = {}, {}
    for size in sizes:
        group = dist.new_group(list(range(size))) if size < world_size else None
        if rank < size:
            results[size] = _run_modes(candidate, rank, size, group, shard, seed)
            if size >= 3:
                ordered[size] = _run_order_sensitive(candidate, rank, size, group, shard, seed)
    return {"modes": results, "order_sensitive": ordered}


def check_multi_rank(
    ctx: CheckContext, rec: CheckRecorder, candidate: ReduceScatterCandidate
) -> None:
    """The candidate's reduce-scatter on real gloo groups (every mode, SUM and AVG) vs
    refgrad fp32/rank, bitwise; at W >= 3 also on order-sensitive inputs."""
    sizes = (2, 3) if ctx.quick else (2, 3, 4)
    shard = 16 if ctx.quick else 96
    per_rank = spawn(_rank_worker, max(sizes), sizes, shard, ctx.seed, candidate.reduce_scatter,
                     timeout_s=ctx.timeout_s)
    for size in sizes:
        records = [per_rank[r]["modes"][size] for r in range(size)]
        for i, first in enumerate(records[0]):
            inputs = [records[r][i]["input"] for r in range(size)]
            for op_name in OPS:
                expected = refc.reduce_scatter(inputs, accumulate="fp32", order="rank", op=op_name)
                for mode in MODES:
                    got = torch.cat([records[r][i][(op_name, mode)] for r in range(size)])
                    rec.compare(
                        f"fastgrad vs refgrad fp32/rank: W={size} {first['dtype']} "
                        f"it={first['it']} op={op_name} {mode}",
                        torch.cat(expected), got,
                    )
    for size in (s for s in sizes if s >= 3):
        records = [per_rank[r]["order_sensitive"][size] for r in range(size)]
        for i, first in enumerate(records[0]):
            inputs = [records[r][i]["input"] for r in range(size)]
            for op_name in OPS:
                expected = refc.reduce_scatter(inputs, accumulate="fp32", order="rank", op=op_name)
                got = torch.cat([records[r][i][op_name] for r in range(size)])
                rec.compare(
                    f"order-sensitive reduce-scatter vs refgrad fp32/rank: W={size} "
                    f"{first['dtype']} it={first['it']} op={op_name}",
                    torch.cat(expected), got,
                )


def check_local_order_sensitive(
    ctx: CheckContext, rec: CheckRecorder, candidate: ReduceScatterCandidate
) -> None:
    """The candidate's local reduction on order-sensitive inputs vs refgrad fp32/rank, bitwise.

    First proves with refgrad that the inputs are order-sensitive: summing the same rows
    rotated by one rank, or reversed, gives other bits somewhere.
    """
    numel = 64 if ctx.quick else 512
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
            for op in ("sum", "avg"):
                out = torch.empty(numel, dtype=dtype)
                candidate.local_reduction(shards, out, average=op == "avg")
                expected = refc.all_reduce(rows, accumulate="fp32", order="rank", op=op)[0]
                rec.compare(f"order-sensitive local reduction vs refgrad fp32/rank: {tag} {op}",
                            expected, out)


def check_models(ctx: CheckContext, rec: CheckRecorder) -> None:
    """The sweep's vectorised models and fast exact reference vs refgrad / the oracle."""
    from verify.oracle import correctly_rounded_sum

    for world_size in (3, 8):
        chunk = 4 if ctx.quick else 16
        g = ctx.generator(world_size)
        for dtype_name in DTYPE_NAMES:
            dtype = getattr(torch, dtype_name)
            sample = acc.generate("gradient", world_size, world_size * chunk, g).to(dtype)
            inputs = list(sample)
            label = f"W={world_size} {dtype_name}"
            ring = torch.cat(refc.reduce_scatter(inputs, accumulate="wire", order="ring"))
            rec.compare(f"sweep ring model vs refgrad ({label})", ring,
                        acc.ring_reduce(sample, chunk))
            reverse = torch.cat(refc.reduce_scatter(inputs, accumulate="wire",
                                                    order="ring_reverse"))
            rec.compare(f"sweep reverse-ring model vs refgrad ({label})", reverse,
                        acc.ring_reduce(sample, chunk, reverse=True))
            for order, model in (("rank", acc.rank_reduce), ("tree", acc.tree_reduce)):
                expected = refc.all_reduce(inputs, accumulate="wire", order=order)[0]
                rec.compare(f"sweep {order} model vs refgrad ({label})", expected, model(sample))
            expected = refc.all_reduce(inputs, accumulate="fp32", order="rank")[0]
            rec.compare(f"sweep fp32 model vs refgrad ({label})", expected,
                        acc.fp32_reduce(sample)[0])
    # Fast exact reference vs the oracle, including columns that need the slow path
    # (bf16 exponents 2^100 apart) and signed zeros.
    g = ctx.generator(99)
    for dtype in (torch.float16, torch.bfloat16):
        sample = acc.generate("gradient", 64, 512, g)
        sample[:, :8] = 0.0
        sample[:, :4] = -0.0
        sample[0, 8:16] = 2.0**60
        sample[1, 8:16] = 2.0**-60
        stacked = sample.to(dtype)
        _, rounded = acc.exact_references(stacked)
        rec.compare(f"sweep exact reference vs verify.oracle ({dtype})",
                    correctly_rounded_sum(stacked, dtype), rounded)


def check_error_growth(ctx: CheckContext, rec: CheckRecorder) -> None:
    """A small sweep against the exact oracle; expectations from proofs or wide margins."""
    config = acc.SweepConfig(
        dp_sizes=(2, 8, 32) if ctx.quick else (2, 8, 32, 128),
        distributions=("normal", "same_sign"),
        numel=2**12 if ctx.quick else 2**14,
        seed=ctx.seed,
    )
    points = acc.run_sweep(config)
    rows = [[p.dtype, p.distribution, p.dp, acc.METHOD_LABELS[p.method], f"{p.rel_error:.2e}",
             p.max_ulp, f"{100 * p.frac_correctly_rounded:.2f}%"] for p in points]
    rec.table("Error vs N against the correctly rounded exact sum (small sweep)",
              ["dtype", "distribution", "N", "method", "rel.err", "max ULP", "correctly rounded"],
              rows, [f"{config.numel} elements per point; the full study is `verify accumulation`"])
    by_key = {(p.dtype, p.distribution, p.dp, p.method): p for p in points}
    for dtype in config.dtypes:
        same_sign = [by_key[(dtype, "same_sign", n, "fp32")] for n in config.dp_sizes]
        rec.expect(
            f"fp32 accumulation of same-sign {dtype} data is within 1 ULP of the exact sum",
            all(p.max_ulp <= 1 for p in same_sign),
            "proof: with no cancellation the fp32 accumulator's relative error is at most "
            "(N-1)*2^-24 < 2^-16 for N <= 128, below half a 16-bit ULP, so one final rounding "
            f"lands on a neighbour of the exact sum; max ULPs {[p.max_ulp for p in same_sign]}",
        )
        for distribution in config.distributions:
            fp32 = [by_key[(dtype, distribution, n, "fp32")] for n in config.dp_sizes]
            ring = [by_key[(dtype, distribution, n, "ring")] for n in config.dp_sizes]
            rec.expect(
                f"fp32 accumulation rounds at least as many elements correctly as the ring "
                f"({dtype}, {distribution})",
                all(f.frac_correctly_rounded >= r.frac_correctly_rounded
                    for f, r in zip(fp32, ring)),
                f"fp32 {[round(p.frac_correctly_rounded, 4) for p in fp32]} vs ring "
                f"{[round(p.frac_correctly_rounded, 4) for p in ring]}",
            )
            dps = list(config.dp_sizes)
            ring_slope = acc.growth_exponent(dps, [p.rel_error for p in ring])
            fp32_slope = acc.growth_exponent(dps, [p.rel_error for p in fp32])
            rec.expect(
                f"ring error grows with N, fp32-accumulate error does not ({dtype}, {distribution})",
                ring_slope is not None and fp32_slope is not None
                and ring_slope > 0.25 and fp32_slope < 0.15,
                f"fitted log-log slopes: ring {ring_slope:+.2f} (theory ~+0.5), "
                f"fp32 {fp32_slope:+.2f} (theory ~0 while (N-1)*2^-24 << u)",
            )
            rec.finding(
                f"{dtype} {distribution}: relative error at N={dps[-1]}: ring "
                f"{ring[-1].rel_error:.2e}, fp32-accumulate {fp32[-1].rel_error:.2e} "
                f"(slopes {ring_slope:+.2f} vs {fp32_slope:+.2f})"
            )


def _exact_average(inputs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The exact mean over ranks, correctly rounded to ``dtype`` (one rounding)."""
    fmt = formats.format_of(dtype)
    decoded = [formats.decode_tensor(t) for t in inputs]
    world_size = len(inputs)
    values = [
        exact_sum(formats.value_to_fraction(d[j]) for d in decoded) / Fraction(world_size)
        for j in range(inputs[0].numel())
    ]
    return formats.round_values_to_tensor(fmt, values, (len(values),))


def check_average(ctx: CheckContext, rec: CheckRecorder) -> None:
    """Our AVG (fp32 sum / W, one rounding) vs production's 16-bit pre-scale, vs the exact mean."""
    from verify.metrics import ulp_distance

    numel = 256 if ctx.quick else 2048
    rows = []
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for world_size in (3, 8, 64):
            g = ctx.generator(500 + world_size)
            stacked = acc.generate("gradient", world_size, numel, g).to(dtype)
            inputs = list(stacked)
            exact = _exact_average(inputs, dtype)
            ours = torch.empty(numel, dtype=dtype)
            reduce_shards_fp32(stacked, ours, average=True)
            prescaled = torch.stack([x * (1.0 / world_size) for x in inputs])
            production = torch.empty(numel, dtype=dtype)
            reduce_shards_fp32(prescaled, production, average=False)
            row = [dtype_name, world_size]
            for result in (ours, production):
                ulps = ulp_distance(exact, result).ulps
                row += [f"{100 * float((ulps == 0).double().mean()):.2f}%", int(ulps.max())]
            rows.append(row)
            if world_size == 3:
                # refgrad's model of the pre-scale must match torch's multiply bit for bit.
                rec.compare(f"refgrad prescale_like_torch vs torch multiply ({dtype_name}, W=3)",
                            torch.cat(refc.prescale_like_torch(inputs, 1.0 / world_size)),
                            prescaled.reshape(-1))
    rec.table(
        "Averaging vs the exact mean (correctly rounded): fp32 sum / W vs production's pre-scale",
        ["dtype", "W", "ours: correctly rounded", "ours: max ULP",
         "pre-scale: correctly rounded", "pre-scale: max ULP"],
        rows,
        ["ours: fp32 rank-order sum, IEEE division by W in fp32, one rounding to the wire dtype",
         "pre-scale: every rank's grad *= 1/W in the 16-bit dtype (as production), then the "
         "same fp32 accumulation: inexact for W not a power of two, and fp16 loses bits to "
         "subnormals for small grads"],
    )
    for row in rows:
        rec.finding(
            f"AVG {row[0]} W={row[1]}: correctly rounded {row[2]} (ours) vs {row[4]} "
            f"(production pre-scale); max ULP {row[3]} vs {row[5]}"
        )


def check_production_sum_order(ctx: CheckContext, rec: CheckRecorder) -> None:
    """Does production's torch.sum(dim=0, dtype=float32) follow rank order? Measured, reported."""
    rows = []
    for world_size in (8, 64):
        g = ctx.generator(700 + world_size)
        stacked = acc.generate("normal", world_size, 4096, g).to(torch.bfloat16)
        ours = torch.empty(4096, dtype=torch.bfloat16)
        reduce_shards_fp32(stacked, ours, average=False)
        production = torch.sum(stacked, dim=0, dtype=torch.float32).to(torch.bfloat16)
        fp32_sum = torch.sum(stacked, dim=0, dtype=torch.float32)
        sequential = acc.fp32_reduce(stacked)[1]
        rows.append([world_size, int((fp32_sum != sequential).sum()),
                     int((tensor_bit_patterns(production) != tensor_bit_patterns(ours)).sum())])
    rec.table(
        "Production's local reduction torch.sum(dim=0, dtype=float32) vs rank order (CPU, bf16)",
        ["W", "fp32 sums differing (of 4096)", "bf16 results differing (of 4096)"],
        rows,
        ["torch does not specify its reduction order; the rank-order loop is what refgrad models"],
    )
    for w, fp32_diff, bf16_diff in rows:
        rec.finding(f"torch.sum(dim=0, dtype=float32) at W={w}: {fp32_diff} fp32 sums and "
                    f"{bf16_diff} bf16 results differ from rank order on this machine")


def compare_local_reduction_on(
    device: str,
    rec: CheckRecorder,
    g: torch.Generator,
    sizes,
    candidate: ReduceScatterCandidate = ReduceScatterCandidate(),  # noqa: B008 - frozen
) -> None:
    """The candidate's local fp32 reduction run on ``device`` vs refgrad, bitwise, fp16 and
    bf16, SUM and AVG.

    Values span 2^12 so fp32 accumulation and the single rounding both matter.
    """
    reduce = candidate.local_reduction
    for dtype in (torch.float16, torch.bfloat16):
        for world_size, numel in sizes:
            values = torch.randn(world_size, numel, generator=g)
            shards = (values * torch.exp2(-12 * torch.rand(world_size, numel, generator=g))).to(dtype)
            for op in ("sum", "avg"):
                out = torch.empty(numel, dtype=dtype, device=device)
                reduce(shards.to(device), out, average=op == "avg")
                expected = refc.all_reduce(list(shards), accumulate="fp32", order="rank", op=op)[0]
                rec.compare(f"{device} local reduction {dtype} W={world_size} n={numel} {op}",
                            expected, out.cpu())


def check_cuda_local_reduction(
    ctx: CheckContext, rec: CheckRecorder, candidate: ReduceScatterCandidate
) -> None:
    """With ``--device cuda``: the GPU local reduction (Triton kernel when available) vs refgrad.

    Shard lengths cover several kernel blocks and a ragged tail.
    """
    if ctx.device != "cuda":
        rec.skip("CUDA local reduction (Triton kernel) vs refgrad: run `verify run --device cuda`")
        return
    sizes = ((3, 257),) if ctx.quick else ((2, 2053), (3, 2053), (8, 1029), (64, 257))
    compare_local_reduction_on("cuda", rec, ctx.generator(404), sizes, candidate)


def run(ctx: CheckContext, rec: CheckRecorder, candidate: ReduceScatterCandidate) -> None:
    """The ``reduce_scatter`` check against ``candidate`` (default: fastgrad's)."""
    check_multi_rank(ctx, rec, candidate)
    check_local_order_sensitive(ctx, rec, candidate)
    check_cuda_local_reduction(ctx, rec, candidate)
    check_models(ctx, rec)
    check_error_growth(ctx, rec)
    check_average(ctx, rec)
    check_production_sum_order(ctx, rec)


CHECK = Check(
    name="reduce_scatter",
    summary="fp32-accumulating reduce-scatter vs refgrad (bitwise, gloo W=2..4); error growth with N",
    run=run,
    default_candidate=ReduceScatterCandidate.default(),
)

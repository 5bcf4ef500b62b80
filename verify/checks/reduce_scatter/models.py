"""The reduce_scatter check's model and measurement parts: the sweep's models vs refgrad, error growth, averaging, production's sum order."""

from __future__ import annotations

from fractions import Fraction

import torch

from refgrad import formats
from refgrad import reduce_scatter as refc
from refgrad.exact import exact_sum
from refgrad.formats import tensor_bit_patterns
from verify.check import CheckContext, CheckRecorder
from verify.checks.reduce_scatter.cases import DTYPE_NAMES
from verify.metrics import ulp_distance
from verify.oracle import correctly_rounded_sum
from verify.studies.reduce_scatter import models as study_models
from verify.studies.reduce_scatter import reference as study_reference
from verify.studies.reduce_scatter import sweep as study_sweep


def check_models(ctx: CheckContext, rec: CheckRecorder) -> None:
    """The sweep's vectorised models and fast exact reference vs refgrad / the oracle."""
    for world_size in (3, 8):
        chunk = 4 if ctx.quick else 16
        g = ctx.generator(world_size)
        for dtype_name in DTYPE_NAMES:
            dtype = getattr(torch, dtype_name)
            sample = study_models.generate("gradient", world_size, world_size * chunk, g).to(dtype)
            inputs = list(sample)
            label = f"W={world_size} {dtype_name}"
            ring = torch.cat(refc.reduce_scatter(inputs, accumulate="wire", order="ring"))
            rec.compare(f"sweep ring model vs refgrad ({label})", ring,
                        study_models.ring_reduce(sample, chunk))
            reverse = torch.cat(refc.reduce_scatter(inputs, accumulate="wire",
                                                    order="ring_reverse"))
            rec.compare(f"sweep reverse-ring model vs refgrad ({label})", reverse,
                        study_models.ring_reduce(sample, chunk, reverse=True))
            for order, model in (("rank", study_models.rank_reduce), ("tree", study_models.tree_reduce)):
                expected = refc.all_reduce(inputs, accumulate="wire", order=order)[0]
                rec.compare(f"sweep {order} model vs refgrad ({label})", expected, model(sample))
            expected = refc.all_reduce(inputs, accumulate="fp32", order="rank")[0]
            rec.compare(f"sweep fp32 model vs refgrad ({label})", expected,
                        study_models.fp32_reduce(sample)[0])
    # Fast exact reference vs the oracle, including columns that need the slow path
    # (bf16 exponents 2^100 apart) and signed zeros.
    g = ctx.generator(99)
    for dtype in (torch.float16, torch.bfloat16):
        sample = study_models.generate("gradient", 64, 512, g)
        sample[:, :8] = 0.0
        sample[:, :4] = -0.0
        sample[0, 8:16] = 2.0**60
        sample[1, 8:16] = 2.0**-60
        stacked = sample.to(dtype)
        _, rounded = study_reference.exact_references(stacked)
        rec.compare(f"sweep exact reference vs verify.oracle ({dtype})",
                    correctly_rounded_sum(stacked, dtype), rounded)


def check_error_growth(ctx: CheckContext, rec: CheckRecorder) -> None:
    """A small sweep against the exact oracle; expectations from proofs or wide margins."""
    config = study_sweep.SweepConfig(
        dp_sizes=(2, 8, 32) if ctx.quick else (2, 8, 32, 128),
        distributions=("normal", "same_sign"),
        numel=2**12 if ctx.quick else 2**14,
        seed=ctx.seed,
    )
    points = study_sweep.run_sweep(config)
    rows = [[p.dtype, p.distribution, p.dp, study_models.METHOD_LABELS[p.method], f"{p.rel_error:.2e}",
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
            ring_slope = study_sweep.growth_exponent(dps, [p.rel_error for p in ring])
            fp32_slope = study_sweep.growth_exponent(dps, [p.rel_error for p in fp32])
            rec.expect(
                f"ring error grows with N, fp32-accumulate error does not ({dtype}, {distribution})",
                ring_slope is not None and fp32_slope is not None
                and ring_slope > 0.25 and fp32_slope < 0.15,
                f"fitted log-log slopes: ring {ring_slope:+.2f} (theory ~+0.5), "
                f"fp32 {fp32_slope:+.2f} (theory ~0 while (N-1)*2^-24 << u)",
            )
            rec.note(
                f"{dtype} {distribution}: relative error at N={dps[-1]}: ring "
                f"{ring[-1].rel_error:.2e}, fp32-accumulate {fp32[-1].rel_error:.2e} "
                f"(slopes {ring_slope:+.2f} vs {fp32_slope:+.2f})"
            )


def _exact_average(inputs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The exact mean over ranks, correctly rounded to ``dtype`` (one rounding).

    The exact column sum is the float64 sum wherever that is exact (the accumulation
    study's ``float64_sum_is_exact``: every partial sum representable), else the sum
    of the decoded values as Fractions; the mean ``sum / W`` is rounded once by
    ``refgrad.formats``.
    """
    fmt = formats.format_of(dtype)
    stacked = torch.stack(inputs)
    world_size, numel = stacked.shape
    sums64 = stacked.double().sum(dim=0).tolist()
    exact64 = study_reference.float64_sum_is_exact(stacked).tolist()
    values = []
    for j in range(numel):
        if exact64[j]:
            total = Fraction(sums64[j])
        else:
            total = exact_sum(formats.value_to_fraction(v) for v in formats.decode_tensor(stacked[:, j]))
        values.append(total / world_size)
    return formats.round_values_to_tensor(fmt, values, (numel,))


def fp32_average(stacked: torch.Tensor) -> torch.Tensor:
    """The spec's AVG: the rank-order fp32 sum (the sweep's model, held to refgrad bitwise by
    :func:`check_models`), one IEEE fp32 division by W, one rounding to the wire dtype."""
    total = study_models.fp32_reduce(stacked)[1]
    # A 0-dim tensor divisor: a Python-scalar divisor may become a multiplication by the
    # reciprocal, which is not IEEE division.
    return (total / torch.tensor(float(stacked.shape[0]), dtype=torch.float32)).to(stacked.dtype)


def check_average(ctx: CheckContext, rec: CheckRecorder) -> None:
    """The spec's AVG (fp32 sum / W, one rounding) vs production's 16-bit pre-scale, vs the exact mean."""
    numel = 256 if ctx.quick else 2048
    rows = []
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for world_size in (3, 8, 64):
            g = ctx.generator(500 + world_size)
            stacked = study_models.generate("gradient", world_size, numel, g).to(dtype)
            inputs = list(stacked)
            exact = _exact_average(inputs, dtype)
            ours = fp32_average(stacked)
            prescaled = torch.stack([x * (1.0 / world_size) for x in inputs])
            production = study_models.fp32_reduce(prescaled)[0]
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
        rec.note(
            f"AVG {row[0]} W={row[1]}: correctly rounded {row[2]} (ours) vs {row[4]} "
            f"(production pre-scale); max ULP {row[3]} vs {row[5]}"
        )


def check_production_sum_order(ctx: CheckContext, rec: CheckRecorder) -> None:
    """Does production's torch.sum(dim=0, dtype=float32) follow rank order? Measured, reported."""
    rows = []
    for world_size in (8, 64):
        g = ctx.generator(700 + world_size)
        stacked = study_models.generate("normal", world_size, 4096, g).to(torch.bfloat16)
        ours = study_models.fp32_reduce(stacked)[0]
        production = torch.sum(stacked, dim=0, dtype=torch.float32).to(torch.bfloat16)
        fp32_sum = torch.sum(stacked, dim=0, dtype=torch.float32)
        sequential = study_models.fp32_reduce(stacked)[1]
        rows.append([world_size, int((fp32_sum != sequential).sum()),
                     int((tensor_bit_patterns(production) != tensor_bit_patterns(ours)).sum())])
    rec.table(
        "Production's local reduction torch.sum(dim=0, dtype=float32) vs rank order (CPU, bf16)",
        ["W", "fp32 sums differing (of 4096)", "bf16 results differing (of 4096)"],
        rows,
        ["torch does not specify its reduction order; the rank-order loop is what refgrad models"],
    )
    for w, fp32_diff, bf16_diff in rows:
        rec.note(f"torch.sum(dim=0, dtype=float32) at W={w}: {fp32_diff} fp32 sums and "
                    f"{bf16_diff} bf16 results differ from rank order on this machine")

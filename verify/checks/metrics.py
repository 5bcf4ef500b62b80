"""Self-check of verify.metrics: hand-derived ULP distances and compare() fields.

Every expected number below is derived by hand from the formats' bit layouts
(sign, biased exponent, mantissa), plus one independent model: the ULP distance
between two values equals the difference of their positions in the sorted list
of all representable values (checked exhaustively for the 8-bit formats).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from refgrad.formats import tensor_from_bit_patterns as tensor_from_bits
from verify.check import Check, CheckContext, CheckRecorder
from verify.metrics import Comparison, UlpDistance, compare, ulp_distance

UlpFunction = Callable[[torch.Tensor, torch.Tensor], UlpDistance]
CompareFunction = Callable[[torch.Tensor, torch.Tensor], Comparison]

# (dtype, pattern a, pattern b, ULPs, why) -- hand-derived.
HAND_ULP_CASES: tuple[tuple[torch.dtype, int, int, int, str], ...] = (
    (torch.float32, 0x3F800000, 0x3F800001, 1, "1.0 and its successor"),
    (torch.float32, 0x3F800000, 0x40000000, 1 << 23, "one binade has 2^23 codes"),
    (torch.float32, 0x00000001, 0x80000001, 2, "±2^-149 straddle zero"),
    (torch.float32, 0x00000000, 0x80000000, 0, "+0 and -0"),
    (torch.float32, 0x7F7FFFFF, 0xFF7FFFFF, 2 * 0x7F7FFFFF, "±max: no overflow"),
    (torch.float32, 0x7F61B1E6, 0xFF61B1E6, 2 * 0x7F61B1E6, "±3e38: no overflow"),
    (torch.float32, 0x7F7FFFFF, 0x7F800000, 1, "max to +inf is one code"),
    (torch.float16, 0x3C00, 0x4000, 1 << 10, "1.0 to 2.0"),
    (torch.float16, 0x7BFF, 0xFBFF, 2 * 0x7BFF, "±65504"),
    (torch.float16, 0x03FF, 0x0400, 1, "largest subnormal to min normal"),
    (torch.bfloat16, 0x3F80, 0x4000, 1 << 7, "1.0 to 2.0"),
    (torch.bfloat16, 0x0001, 0x8001, 2, "±2^-133 straddle zero"),
    (torch.float8_e4m3fn, 0x38, 0x40, 8, "1.0 to 2.0"),
    (torch.float8_e4m3fn, 0x7E, 0xFE, 252, "±448"),
    (torch.float8_e5m2, 0x3C, 0x40, 4, "1.0 to 2.0"),
    (torch.float8_e5m2, 0x7B, 0x7C, 1, "57344 to +inf"),
    (torch.float8_e8m0fnu, 0x00, 0xFE, 254, "2^-127 to 2^127"),
    (torch.float8_e8m0fnu, 0x7F, 0x80, 1, "1 to 2"),
)

# (dtype, a NaN pattern, another NaN pattern, a number)
NAN_CASES: tuple[tuple[torch.dtype, int, int, int], ...] = (
    (torch.float32, 0x7FC00000, 0xFF800001, 0x3F800000),
    (torch.float16, 0x7E00, 0xFC01, 0x3C00),
    (torch.bfloat16, 0x7FC0, 0xFF81, 0x3F80),
    (torch.float8_e4m3fn, 0x7F, 0xFF, 0x7E),
    (torch.float8_e5m2, 0x7D, 0xFF, 0x3C),
    (torch.float8_e8m0fnu, 0xFF, 0xFF, 0xFE),
)


def _pair(dtype: torch.dtype, a: list[int], b: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        tensor_from_bits(torch.tensor(a, dtype=torch.int64), dtype),
        tensor_from_bits(torch.tensor(b, dtype=torch.int64), dtype),
    )


def _rank_model_mismatches(dtype: torch.dtype, ulp_fn: UlpFunction) -> int:
    """All 65536 pairs of 8-bit patterns: ULPs must equal the difference of sorted ranks."""
    patterns = tensor_from_bits(torch.arange(256, dtype=torch.int64), dtype)
    widened = patterns.to(torch.float64)  # exact
    nan = torch.isnan(widened)
    distinct = torch.unique(widened[~nan])  # sorted; +0 and -0 merge
    rank = torch.searchsorted(distinct, torch.where(nan, torch.zeros_like(widened), widened))
    a, b = patterns.repeat_interleave(256), patterns.repeat(256)
    na, nb = nan.repeat_interleave(256), nan.repeat(256)
    expected = (rank.repeat_interleave(256) - rank.repeat(256)).abs()
    expected = torch.where(na | nb, torch.zeros_like(expected), expected)
    got = ulp_fn(a, b)
    wrong = (got.ulps != expected) | (got.nan_mismatch != (na ^ nb))
    return int(wrong.sum())


@dataclass(frozen=True)
class MetricsCandidate:
    """What the ``metrics`` check holds to hand-derived cases: ``ulp_distance`` and ``compare``."""

    ulp_distance: UlpFunction = ulp_distance
    compare: CompareFunction = compare

    @classmethod
    def default(cls) -> MetricsCandidate:
        """``verify.metrics.ulp_distance`` and ``verify.metrics.compare``."""
        return cls()


def run(ctx: CheckContext, rec: CheckRecorder, candidate: MetricsCandidate) -> None:
    """The ``metrics`` check: ULP distances and ``compare()`` on hand-derived cases."""
    ulp_fn, compare_fn = candidate.ulp_distance, candidate.compare
    rows = []
    for dtype, a, b, expected, why in HAND_ULP_CASES:
        x, y = _pair(dtype, [a, b], [b, a])
        got = ulp_fn(x, y).ulps.tolist()
        name = str(dtype).removeprefix("torch.")
        rec.expect(f"{name} {a:#x} vs {b:#x} = {expected} ULP ({why})", got == [expected] * 2,
                   f"got {got}")
        rows.append([name, f"{a:#x}", f"{b:#x}", expected, got[0], why])
    rec.table("Hand-derived ULP distances", ["dtype", "a", "b", "expected", "got", "why"], rows)

    for dtype, nan1, nan2, number in NAN_CASES:
        name = str(dtype).removeprefix("torch.")
        x, y = _pair(dtype, [nan1, nan1, number], [nan2, number, nan1])
        d = ulp_fn(x, y)
        rec.expect(
            f"{name}: NaN vs NaN is 0; NaN vs number is flagged with 0 ULPs",
            d.ulps.tolist() == [0, 0, 0] and d.nan_mismatch.tolist() == [False, True, True],
            f"ulps {d.ulps.tolist()}, nan_mismatch {d.nan_mismatch.tolist()}",
        )

    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        wrong = _rank_model_mismatches(dtype, ulp_fn)
        rec.expect(f"{dtype}: all 65536 pairs match the sorted-rank model", wrong == 0,
                   f"{wrong} pairs differ")

    # compare(): index 0 equal, 1: 1 ULP, 2: 3 ULPs, 3: +0 vs -0, 4: NaN vs 1.0,
    # 5: inf vs max (1 ULP), 6: 9 ULPs.
    ref, cand = _pair(
        torch.float32,
        [0x3F800000, 0x3F800000, 0x40000000, 0x00000000, 0x7FC00000, 0x7F800000, 0x3F800000],
        [0x3F800000, 0x3F800001, 0x40000003, 0x80000000, 0x3F800000, 0x7F7FFFFF, 0x3F800009],
    )
    r = compare_fn(ref, cand)
    expected_fields = {
        "n": 7,
        "bitwise_equal": False,
        "n_mismatch": 6,
        "max_ulp": 9,
        "mean_ulp": 14 / 6,
        "histogram": {"0": 2, "1": 2, "2": 0, "3-4": 1, "5-8": 0, ">8": 1},
        "max_abs_error": 9 * 2.0**-23,
        "max_rel_error": 9 * 2.0**-23,
        "nan_mismatch": 1,
        "inf_mismatch": 1,
    }
    for field_name, expected in expected_fields.items():
        got = getattr(r, field_name)
        ok = abs(got - expected) <= 1e-12 if isinstance(expected, float) else got == expected
        rec.expect(f"compare(): {field_name} == {expected!r}", ok, f"got {got!r}")
    first = r.first_mismatch
    rec.expect(
        "compare(): first mismatch is index 1, 1.0 vs 1+2^-23",
        first is not None and first.index == (1,) and first.reference == 1.0
        and first.candidate == 1.0 + 2.0**-23,
        repr(first),
    )
    zero_ref, zero_cand = torch.tensor([0.0, 0.0]), torch.tensor([0.0, 2.0**-20])
    rec.expect("compare(): relative error at reference 0 is inf when the candidate is not 0",
               compare_fn(zero_ref, zero_cand).max_rel_error == float("inf"))

    # The recorder path: identical tensors are bitwise equal; a 1-ULP nudge is 1 ULP.
    gen = ctx.generator(0)
    n = 256 if ctx.quick else 4096
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(n, generator=gen).to(dtype)
        rec.compare(f"{dtype}: a tensor against its copy", x, x.clone())
        nudged = torch.nextafter(x, torch.full_like(x, float("inf")))
        steps = ulp_fn(x, nudged).ulps
        rec.expect(f"{dtype}: nextafter is exactly 1 ULP everywhere", bool((steps == 1).all()))
        rec.compare(f"{dtype}: nextafter nudge within 1 ULP", x, nudged, max_ulp=1,
                    reason="constructed: every element moved by one representable step")


CHECK = Check(
    name="metrics",
    summary="ULP distance and compare() on hand-derived cases across all formats",
    run=run,
    default_candidate=MetricsCandidate.default(),
)

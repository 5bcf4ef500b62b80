"""Tests of verify.metrics against hand-derived bit patterns and an independent rank model.

Bit patterns below are derived by hand from each format's layout (sign, exponent
with bias, mantissa); the rank model orders every representable value by its
float64 value (an exact widening) and counts positions, which is the definition
of ULP distance that the ordered-integer mapping must reproduce.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refgrad.formats import bits_to_tensor, format_of
from verify.checks.metrics import HAND_ULP_CASES
from verify.metrics import (
    HISTOGRAM_BUCKETS,
    assert_bitwise_equal,
    assert_ulp_close,
    bitwise_equal,
    compare,
    supported_dtypes,
    ulp_distance,
)

WIDTH = {
    torch.float32: 32,
    torch.float16: 16,
    torch.bfloat16: 16,
    torch.float8_e4m3fn: 8,
    torch.float8_e5m2: 8,
    torch.float8_e8m0fnu: 8,
}


def from_bits(dtype: torch.dtype, patterns: list[int]) -> torch.Tensor:
    """A tensor of ``dtype`` holding the given unsigned bit patterns (reinterpreted)."""
    return bits_to_tensor(format_of(dtype), patterns)


def fp32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def ulps_of(dtype: torch.dtype, a: list[int], b: list[int]) -> list[int]:
    return ulp_distance(from_bits(dtype, a), from_bits(dtype, b)).ulps.tolist()


# (dtype, pattern a, pattern b, expected ULPs, why) -- each derived by hand: the metrics
# check's table (verify.checks.metrics.HAND_ULP_CASES), then cases only this test holds.
HAND_CASES = [
    *HAND_ULP_CASES,
    # float32: 1 sign, 8 exponent (bias 127), 23 mantissa bits.
    (torch.float32, 0x3F7FFFFF, 0x3F800000, 1, "predecessor of 1.0 crosses the binade"),
    (torch.float32, 0x00000000, 0x00800000, 1 << 23, "0 to min normal: 2^23 subnormal steps"),
    (torch.float32, 0x007FFFFF, 0x00800000, 1, "largest subnormal to min normal"),
    (torch.float32, 0x7F800000, 0xFF800000, 2 * 0x7F800000, "+inf to -inf"),
    (torch.float32, 0xBF800000, 0xBF800001, 1, "-1.0 and its neighbour away from zero"),
    # float16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
    (torch.float16, 0x3C00, 0x3C01, 1, "1.0 and its successor"),
    (torch.float16, 0x7BFF, 0x7C00, 1, "65504 to +inf"),
    (torch.float16, 0x0001, 0x8001, 2, "+/- 2^-24 straddle zero"),
    (torch.float16, 0x8000, 0x0000, 0, "-0 and +0"),
    # bfloat16: 1 sign, 8 exponent (bias 127), 7 mantissa bits.
    (torch.bfloat16, 0x3F80, 0x3F81, 1, "1.0 and its successor"),
    (torch.bfloat16, 0x7F7F, 0xFF7F, 2 * 0x7F7F, "+max to -max"),
    (torch.bfloat16, 0x8000, 0x0000, 0, "-0 and +0"),
    # float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf.
    (torch.float8_e4m3fn, 0x38, 0x39, 1, "1.0 and 1.125"),
    (torch.float8_e4m3fn, 0x01, 0x81, 2, "+/- 2^-9 straddle zero"),
    (torch.float8_e4m3fn, 0x07, 0x08, 1, "largest subnormal 7*2^-9 to min normal 2^-6"),
    (torch.float8_e4m3fn, 0x00, 0x80, 0, "+0 and -0"),
    # float8_e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa bits; IEEE-like.
    (torch.float8_e5m2, 0x3C, 0x3D, 1, "1.0 and 1.25"),
    (torch.float8_e5m2, 0x7B, 0xFB, 2 * 0x7B, "57344 to -57344"),
    (torch.float8_e5m2, 0x01, 0x81, 2, "+/- 2^-16 straddle zero"),
    # float8_e8m0fnu: 8 unsigned exponent bits (bias 127), value 2^(e-127).
    (torch.float8_e8m0fnu, 0x7F, 0x7F, 0, "equal"),
]


@pytest.mark.parametrize(
    "dtype, a, b, expected, why", HAND_CASES, ids=[f"{c[0]}-{c[4]}" for c in HAND_CASES]
)
def test_hand_derived_ulp_distances(dtype, a, b, expected, why):
    assert ulps_of(dtype, [a], [b]) == [expected], why
    assert ulps_of(dtype, [b], [a]) == [expected], f"symmetry: {why}"


# NaN encodings per format, by hand: IEEE-style formats have exponent all ones with
# a non-zero mantissa; e4m3fn only S.1111.111; e8m0 only 0xFF.
NAN_PATTERNS = {
    torch.float32: [0x7FC00000, 0x7F800001, 0xFFFFFFFF],
    torch.float16: [0x7E00, 0x7C01, 0xFFFF],
    torch.bfloat16: [0x7FC0, 0x7F81, 0xFFFF],
    torch.float8_e4m3fn: [0x7F, 0xFF],
    torch.float8_e5m2: [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF],
    torch.float8_e8m0fnu: [0xFF],
}
ONE = {
    torch.float32: 0x3F800000,
    torch.float16: 0x3C00,
    torch.bfloat16: 0x3F80,
    torch.float8_e4m3fn: 0x38,
    torch.float8_e5m2: 0x3C,
    torch.float8_e8m0fnu: 0x7F,
}


@pytest.mark.parametrize("dtype", list(NAN_PATTERNS))
def test_nan_handling(dtype):
    nans = NAN_PATTERNS[dtype]
    # Every NaN against every NaN (payloads, signs): distance 0, no mismatch flag.
    a = [x for x in nans for _ in nans]
    b = [y for _ in nans for y in nans]
    d = ulp_distance(from_bits(dtype, a), from_bits(dtype, b))
    assert d.ulps.tolist() == [0] * len(a)
    assert not d.nan_mismatch.any()
    # NaN against a number: flagged, and the distance is 0 rather than a huge value.
    numbers = [ONE[dtype]] * len(nans)
    for first, second in ((nans, numbers), (numbers, nans)):
        d = ulp_distance(from_bits(dtype, first), from_bits(dtype, second))
        assert d.nan_mismatch.tolist() == [True] * len(nans)
        assert d.ulps.tolist() == [0] * len(nans)
        assert d.ulps.dtype == torch.int64


def test_e4m3fn_max_magnitude_is_not_nan():
    # 0x7E (448) is finite in e4m3fn even though its exponent field is all ones.
    d = ulp_distance(from_bits(torch.float8_e4m3fn, [0x7E]), from_bits(torch.float8_e4m3fn, [0x38]))
    assert not d.nan_mismatch.any()
    assert d.ulps.tolist() == [0x7E - 0x38]


def _all_patterns(dtype: torch.dtype) -> torch.Tensor:
    width = WIDTH[dtype]
    return from_bits(dtype, list(range(1 << width)))


def _rank_model(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank of each pattern among the distinct non-NaN values (float64 widening is exact)."""
    as_f64 = values.to(torch.float64)
    nan = torch.isnan(as_f64)
    distinct = torch.unique(as_f64[~nan])  # sorted; +0 and -0 compare equal and merge
    rank = torch.searchsorted(distinct, torch.where(nan, torch.zeros_like(as_f64), as_f64))
    return rank, nan


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu]
)
def test_8bit_all_pairs_match_rank_model(dtype):
    patterns = _all_patterns(dtype)
    rank, nan = _rank_model(patterns)
    a = patterns.repeat_interleave(256)
    b = patterns.repeat(256)
    ra, rb = rank.repeat_interleave(256), rank.repeat(256)
    na, nb = nan.repeat_interleave(256), nan.repeat(256)
    d = ulp_distance(a, b)
    expected = torch.where(na | nb, torch.zeros_like(ra), (ra - rb).abs())
    assert_bitwise_equal(d.ulps, expected)
    assert_bitwise_equal(d.nan_mismatch, na ^ nb)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_all_patterns_match_rank_model(dtype):
    patterns = _all_patterns(dtype)
    rank, nan = _rank_model(patterns)
    gen = torch.Generator().manual_seed(1234)
    for _ in range(4):
        partner = torch.randperm(1 << 16, generator=gen)
        d = ulp_distance(patterns, patterns[partner])
        expected = (rank - rank[partner]).abs()
        either_nan = nan | nan[partner]
        expected = torch.where(either_nan, torch.zeros_like(expected), expected)
        assert_bitwise_equal(d.ulps, expected)
        assert_bitwise_equal(d.nan_mismatch, nan ^ nan[partner])


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(finite_f32, finite_f32, finite_f32)
def test_fp32_distance_is_additive_along_the_line(x, y, z):
    lo, mid, hi = sorted([x, y, z])
    t = torch.tensor([lo, mid, lo], dtype=torch.float32)
    u = torch.tensor([mid, hi, hi], dtype=torch.float32)
    d_lo_mid, d_mid_hi, d_lo_hi = ulp_distance(t, u).ulps.tolist()
    assert d_lo_mid + d_mid_hi == d_lo_hi
    assert (d_lo_hi == 0) == (lo == hi)


@settings(max_examples=200, deadline=None)
@given(finite_f32)
def test_fp32_neighbours_are_one_ulp_apart(x):
    x32 = np.float32(x)
    with np.errstate(over="ignore"):  # stepping past +/-max gives +/-inf, one code away
        up = np.nextafter(x32, np.float32(np.inf))
        down = np.nextafter(x32, np.float32(-np.inf))
    a = torch.tensor([float(x32), float(x32)], dtype=torch.float32)
    b = torch.tensor([float(up), float(down)], dtype=torch.float32)
    ulps = ulp_distance(a, b).ulps.tolist()
    # nextafter from +/-0 crosses zero to the smallest subnormal: still one code away.
    assert ulps == [1, 1]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_fp32_random_bit_patterns_never_overflow(p, q):
    d = ulp_distance(from_bits(torch.float32, [p]), from_bits(torch.float32, [q]))
    ulps = int(d.ulps[0])
    assert 0 <= ulps <= 2 * 0x7F800000


# --- compare ---------------------------------------------------------------------------


def test_compare_fields_on_a_hand_built_example():
    # index: 0 equal, 1 one ULP, 2 three ULPs, 3 +0 vs -0, 4 NaN vs 1.0, 5 inf vs max, 6 9 ULPs
    ref_bits = [0x3F800000, 0x3F800000, 0x40000000, 0x00000000, 0x7FC00000, 0x7F800000, 0x3F800000]
    cand_bits = [0x3F800000, 0x3F800001, 0x40000003, 0x80000000, 0x3F800000, 0x7F7FFFFF, 0x3F800009]
    ref = from_bits(torch.float32, ref_bits)
    cand = from_bits(torch.float32, cand_bits)
    r = compare(ref, cand)
    assert r.n == 7
    assert r.bitwise_equal is False
    assert r.n_mismatch == 6
    assert r.max_ulp == 9
    # NaN mismatch (index 4) has no distance: mean over the 6 others = (0+1+3+0+1+9)/6.
    assert r.mean_ulp == pytest.approx(14 / 6)
    assert r.histogram == {"0": 2, "1": 2, "2": 0, "3-4": 1, "5-8": 0, ">8": 1}
    assert list(r.histogram) == [label for label, _, _ in HISTOGRAM_BUCKETS]
    assert r.nan_mismatch == 1
    assert r.inf_mismatch == 1
    # Abs/rel error over elements finite on both sides: 9 ULPs at 1.0 is 9 * 2^-23.
    assert r.max_abs_error == 9 * 2.0**-23
    assert r.max_rel_error == 9 * 2.0**-23
    first = r.first_mismatch
    assert first.flat_index == 1 and first.index == (1,)
    assert first.reference == 1.0 and first.candidate == 1.0 + 2.0**-23
    assert first.reference_bits == 0x3F800000 and first.candidate_bits == 0x3F800001
    assert first.ulps == 1
    assert r.worst_mismatch.flat_index == 6 and r.worst_mismatch.ulps == 9


def test_compare_nan_payload_and_signed_zero_are_not_bitwise_equal():
    ref = from_bits(torch.float16, [0x7E00, 0x0000])
    cand = from_bits(torch.float16, [0x7E01, 0x8000])
    r = compare(ref, cand)
    assert not r.bitwise_equal and r.n_mismatch == 2
    assert r.max_ulp == 0 and r.nan_mismatch == 0 and r.inf_mismatch == 0
    assert r.max_abs_error == 0.0 and r.max_rel_error == 0.0


def test_compare_relative_error_at_reference_zero():
    ref = torch.tensor([0.0, 0.0, 2.0])
    cand = torch.tensor([0.0, 1.0, 2.0])
    r = compare(ref, cand)
    assert r.max_abs_error == 1.0
    assert r.max_rel_error == math.inf
    assert r.to_dict()["max_rel_error"] == "inf"
    r_zero = compare(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert r_zero.max_rel_error == 0.0


def test_compare_equal_tensors_and_empty():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    r = compare(x, x.clone())
    assert r.bitwise_equal and r.n == 12 and r.n_mismatch == 0 and r.max_ulp == 0
    assert r.first_mismatch is None and r.worst_mismatch is None
    assert r.histogram["0"] == 12
    empty = compare(torch.empty(0), torch.empty(0))
    assert empty.bitwise_equal and empty.n == 0 and empty.mean_ulp == 0.0


def test_compare_multi_dim_index():
    ref = torch.zeros(2, 3, 4)
    cand = ref.clone()
    cand[1, 2, 3] = 1.0
    r = compare(ref, cand)
    assert r.first_mismatch.index == (1, 2, 3)
    assert r.first_mismatch.flat_index == 23


def test_compare_every_format_and_json_safe():
    for dtype in supported_dtypes():
        ref = from_bits(dtype, [ONE[dtype], NAN_PATTERNS[dtype][0], ONE[dtype]])
        cand = from_bits(dtype, [ONE[dtype] + 1, ONE[dtype], ONE[dtype]])
        r = compare(ref, cand)
        assert r.dtype == str(dtype).removeprefix("torch.")
        assert r.max_ulp == 1 and r.nan_mismatch == 1 and r.n_mismatch == 2
        json.dumps(r.to_dict(), allow_nan=False)


def test_compare_zero_dim_and_grad_tensors():
    r = compare(torch.tensor(1.0), torch.tensor(2.0))
    assert r.n == 1 and r.max_ulp == 1 << 23 and r.first_mismatch.index == ()
    w = torch.ones(3, requires_grad=True)
    assert compare(w, w * 1).bitwise_equal


def test_compare_works_on_non_contiguous_views():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    other = base.clone()
    other[0, 1] = torch.nextafter(other[0, 1], torch.tensor(100.0))
    r = compare(base.t(), other.t())
    assert r.max_ulp == 1 and r.first_mismatch.index == (1, 0)


def test_compare_rejects_bad_input():
    with pytest.raises(TypeError, match="same dtype"):
        compare(torch.zeros(2), torch.zeros(2, dtype=torch.float16))
    with pytest.raises(ValueError, match="same shape"):
        compare(torch.zeros(2), torch.zeros(3))
    with pytest.raises(TypeError, match="reference must be a torch.Tensor"):
        compare([1.0], torch.zeros(1))
    with pytest.raises(TypeError, match="not supported"):
        compare(torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="not supported"):
        ulp_distance(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))


# --- assertion helpers -----------------------------------------------------------------


def test_assert_bitwise_equal_passes_and_reports():
    x = torch.tensor([1.0, 2.0, 3.0])
    assert_bitwise_equal(x, x.clone())
    y = x.clone()
    y[2] = torch.nextafter(y[2], torch.tensor(10.0))
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(x, y, msg="grad of layer 3")
    text = str(info.value)
    assert text.startswith("grad of layer 3")
    assert "Mismatched elements (bitwise): 1 / 3 (33.3%)" in text
    assert "index (2,)" in text and "0x40400000" in text and "0x40400001" in text
    assert "Max ULP distance: 1" in text
    assert "ULP histogram: 0: 2, 1: 1, 2: 0, 3-4: 0, 5-8: 0, >8: 0" in text


def test_assert_bitwise_equal_distinguishes_signed_zero():
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))


@pytest.mark.parametrize("dtype", [*supported_dtypes(), torch.float64])
def test_bitwise_equal_tells_signed_zeros_apart_and_nans_by_their_bits(dtype):
    nan = torch.full((3,), math.nan).to(dtype)
    assert bitwise_equal(nan, nan.clone())
    if dtype == torch.float8_e8m0fnu:  # unsigned, no zero: 0xFF is its one NaN
        return
    # -0 is +0 with the sign bit set: equal values, different bits.
    zero, negative_zero = torch.zeros(2).to(dtype), torch.full((2,), -0.0).to(dtype)
    assert not bitwise_equal(zero, negative_zero)
    assert bitwise_equal(negative_zero, torch.full((2,), -0.0).to(dtype))
    # The canonical NaN with and without its sign bit: NaN both, not the same bits.
    if dtype == torch.float64:
        patterns = torch.tensor([0x7FF8000000000000, 0xFFF8000000000000 - 2**64]).view(dtype)
    else:
        fmt = format_of(dtype)
        sign_bit = 1 << (fmt.total_bits - 1)
        patterns = bits_to_tensor(fmt, [fmt.canonical_nan_bits, fmt.canonical_nan_bits | sign_bit], (2,))
    assert patterns.isnan().all() and not bitwise_equal(patterns[:1], patterns[1:])


def test_bitwise_equal_is_not_torch_equal():
    # torch.equal compares values: -0 equals +0 and a NaN never equals itself.
    zero, nan = torch.tensor([0.0]), torch.tensor([math.nan])
    assert torch.equal(zero, -zero) and not bitwise_equal(zero, -zero)
    assert not torch.equal(nan, nan) and bitwise_equal(nan, nan)


def test_bitwise_equal_is_false_across_dtypes_and_shapes():
    x = torch.tensor([1.0, 2.0])
    assert not bitwise_equal(x, x.to(torch.float64))
    assert not bitwise_equal(x, x.to(torch.bfloat16))
    assert not bitwise_equal(x, x.reshape(1, 2))
    assert not bitwise_equal(torch.tensor([1], dtype=torch.int32), torch.tensor([1], dtype=torch.int64))
    assert bitwise_equal(torch.zeros(0), torch.zeros(0))


def test_bitwise_equal_on_integers_bool_and_views():
    ints = torch.tensor([[1, -2], [3, 4]])
    assert bitwise_equal(ints, ints.clone())
    assert not bitwise_equal(ints, ints + torch.tensor([[0, 0], [0, 1]]))
    flags = torch.tensor([True, False])
    assert bitwise_equal(flags, flags.clone()) and not bitwise_equal(flags, ~flags)
    grid = torch.arange(12.0).reshape(3, 4)
    assert bitwise_equal(grid.t(), grid.t().contiguous())
    weight = torch.ones(3, requires_grad=True)
    assert bitwise_equal(weight * 1, weight.detach())


def test_bitwise_equal_rejects_bad_input():
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        bitwise_equal([1.0], torch.tensor([1.0]))
    with pytest.raises(TypeError, match="b must be a torch.Tensor"):
        bitwise_equal(torch.tensor([1.0]), 1.0)
    with pytest.raises(TypeError, match=r"element width in \{8, 16, 32, 64\} bits, got torch.complex128"):
        bitwise_equal(torch.zeros(1, dtype=torch.complex128), torch.zeros(1, dtype=torch.complex128))


def test_assert_bitwise_equal_reports_integer_bool_and_float64_tensors():
    assert_bitwise_equal(torch.tensor([1, 2]), torch.tensor([1, 2]))
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 2], [3, 5]]), msg="counts")
    text = str(info.value)
    assert text.startswith("counts") and "1 / 4 elements differ" in text
    assert "index (1, 1): reference 4, candidate 5" in text
    with pytest.raises(AssertionError, match="reference True, candidate False"):
        assert_bitwise_equal(torch.tensor([True]), torch.tensor([False]))
    with pytest.raises(AssertionError, match="reference 0.0, candidate -0.0"):
        assert_bitwise_equal(torch.zeros(1, dtype=torch.float64), -torch.zeros(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="same dtype"):
        assert_bitwise_equal(torch.tensor([1]), torch.tensor([1.0]))


def test_assert_ulp_close_bounds():
    x = from_bits(torch.bfloat16, [0x3F80, 0x4000, 0x0000])
    y = from_bits(torch.bfloat16, [0x3F81, 0x4002, 0x8000])
    assert_ulp_close(x, y, max_ulp=2)
    with pytest.raises(AssertionError) as info:
        assert_ulp_close(x, y, max_ulp=1)
    text = str(info.value)
    assert "not within 1 ULP" in text and "1 element(s) violate" in text
    assert "First bitwise mismatch at index (0,): reference 1.0 (0x3f80)" in text
    assert "First element beyond 1 ULP at index (1,): reference 2.0 (0x4000)" in text
    assert "candidate 2.03125 (0x4002), 2 ULP" in text
    assert "Greatest ULP distance: the same element (index (1,))" in text


def test_assert_ulp_close_fails_on_nan_and_inf_mismatch_even_when_near():
    nan_vs_one = (from_bits(torch.float16, [0x7E00]), from_bits(torch.float16, [0x3C00]))
    with pytest.raises(AssertionError, match="NaN mismatches: 1"):
        assert_ulp_close(*nan_vs_one, max_ulp=1000)
    inf_vs_max = (from_bits(torch.float16, [0x7C00]), from_bits(torch.float16, [0x7BFF]))
    with pytest.raises(AssertionError, match="Inf mismatches: 1"):
        assert_ulp_close(*inf_vs_max, max_ulp=1000)
    both_nan = (from_bits(torch.float16, [0x7E00]), from_bits(torch.float16, [0xFE01]))
    assert_ulp_close(*both_nan, max_ulp=0)


def test_assert_ulp_close_rejects_bad_bound():
    x = torch.zeros(1)
    with pytest.raises(ValueError, match="max_ulp must be >= 0"):
        assert_ulp_close(x, x, max_ulp=-1)
    with pytest.raises(TypeError, match="max_ulp must be an int"):
        assert_ulp_close(x, x, max_ulp=1.5)

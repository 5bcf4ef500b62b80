"""verify.oracle: bitwise equal to refgrad.exact on adversarial inputs, and to hand-derived cases.

Every expectation is either refgrad.exact's result, a hand-derived bit pattern
(HAND_CASES), or follows from the rounding rule alone (constructed midpoints).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refgrad import exact
from refgrad import formats as F
from refgrad.formats import tensor_bit_patterns as bits_of
from verify import oracle
from verify.check import CheckContext
from verify.checks.oracle import CHECK, HAND_CASES, OracleCandidate, midpoints
from verify.metrics import assert_bitwise_equal

TARGETS = oracle.TARGET_DTYPES


def _from_bits(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    return F.bits_to_tensor(F.format_of(dtype), bits)


def _assert_same_bits(stacked: torch.Tensor, target: torch.dtype, overflow: str | None = None):
    expected = exact.correctly_rounded_sum(list(stacked), target, overflow)
    got = oracle.correctly_rounded_sum(stacked, target, overflow)
    assert got.dtype == target and got.shape == expected.shape
    assert bits_of(got).tolist() == bits_of(expected).tolist()


# ------------------------------------------------------------------ strategies

_WIDTH = {
    torch.float32: 32,
    torch.bfloat16: 16,
    torch.float16: 16,
    torch.float8_e4m3fn: 8,
    torch.float8_e5m2: 8,
}


@st.composite
def any_patterns(draw, dtype=None):
    """A [W, n] tensor of arbitrary bit patterns (NaN, inf, subnormals, zeros of both signs)."""
    dtype = dtype or draw(st.sampled_from(list(_WIDTH)))
    ranks, columns = draw(st.integers(1, 9)), draw(st.integers(1, 6))
    width = _WIDTH[dtype]
    bits = draw(
        st.lists(
            st.integers(0, (1 << width) - 1), min_size=ranks * columns, max_size=ranks * columns
        )
    )
    return _from_bits(bits, dtype).reshape(ranks, columns)


def _fp32_bits(exponents=(0, 254)):
    return st.builds(
        lambda s, e, m: (s << 31) | (e << 23) | m,
        st.integers(0, 1),
        st.integers(*exponents),
        st.integers(0, (1 << 23) - 1),
    )


@st.composite
def finite_fp32(draw, exponents=(0, 254)):
    """A [W, n] float32 tensor of finite values with exponents drawn from ``exponents``."""
    ranks, columns = draw(st.integers(1, 12)), draw(st.integers(1, 5))
    bits = draw(st.lists(_fp32_bits(exponents), min_size=ranks * columns, max_size=ranks * columns))
    return _from_bits(bits, torch.float32).reshape(ranks, columns)


@st.composite
def cancelling(draw):
    """Pairs a, -a over the whole range plus tiny residues, in a drawn rank order (one column)."""
    big = draw(st.lists(_fp32_bits((90, 254)), min_size=1, max_size=10))
    residue = draw(st.lists(_fp32_bits((0, 120)), min_size=0, max_size=3))
    values = _from_bits(big, torch.float32)
    column = torch.cat([values, -values, _from_bits(residue, torch.float32)])
    order = draw(st.permutations(range(column.numel())))
    return column[list(order)].reshape(-1, 1)


# ------------------------------------------------------------------ cross-checks against refgrad.exact


@settings(max_examples=250, deadline=None)
@given(stacked=any_patterns(), target=st.sampled_from(TARGETS))
def test_any_bit_patterns_match_refgrad(stacked, target):
    _assert_same_bits(stacked, target)


@settings(max_examples=200, deadline=None)
@given(
    stacked=finite_fp32(),
    target=st.sampled_from(TARGETS),
    overflow=st.sampled_from([None, "saturate", "nan"]),
)
def test_full_exponent_range_matches_refgrad(stacked, target, overflow):
    _assert_same_bits(stacked, target, overflow)


@settings(max_examples=150, deadline=None)
@given(stacked=finite_fp32(exponents=(0, 3)), target=st.sampled_from(TARGETS))
def test_subnormals_match_refgrad(stacked, target):
    _assert_same_bits(stacked, target)


@settings(max_examples=150, deadline=None)
@given(stacked=finite_fp32(exponents=(250, 254)), target=st.sampled_from(TARGETS))
def test_near_overflow_matches_refgrad(stacked, target):
    _assert_same_bits(stacked, target)


@settings(max_examples=200, deadline=None)
@given(column=cancelling(), target=st.sampled_from(TARGETS))
def test_massive_cancellation_matches_refgrad(column, target):
    _assert_same_bits(column, target)


_ZERO_AND_SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 2.0**-149]


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.sampled_from(_ZERO_AND_SPECIALS), min_size=1, max_size=8),
    target=st.sampled_from(TARGETS),
)
def test_signed_zeros_and_specials_match_refgrad(values, target):
    _assert_same_bits(torch.tensor(values).reshape(-1, 1), target)


@settings(max_examples=200, deadline=None)
@given(
    target=st.sampled_from(TARGETS),
    data=st.data(),
    nudge=st.sampled_from([-1, 0, 1]),
    negative=st.booleans(),
    filler=st.lists(_fp32_bits(), max_size=6),
)
def test_constructed_midpoints_round_by_the_rule(target, data, nudge, negative, filler):
    """Inputs summing exactly to y + ulp(y)/2 (+ nudge·2^-149): the even neighbour at a tie."""
    fmt = F.format_of(target)
    lowest = 2 << fmt.mantissa_bits if fmt is F.FLOAT32 else 0  # half-ULP must be a float32 value
    y_bits = data.draw(st.integers(lowest, fmt.max_finite_bits - 1))
    y = F.value_to_fraction(F.decode(fmt, y_bits))
    half_ulp = (F.value_to_fraction(F.decode(fmt, y_bits + 1)) - y) / 2
    pieces = [y, half_ulp, Fraction(nudge, 2**149)]
    sign = -1 if negative else 1
    values = [
        float(sign * p) for p in pieces
    ]  # dyadic and in float32 range: exact as Python floats
    filler_values = _from_bits(filler, torch.float32).tolist()
    column = torch.tensor(values + filler_values + [-v for v in filler_values], dtype=torch.float32)
    assert sum(Fraction(v) for v in column.double().tolist()) == sign * (
        y + half_ulp + Fraction(nudge, 2**149)
    )
    chosen = y_bits if nudge < 0 else y_bits + 1 if nudge > 0 else y_bits + (y_bits % 2)
    expected = chosen | (fmt.sign_bit if negative else 0)
    got = oracle.correctly_rounded_sum(column.reshape(-1, 1), target)
    assert int(bits_of(got)[0]) == expected
    _assert_same_bits(column.reshape(-1, 1), target)


@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_vectorised_midpoints_from_the_check_generator(target):
    g = torch.Generator().manual_seed(7)
    mid = midpoints(g, target, ranks=10, columns=200)
    got = oracle.correctly_rounded_sum(mid.stacked, target)
    assert bits_of(got).tolist() == mid.expected_bits.tolist()
    assert mid.n_ties > 20  # the generator really produces exact ties


@pytest.mark.parametrize(("ranks", "columns"), [(64, 10_000), (6, 50_000)])
def test_midpoints_across_chunk_boundaries(ranks, columns):
    # Enough columns to span several banding chunks (2^18 elements) and finishing blocks;
    # the expected bits come from the rounding rule, so no slow reference is needed.
    g = torch.Generator().manual_seed(ranks)
    mid = midpoints(g, torch.bfloat16, ranks=ranks, columns=columns)
    got = oracle.correctly_rounded_sum(mid.stacked, torch.bfloat16)
    assert_bitwise_equal(bits_of(got), mid.expected_bits)


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda c: c.label)
def test_hand_derived_case(case):
    got = oracle.correctly_rounded_sum(case.stacked(), case.target, case.overflow)
    assert int(bits_of(got)[0]) == case.expected_bits


# ------------------------------------------------------------------ structure and limits


def test_sequence_and_stacked_inputs_agree_and_keep_shape():
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(3, 4, 5, generator=g) * 2.0 ** (8 * i) for i in range(5)]
    from_list = oracle.correctly_rounded_sum(tensors, torch.bfloat16)
    from_stack = oracle.correctly_rounded_sum(torch.stack(tensors), torch.bfloat16)
    assert from_list.shape == (3, 4, 5)
    assert_bitwise_equal(bits_of(from_list), bits_of(from_stack))
    assert_bitwise_equal(
        bits_of(from_list), bits_of(exact.correctly_rounded_sum(tensors, torch.bfloat16))
    )


def test_empty_and_scalar_outputs():
    empty = oracle.correctly_rounded_sum([torch.ones(2, 0, 3)] * 2, torch.float16)
    assert empty.shape == (2, 0, 3) and empty.dtype == torch.float16
    # A 1-D stacked tensor sums to a scalar: 1 + 2^-24 ties to 1 in float32 (hand-derived).
    scalar = oracle.correctly_rounded_sum(torch.tensor([1.0, 2.0**-24]), torch.float32)
    assert scalar.shape == () and int(bits_of(scalar)) == 0x3F800000


def test_mixed_input_dtypes_match_refgrad():
    g = torch.Generator().manual_seed(4)
    tensors = [
        torch.randn(64, generator=g).to(torch.float16),
        torch.randn(64, generator=g).to(torch.bfloat16),
        torch.randn(64, generator=g),
        torch.randn(64, generator=g).to(torch.float8_e5m2),
    ]
    for target in TARGETS:
        expected = exact.correctly_rounded_sum(tensors, target)
        assert_bitwise_equal(
            bits_of(oracle.correctly_rounded_sum(tensors, target)), bits_of(expected)
        )


def test_transposed_and_requires_grad_inputs():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(40, 6, generator=g, requires_grad=True)
    stacked = base.t()  # [6, 40], non-contiguous
    expected = exact.correctly_rounded_sum(list(stacked.detach()), torch.float32)
    assert_bitwise_equal(
        bits_of(oracle.correctly_rounded_sum(stacked, torch.float32)), bits_of(expected)
    )


def test_more_ranks_than_one_float64_group():
    # 8200 ranks > 2^13 rows: band sums of two row groups are added as integers.
    g = torch.Generator().manual_seed(6)
    half = torch.randn(4099, 2, generator=g) * torch.tensor([2.0**100, 2.0**-120])
    residue = torch.tensor([[2.0**70, 2.0**-140], [1.0, -(2.0**-149)]])
    cancelling = torch.cat([half, -half, residue])  # column sums: 2^70 + 1 and -2^-149 + 2^-140
    positive = torch.rand(8200, 1, generator=g) * 2.0**-20  # no cancellation at all
    stacked = torch.cat([cancelling, positive], dim=1)
    stacked = stacked[torch.randperm(stacked.shape[0], generator=g)]
    _assert_same_bits(stacked, torch.float32)
    _assert_same_bits(stacked, torch.bfloat16)


def test_band_sums_at_their_proven_bound():
    # The largest value of bands 0, 7 and 15 (exponent field 15, 127, 254; mantissa all ones),
    # 8197 times: one full float64 group of 2^13 rows at the bound |K| < 2^52, plus a second group.
    ranks = 8197
    top_of_band = [(15 << 23) | 0x7FFFFF, (127 << 23) | 0x7FFFFF, (254 << 23) | 0x7FFFFF, 1]
    stacked = _from_bits(top_of_band, torch.float32).repeat(ranks, 1)
    _assert_same_bits(stacked, torch.float32)
    got = oracle.correctly_rounded_sum(stacked, torch.float32)
    # Hand-derived: 8197 x 2^-149 is exactly representable (8197 < 2^23): bits 0x2005;
    # 8197 x max float32 overflows to +inf.
    assert bits_of(got)[3] == 0x2005 and bits_of(got)[2] == 0x7F800000


def test_widening_to_float32_is_exact_for_every_input_pattern():
    # The proof assumes the oracle's .float() of each input format is exact; check every pattern.
    for dtype, width in (
        (torch.float16, 16),
        (torch.bfloat16, 16),
        (torch.float8_e4m3fn, 8),
        (torch.float8_e5m2, 8),
    ):
        fmt = F.format_of(dtype)
        patterns = list(range(1 << width))
        widened = (
            _from_bits(patterns, dtype).float().double().tolist()
        )  # float32 -> float64 is exact
        for bits, got in zip(patterns, widened):
            value = F.decode(fmt, bits)
            if value is F.Special.NAN:
                assert got != got, (dtype, hex(bits))
            elif value is F.Special.NEG_ZERO:
                assert got == 0 and math.copysign(1.0, got) < 0, (dtype, hex(bits))
            elif value in (F.Special.POS_INF, F.Special.NEG_INF):
                assert got == (float("inf") if value is F.Special.POS_INF else float("-inf")), hex(
                    bits
                )
            else:
                assert Fraction(got) == value and math.copysign(1.0, got) == (
                    -1.0 if value < 0 else 1.0
                )


def test_bad_arguments_raise_clear_errors():
    x = torch.ones(2, 3)
    with pytest.raises(TypeError, match="dtype must be one of"):
        oracle.correctly_rounded_sum(x, torch.float64)
    with pytest.raises(TypeError, match="dtype must be one of"):
        oracle.correctly_rounded_sum(x, torch.float8_e8m0fnu)
    with pytest.raises(TypeError, match="has dtype torch.float64"):
        oracle.correctly_rounded_sum(x.double(), torch.float32)
    with pytest.raises(TypeError, match=r"\[1\] has dtype torch.int32"):
        oracle.correctly_rounded_sum([x, x.int()], torch.float32)
    with pytest.raises(TypeError, match=r"\[0\] must be a torch.Tensor"):
        oracle.correctly_rounded_sum([[1.0]], torch.float32)
    with pytest.raises(ValueError, match="overflow must be one of"):
        oracle.correctly_rounded_sum(x, torch.float32, overflow="wrap")
    with pytest.raises(ValueError, match="no infinity"):
        oracle.correctly_rounded_sum(x, torch.float8_e4m3fn, overflow="inf")
    with pytest.raises(ValueError, match="at least one tensor"):
        oracle.correctly_rounded_sum([], torch.float32)
    with pytest.raises(ValueError, match="dimension 0 is empty"):
        oracle.correctly_rounded_sum(torch.ones(0, 3), torch.float32)
    with pytest.raises(ValueError, match="0-d tensor"):
        oracle.correctly_rounded_sum(torch.tensor(1.0), torch.float32)
    with pytest.raises(ValueError, match="same shape"):
        oracle.correctly_rounded_sum([x, torch.ones(3, 2)], torch.float32)
    with pytest.raises(ValueError, match="one device"):
        oracle.correctly_rounded_sum([torch.ones(2), torch.ones(2, device="meta")], torch.float32)
    with pytest.raises(ValueError, match=f"at most {oracle.MAX_RANKS}"):
        oracle.correctly_rounded_sum(torch.empty(oracle.MAX_RANKS + 1, 1), torch.float32)


def test_refuses_to_run_when_subnormals_are_flushed():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        with pytest.raises(RuntimeError, match="flushed to zero"):
            oracle.correctly_rounded_sum(torch.ones(2, 3), torch.float32)
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    g = torch.Generator().manual_seed(8)
    stacked = torch.randn(64, 1000, generator=g) * 2.0 ** torch.randint(
        -60, 60, (64, 1000), generator=g
    )
    stacked[:, :10] = torch.tensor(
        [float("nan"), float("inf"), -0.0, 0.0, 1.0, 2.0**-149, -1.0, 3.0, 4.0, 5.0]
    )
    for target in TARGETS:
        cpu = oracle.correctly_rounded_sum(stacked, target)
        gpu = oracle.correctly_rounded_sum(stacked.cuda(), target)
        assert gpu.device.type == "cuda"
        assert_bitwise_equal(bits_of(gpu.cpu()), bits_of(cpu))


# ------------------------------------------------------------------ the registered check


def test_check_passes_quick():
    result = CHECK.execute(CheckContext(quick=True))
    assert result.passed, (result.error, [e for e in result.expectations if not e.passed])
    assert result.comparisons and result.expectations


def _float64_then_cast(stacked, dtype, overflow=None):
    # A plausible but wrong oracle: a float64 sum rounds before the final cast (double rounding).
    return stacked.double().sum(0).to(dtype)


def _drops_negative_zero(stacked, dtype, overflow=None):
    # Right everywhere except that an all -0 column comes back as +0.
    result = oracle.correctly_rounded_sum(stacked, dtype, overflow)
    return torch.where(result == 0, torch.zeros_like(result), result)


@pytest.mark.parametrize("broken", [_float64_then_cast, _drops_negative_zero])
def test_check_fails_for_a_broken_candidate(broken):
    result = CHECK.execute(CheckContext(quick=True), OracleCandidate(correctly_rounded_sum=broken))
    assert result.error is None, result.error
    assert not result.passed

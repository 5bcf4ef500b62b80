"""refgrad.exact: exact sums, IEEE special rules, and the correctly rounded sum.

Expected values come from hand derivations (the HAND_CASES table and the rule
tables below), from the definition of round-to-nearest-even checked directly
against ``refgrad.formats.decode`` (never against ``round_to_bits``), and from
IEEE float32 addition, which is correctly rounded for two terms.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refgrad import formats as F
from refgrad.exact import correctly_rounded_sum, exact_sum, ieee_sum
from refgrad.formats import Special
from refgrad.formats import tensor_bit_patterns as bits_of
from verify.checks.oracle import HAND_CASES

NAN, POS_INF, NEG_INF, NEG_ZERO = Special.NAN, Special.POS_INF, Special.NEG_INF, Special.NEG_ZERO


def _fp32(bits: list[int]) -> torch.Tensor:
    return torch.tensor(
        [b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32
    ).view(torch.float32)


# ------------------------------------------------------------------ exact_sum


def test_exact_sum_is_exact():
    assert exact_sum([Fraction(1, 3), 2, Fraction(-1, 3)]) == 2
    assert exact_sum([Fraction(2) ** 127, Fraction(1, 2**149), -(Fraction(2) ** 127)]) == Fraction(
        1, 2**149
    )
    assert exact_sum([]) == 0
    assert exact_sum(iter([1, 2, 3])) == 6


@pytest.mark.parametrize("bad", [0.5, True, Special.NEG_ZERO, "1"])
def test_exact_sum_rejects_non_exact_values(bad):
    with pytest.raises(TypeError, match=r"values\[1\] must be a Fraction or an int"):
        exact_sum([1, bad])


# ------------------------------------------------------------------ ieee_sum

IEEE_RULES = [
    ([NAN, Fraction(1)], NAN),
    ([POS_INF, NEG_INF], NAN),
    ([NEG_INF, Fraction(3), POS_INF], NAN),
    ([NAN, POS_INF], NAN),
    ([POS_INF, Fraction(-5)], POS_INF),
    ([NEG_INF, NEG_ZERO], NEG_INF),
    ([POS_INF, POS_INF], POS_INF),
    ([NEG_ZERO], NEG_ZERO),
    ([NEG_ZERO, NEG_ZERO, NEG_ZERO], NEG_ZERO),
    ([NEG_ZERO, Fraction(0)], Fraction(0)),
    ([Fraction(1), Fraction(-1)], Fraction(0)),
    ([Fraction(-1), NEG_ZERO, Fraction(1)], Fraction(0)),
    ([], Fraction(0)),
    ([Fraction(1, 2), 1, NEG_ZERO], Fraction(3, 2)),
]


@pytest.mark.parametrize(("values", "expected"), IEEE_RULES)
def test_ieee_sum_rules(values, expected):
    result = ieee_sum(values)
    assert result == expected
    assert type(result) is type(expected)  # +0 is Fraction(0), never Special.NEG_ZERO


def test_ieee_sum_rejects_floats():
    with pytest.raises(TypeError, match=r"values\[0\] must be a Fraction, an int or a refgrad"):
        ieee_sum([0.5])


# ------------------------------------------------------------------ hand-derived roundings


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda c: c.label)
def test_hand_derived_case(case):
    result = correctly_rounded_sum(list(case.stacked()), case.target, case.overflow)
    assert result.dtype == case.target and result.shape == (1,)
    assert int(bits_of(result)[0]) == case.expected_bits


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda c: c.label)
def test_hand_case_inputs_are_exactly_representable(case):
    # The table only means what it says if torch.tensor(...) stored each value exactly.
    stored = case.stacked().reshape(-1).double().tolist()
    for value, kept in zip(case.inputs, stored):
        assert kept == value or (value != value and kept != kept)


def test_mixed_input_dtypes_and_shapes():
    a = torch.tensor([[1.0, 2.0**-11], [-0.0, 3.0]], dtype=torch.float16)
    b = torch.tensor([[2.0**-11, 0.0], [-0.0, 2.0**-8]], dtype=torch.bfloat16)
    out = correctly_rounded_sum([a, b], torch.float16)
    assert out.shape == (2, 2)
    # 1 + 2^-11 ties 1 (even) and 1 + 2^-10; 2^-11 + 0 is exact (0x1000); -0 + -0 = -0;
    # ulp(3) = 2^-9 in fp16, so 3 + 2^-8 = 3 + 2 ulp is exact (0x4200 + 2).
    assert bits_of(out).reshape(-1).tolist() == [0x3C00, 0x1000, 0x8000, 0x4202]


def test_scalar_and_empty_shapes():
    scalar = correctly_rounded_sum([torch.tensor(1.0), torch.tensor(2.0**-24)], torch.float32)
    assert scalar.shape == () and scalar.item() == 1.0
    empty = correctly_rounded_sum([torch.empty(0, 3), torch.empty(0, 3)], torch.bfloat16)
    assert empty.shape == (0, 3) and empty.dtype == torch.bfloat16


def test_bad_arguments_raise_clear_errors():
    x = torch.ones(3)
    with pytest.raises(ValueError, match="at least one tensor"):
        correctly_rounded_sum([], torch.float32)
    with pytest.raises(TypeError, match="sequence of tensors"):
        correctly_rounded_sum(torch.ones(2, 3), torch.float32)
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a torch.Tensor"):
        correctly_rounded_sum([x, [1.0, 2.0, 3.0]], torch.float32)
    with pytest.raises(ValueError, match="same shape"):
        correctly_rounded_sum([x, torch.ones(4)], torch.float32)
    with pytest.raises(ValueError, match="unsupported format"):
        correctly_rounded_sum([x], torch.float64)
    with pytest.raises(ValueError, match="overflow must be one of"):
        correctly_rounded_sum([x], torch.float32, overflow="wrap")
    with pytest.raises(ValueError, match="no infinity"):
        correctly_rounded_sum([x], torch.float8_e4m3fn, overflow="inf")


# ------------------------------------------------------------------ properties


def _finite_fp32_bits():
    # Sign, any biased exponent below 255 (0 = subnormal), any mantissa: the whole finite range.
    return st.builds(
        lambda s, e, m: (s << 31) | (e << 23) | m,
        st.integers(0, 1),
        st.integers(0, 254),
        st.integers(0, (1 << 23) - 1),
    )


def _coarse_fp32_bits():
    # Two significant bits and exponents near 1: sums land exactly on bf16/fp8 midpoints often.
    return st.builds(
        lambda s, e, m: (s << 31) | (e << 23) | (m << 21),
        st.integers(0, 1),
        st.integers(118, 135),
        st.integers(0, 3),
    )


def _magnitude(value: F.Value) -> Fraction:
    return abs(F.value_to_fraction(value))


@settings(max_examples=300, deadline=None)
@given(
    columns=st.lists(
        st.lists(st.one_of(_finite_fp32_bits(), _coarse_fp32_bits()), min_size=1, max_size=6),
        min_size=1,
        max_size=4,
    ),
    target=st.sampled_from([F.FLOAT32, F.FLOAT16, F.BFLOAT16, F.FLOAT8_E4M3FN, F.FLOAT8_E5M2]),
)
def test_result_is_the_nearest_even_neighbour(columns, target):
    """Checks the definition of RNE with decode alone: no neighbour is nearer; a tie picks even bits."""
    ranks = max(len(c) for c in columns)
    padded = [c + [0x80000000] * (ranks - len(c)) for c in columns]  # pad with -0: changes no sum
    stacked = _fp32([b for column in padded for b in column]).reshape(len(columns), ranks).T
    result = correctly_rounded_sum(list(stacked), target.torch_dtype)
    max_bits = target.max_finite_bits
    # The overflow threshold: max + half an ULP at the top (ulp = max - predecessor of max).
    top_ulp = target.max_finite - F.decode(target, max_bits - 1)
    threshold = target.max_finite + top_ulp / 2
    for column, out_bits in zip(padded, bits_of(result).tolist()):
        exact = sum((F.value_to_fraction(F.decode(F.FLOAT32, b)) for b in column), Fraction(0))
        magnitude_bits = out_bits & ~target.sign_bit
        negative = bool(out_bits & target.sign_bit)
        if abs(exact) >= threshold or (
            abs(exact) > target.max_finite and target.default_overflow == "saturate"
        ):
            if target.has_inf:
                assert F.decode(target, out_bits) == (
                    Special.NEG_INF if exact < 0 else Special.POS_INF
                )
            else:
                assert magnitude_bits == max_bits and negative == (exact < 0)
            continue
        assert magnitude_bits <= max_bits
        if exact != 0:
            assert negative == (exact < 0)
        else:
            only_neg_zero = all(b == 0x80000000 for b in column)
            assert out_bits == (target.sign_bit if only_neg_zero else 0)
        value = _magnitude(F.decode(target, magnitude_bits))
        below = _magnitude(F.decode(target, magnitude_bits - 1)) if magnitude_bits > 0 else None
        above = (
            _magnitude(F.decode(target, magnitude_bits + 1))
            if magnitude_bits < max_bits
            else value + top_ulp
        )
        a = abs(exact)
        for neighbour in (below, above):
            if neighbour is None:
                continue
            assert abs(a - value) <= abs(a - neighbour)
            if abs(a - value) == abs(a - neighbour):
                assert magnitude_bits % 2 == 0, "a tie must round to the even pattern"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_finite_fp32_bits(), _finite_fp32_bits()), min_size=1, max_size=16))
def test_two_terms_match_ieee_float32_addition(pairs):
    """IEEE 754 makes float32 a + b correctly rounded (signed zeros and overflow included)."""
    a = _fp32([p[0] for p in pairs])
    b = _fp32([p[1] for p in pairs])
    result = correctly_rounded_sum([a, b], torch.float32)
    assert bits_of(result).tolist() == bits_of(a + b).tolist()

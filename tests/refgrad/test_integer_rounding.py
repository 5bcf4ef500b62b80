"""``refgrad.integer_rounding`` (integer arithmetic) equals ``refgrad.formats``' rounding (the spec).

The expected value of every case is ``round_to_value`` of the same exact input:
every finite value of the 8-bit formats and a sample with both ends of the others, the exact midpoints between neighbours (ties,
both parities), midpoints nudged by far less than an ULP either way, the
subnormal range down to below half the smallest subnormal, the overflow edge
(the largest finite value plus just under and exactly half an ULP), non-dyadic
rationals, and random rationals with huge numerators and denominators.
"""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
import torch

from refgrad import formats as F
from refgrad import integer_rounding as I
from refgrad.optim import FLOAT64, to_tensor

IEEE = (F.FLOAT32, F.FLOAT16, F.BFLOAT16, F.FLOAT8_E5M2, FLOAT64)
FORMATS = (*IEEE, F.FLOAT8_E4M3FN)


def _spec(fmt: F.FloatFormat, value: Fraction) -> Fraction | None:
    """round_to_value's result, or None where it overflows (the ``"nan"`` policy marks it)."""
    rounded = F.round_to_value(fmt, value, overflow="nan")
    if rounded is F.Special.NAN:
        return None
    return F.value_to_fraction(rounded)


def _positive_values(fmt: F.FloatFormat, rng: random.Random, count: int) -> list[Fraction]:
    """Finite positive values of ``fmt``: all of them for 8 bits, else a sample with both ends."""
    top = fmt.max_finite_bits
    if fmt.total_bits <= 8:
        patterns = range(1, top + 1)
    else:
        ends = [*range(1, 40), *range(top - 40, top + 1),
                *((1 << fmt.mantissa_bits) + d for d in range(-20, 20))]  # around 2^min_exponent
        patterns = ends + [rng.randrange(1, top + 1) for _ in range(count)]
    return [F.decode(fmt, b) for b in patterns]


def _cases(fmt: F.FloatFormat, seed: int) -> list[Fraction]:
    rng = random.Random(seed)
    values = _positive_values(fmt, rng, 1500)
    ordered = sorted(set(values))
    tiny = fmt.min_positive / 2**40
    out = [Fraction(0), *values]
    for low, high in zip([Fraction(0), *ordered], ordered):
        middle = (low + high) / 2  # an exact tie
        out += [middle, middle - tiny, middle + tiny]
    max_ulp = fmt.max_finite - ordered[-2]
    out += [fmt.max_finite + max_ulp / 2 - tiny, fmt.max_finite + max_ulp / 2,
            fmt.max_finite + max_ulp, fmt.max_finite * 4, fmt.min_positive / 2, fmt.min_positive / 3]
    for _ in range(1000):
        scale = Fraction(2) ** rng.randint(fmt.min_exponent - fmt.mantissa_bits - 3,
                                            -fmt.min_exponent + 2)
        out.append(Fraction(rng.randrange(1, 10**30), rng.randrange(1, 10**30)) * scale)
        out.append(Fraction(rng.randrange(1, 1000), rng.choice((3, 7, 10, 1000))) * scale)
    out += [-v for v in out]
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_rational_equals_round_to_value(fmt):
    cases = _cases(fmt, seed=len(fmt.name))
    overflows = inexact = 0
    for value in cases:
        want = _spec(fmt, value)
        if want is None:
            overflows += 1
            with pytest.raises(OverflowError, match=fmt.name):
                I.round_rational(fmt, value)
            continue
        got = I.round_rational(fmt, value)
        assert got == want, (fmt.name, value)
        inexact += got != value
    assert overflows >= 8 and inexact > 1000  # the edges above were reached


def test_round_rational_accepts_ints_and_refuses_formats_without_subnormals():
    assert I.round_rational(F.BFLOAT16, 257) == 256  # tie between 256 and 258: to even (256)
    assert I.round_rational(F.BFLOAT16, 259) == 260
    with pytest.raises(ValueError, match="float8_e8m0fnu"):
        I.round_rational(F.FLOAT8_E8M0FNU, Fraction(1, 3))


@pytest.mark.parametrize("fmt", IEEE, ids=lambda f: f.name)
def test_round_rational_bits_equals_round_to_bits(fmt):
    overflows = 0
    for value in _cases(fmt, seed=7 * len(fmt.name)):
        want = F.round_to_bits(fmt, value, overflow="nan")
        if want == fmt.canonical_nan_bits:
            overflows += 1
            with pytest.raises(OverflowError, match=fmt.name):
                I.round_rational_bits(fmt, value)
            continue
        assert I.round_rational_bits(fmt, value) == (0 if value == 0 else want), (fmt.name, value)
    assert overflows >= 8


def test_round_rational_bits_refuses_non_ieee_formats():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        I.round_rational_bits(F.FLOAT8_E4M3FN, Fraction(1, 3))


def test_to_tensor_overflow_keeps_the_formats_policy():
    """refgrad.optim.to_tensor: a value beyond fp16's range is +-inf, as round_to_bits makes it."""
    out = to_tensor([Fraction(70000), Fraction(-1, 3), Fraction(-70000)], (3,), torch.float16)
    assert out.tolist() == [float("inf"), float(torch.tensor(-1 / 3, dtype=torch.float16)), float("-inf")]


def test_floor_log2_by_its_definition():
    """2**e <= x < 2**(e+1), on dyadic and non-dyadic rationals on both sides of powers of two
    (round_to_bits and round_rational both rest on it)."""
    rng = random.Random(3)
    values = [Fraction(1, 3), Fraction(2, 3), Fraction(4, 3), Fraction(3, 4), Fraction(1), Fraction(7, 7 * 2**40)]
    for k in range(-160, 160, 7):
        power = Fraction(2) ** k
        values += [power, power * Fraction(999, 1000), power * Fraction(1001, 1000), power * Fraction(2**60 - 1, 2**60)]
    values += [Fraction(rng.randrange(1, 10**40), rng.randrange(1, 10**40)) for _ in range(2000)]
    for x in values:
        e = F.floor_log2(x)
        assert Fraction(2) ** e <= x < Fraction(2) ** (e + 1), x

"""Rounding a finite rational to a float format with integer arithmetic only.

The same rounding as :func:`refgrad.formats.round_to_bits` (nearest, ties to
even, subnormals), which stays the written-out spec; these are its fast forms
for refgrad's hot loops (``refgrad.optim`` rounds every operation of every
element), and tests/refgrad/test_integer_rounding.py holds them equal to it
on every 8-bit value, ties, subnormals and the overflow edge. Finite results
only: where the spec would apply an overflow policy they raise OverflowError.
"""

from __future__ import annotations

from fractions import Fraction

from refgrad.formats import FloatFormat, floor_log2


def _nearest(fmt: FloatFormat, value: Fraction) -> tuple[int, int]:
    """``|value|`` rounded to ``fmt``'s precision as ``(significand, exponent)``, by integers.

    The result is ``significand * 2**exponent``: ``round_to_bits``'s rounding step
    (the quantum at this magnitude, ties to even) without its range checks.
    """
    numerator, denominator = abs(value.numerator), value.denominator
    quantum_exp = max(floor_log2(abs(value)), fmt.min_exponent) - fmt.mantissa_bits
    if quantum_exp < 0:
        numerator <<= -quantum_exp
    else:
        denominator <<= quantum_exp
    significand, remainder = divmod(numerator, denominator)  # |value| / quantum
    if 2 * remainder > denominator or (2 * remainder == denominator and significand % 2 == 1):
        significand += 1
    return significand, quantum_exp


def round_rational(fmt: FloatFormat, value: Fraction | int) -> Fraction:
    """A finite rational rounded to ``fmt`` (nearest, ties to even), as a Fraction.

    The value of ``round_to_value(fmt, value)`` (``-0`` as 0), computed with integer
    arithmetic only, for the hot loops of refgrad's references (``refgrad.optim``).
    Formats with zero and subnormals only; a result beyond the largest finite value
    is an OverflowError instead of an overflow policy.
    """
    if not (fmt.has_zero and fmt.has_subnormals):
        raise ValueError(f"round_rational: {fmt.name} has no zero or no subnormals; use round_to_value")
    value = Fraction(value)
    if value == 0:
        return value
    significand, exponent = _nearest(fmt, value)
    rounded = Fraction(significand << exponent) if exponent >= 0 else Fraction(significand, 1 << -exponent)
    if rounded > fmt.max_finite:
        raise OverflowError(f"{value} rounds beyond the largest finite {fmt.name} value")
    return rounded if value > 0 else -rounded


def round_rational_bits(fmt: FloatFormat, value: Fraction | int) -> int:
    """The bit pattern of ``round_rational(fmt, value)`` (``round_to_bits`` for a finite
    result; +0 for zero), by integers. IEEE formats (float32/16, bfloat16, e5m2) only."""
    if fmt.nan_style != "ieee" or not fmt.has_subnormals:
        raise ValueError(f"round_rational_bits: {fmt.name} is not an IEEE format; use round_to_bits")
    value = Fraction(value)
    if value == 0:
        return 0
    significand, exponent = _nearest(fmt, value)
    sign = fmt.sign_bit if value < 0 else 0
    if significand == 0:
        return sign
    if significand >> (fmt.mantissa_bits + 1):  # rounded up to the next power of two
        significand, exponent = significand >> 1, exponent + 1
    implicit = 1 << fmt.mantissa_bits
    # A significand below the implicit bit is a subnormal, at the smallest exponent: field 0.
    field = exponent + fmt.mantissa_bits + fmt.bias if significand >= implicit else 0
    if field >= (1 << fmt.exponent_bits) - 1:
        raise OverflowError(f"{value} rounds beyond the largest finite {fmt.name} value")
    return sign | (field << fmt.mantissa_bits) | (significand & (implicit - 1))

"""Tests of refgrad.formats, written from the format specifications.

Sources of truth: IEEE 754 (binary32/16, bfloat16 as binary32's top half), OCP
8-bit floating point v1.0 (E4M3FN: no inf, NaN only S.1111.111, max 448; E5M2:
IEEE-like, max 57344) and OCP MX v1.0 (E8M0: unsigned, bias 127, no zero, no
inf, NaN 0xFF). Every expected value here is derived by hand from those rules
or from torch's *widening* casts (exact by construction); where torch's
narrowing casts are not correctly rounded, the test records the exact torch
result as a known behaviour (``verify.torch_casts.KNOWN_TORCH_BEHAVIOURS``).
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

from refgrad import formats as F
from refgrad.formats import tensor_bit_patterns as bits_of
from refgrad.formats import tensor_from_bit_patterns as tensor_from_bits
from verify.checks.formats import (
    float32_cast_candidates,
    positive_finite_patterns,
    refgrad_round_float32,
)
from verify.metrics import assert_bitwise_equal
from verify.torch_casts import (
    E8M0_TORCH_SUBNORMAL_ROUND_UP,
    KNOWN_TORCH_BEHAVIOURS,
    outside_known_torch_behaviours,
    overflow_policy,
    torch_cast_overflow,
)

TWO = Fraction(2)
# What this torch's casts do past a format's largest finite value (torch 2.13 made e4m3fn
# saturate; earlier releases give NaN: verify.torch_casts.torch_cast_overflow).
TORCH = str(torch.__version__)


def torch_policy(fmt: F.FloatFormat) -> str:
    """This torch's overflow policy for ``fmt``, as the formats check decides it."""
    return overflow_policy(fmt, TORCH)

SMALL_FORMATS = (F.FLOAT16, F.BFLOAT16, F.FLOAT8_E4M3FN, F.FLOAT8_E5M2, F.FLOAT8_E8M0FNU)
EIGHT_BIT = (F.FLOAT8_E4M3FN, F.FLOAT8_E5M2, F.FLOAT8_E8M0FNU)
SIXTEEN_BIT = (F.FLOAT16, F.BFLOAT16)


def all_patterns(fmt: F.FloatFormat) -> torch.Tensor:
    return tensor_from_bits(torch.arange(1 << fmt.total_bits, dtype=torch.int64), fmt.torch_dtype)


def value_of_float(x: float) -> F.Value:
    """The exact Value of a Python float (binary64), by hand rather than via refgrad."""
    if math.isnan(x):
        return F.Special.NAN
    if math.isinf(x):
        return F.Special.POS_INF if x > 0 else F.Special.NEG_INF
    if x == 0 and math.copysign(1.0, x) < 0:
        return F.Special.NEG_ZERO
    return Fraction(x)


# --- descriptors ------------------------------------------------------------------------

# name: (total bits, exp bits, mantissa bits, bias, max finite, min normal, min positive,
#        unit roundoff, has_inf, has_zero, has_subnormals, signed, default overflow)
DESCRIPTORS = {
    "float32": (32, 8, 23, 127, (2 - TWO**-23) * TWO**127, TWO**-126, TWO**-149, TWO**-24,
                True, True, True, True, "inf"),
    "float16": (16, 5, 10, 15, Fraction(65504), TWO**-14, TWO**-24, TWO**-11,
                True, True, True, True, "inf"),
    "bfloat16": (16, 8, 7, 127, (2 - TWO**-7) * TWO**127, TWO**-126, TWO**-133, TWO**-8,
                 True, True, True, True, "inf"),
    "float8_e4m3fn": (8, 4, 3, 7, Fraction(448), TWO**-6, TWO**-9, TWO**-4,
                      False, True, True, True, "saturate"),
    "float8_e5m2": (8, 5, 2, 15, Fraction(57344), TWO**-14, TWO**-16, TWO**-3,
                    True, True, True, True, "inf"),
    "float8_e8m0fnu": (8, 8, 0, 127, TWO**127, TWO**-127, TWO**-127, TWO**-1,
                       False, False, False, False, "nan"),
}


@pytest.mark.parametrize("name", list(DESCRIPTORS))
def test_descriptor_facts(name):
    fmt = F.format_of(name)
    (total, exp_bits, man_bits, bias, max_finite, min_normal, min_positive, u,
     has_inf, has_zero, has_sub, signed, overflow) = DESCRIPTORS[name]
    assert fmt.name == name
    assert fmt.total_bits == total
    assert (fmt.exponent_bits, fmt.mantissa_bits, fmt.bias) == (exp_bits, man_bits, bias)
    assert fmt.max_finite == max_finite
    assert fmt.min_normal == min_normal
    assert fmt.min_positive == min_positive
    assert fmt.unit_roundoff == u
    assert (fmt.has_inf, fmt.has_zero, fmt.has_subnormals, fmt.signed) == (
        has_inf, has_zero, has_sub, signed)
    assert fmt.default_overflow == overflow
    assert F.is_nan_bits(fmt, fmt.canonical_nan_bits)
    assert fmt.torch_dtype == getattr(torch, name)
    assert F.decode(fmt, fmt.max_finite_bits) == max_finite


def test_gamma_is_highams_bound_exactly():
    # gamma(n) = n u / (1 - n u), derived by hand: gamma(1, 2^-24) = 2^-24 / (1 - 2^-24)
    # = 1 / (2^24 - 1); gamma(3, 2^-8) = 3 / (2^8 - 3); gamma(0, u) = 0 (no rounding).
    assert F.gamma(1, F.FLOAT32.unit_roundoff) == TWO**-24 / (1 - TWO**-24) == Fraction(1, 2**24 - 1)
    assert F.gamma(3, F.BFLOAT16.unit_roundoff) == Fraction(3, 2**8 - 3)
    assert F.gamma(0, F.FLOAT16.unit_roundoff) == 0
    assert isinstance(F.gamma(2, Fraction(1, 8)), Fraction)
    with pytest.raises(ValueError, match="n must be >= 0"):
        F.gamma(-1, Fraction(1, 4))
    # n u >= 1: the bound does not exist, at equality and beyond.
    with pytest.raises(ValueError, match="n\\*u >= 1"):
        F.gamma(4, Fraction(1, 4))
    with pytest.raises(ValueError, match="n\\*u >= 1"):
        F.gamma(2**8, F.BFLOAT16.unit_roundoff)


def test_canonical_nans_and_special_encodings():
    assert F.FLOAT32.canonical_nan_bits == 0x7FC00000
    assert F.FLOAT16.canonical_nan_bits == 0x7E00
    assert F.BFLOAT16.canonical_nan_bits == 0x7FC0
    assert F.FLOAT8_E8M0FNU.canonical_nan_bits == 0xFF
    assert F.FLOAT8_E4M3FN.canonical_nan_bits in (0x7F, 0xFF)
    assert F.FLOAT8_E4M3FN.max_finite_bits == 0x7E
    assert F.FLOAT8_E5M2.max_finite_bits == 0x7B
    assert F.FLOAT8_E8M0FNU.max_finite_bits == 0xFE


def test_format_of_and_all_formats():
    assert {f.name for f in F.ALL_FORMATS} == set(DESCRIPTORS)
    for fmt in F.ALL_FORMATS:
        assert F.format_of(fmt.torch_dtype) is fmt
        assert F.format_of(fmt.name) is fmt
        assert F.format_of(fmt) is fmt
    with pytest.raises(ValueError, match="unsupported format"):
        F.format_of(torch.float64)
    with pytest.raises(ValueError, match="unsupported format"):
        F.format_of("float8_e4m3fnuz")


# --- decode -------------------------------------------------------------------------------

DECODE_CASES = [
    (F.FLOAT32, 0x3F800000, Fraction(1)),
    (F.FLOAT32, 0x00000001, TWO**-149),
    (F.FLOAT32, 0x7F7FFFFF, (2 - TWO**-23) * TWO**127),
    (F.FLOAT32, 0xC0490FDB, -Fraction(13176795, 2**22)),  # float32(-pi)
    (F.FLOAT32, 0x80000000, F.Special.NEG_ZERO),
    (F.FLOAT32, 0xFF800000, F.Special.NEG_INF),
    (F.FLOAT32, 0x7F800001, F.Special.NAN),
    (F.FLOAT16, 0x3C00, Fraction(1)),
    (F.FLOAT16, 0x3C01, 1 + TWO**-10),
    (F.FLOAT16, 0x0001, TWO**-24),
    (F.FLOAT16, 0x03FF, 1023 * TWO**-24),
    (F.FLOAT16, 0x0400, TWO**-14),
    (F.FLOAT16, 0x7BFF, Fraction(65504)),
    (F.FLOAT16, 0xFBFF, Fraction(-65504)),
    (F.FLOAT16, 0x7C00, F.Special.POS_INF),
    (F.FLOAT16, 0xFC00, F.Special.NEG_INF),
    (F.FLOAT16, 0x8000, F.Special.NEG_ZERO),
    (F.FLOAT16, 0x0000, Fraction(0)),
    (F.FLOAT16, 0x7E00, F.Special.NAN),
    (F.FLOAT16, 0xFC01, F.Special.NAN),
    (F.BFLOAT16, 0x3F80, Fraction(1)),
    (F.BFLOAT16, 0x4049, Fraction(201, 64)),  # 1.5703125 * 2
    (F.BFLOAT16, 0x0001, TWO**-133),
    (F.BFLOAT16, 0x7F7F, (2 - TWO**-7) * TWO**127),
    (F.BFLOAT16, 0x7F80, F.Special.POS_INF),
    (F.FLOAT8_E4M3FN, 0x38, Fraction(1)),
    (F.FLOAT8_E4M3FN, 0x01, TWO**-9),
    (F.FLOAT8_E4M3FN, 0x07, 7 * TWO**-9),
    (F.FLOAT8_E4M3FN, 0x08, TWO**-6),
    (F.FLOAT8_E4M3FN, 0x77, Fraction(240)),
    (F.FLOAT8_E4M3FN, 0x78, Fraction(256)),  # exponent field all ones is finite here
    (F.FLOAT8_E4M3FN, 0x7E, Fraction(448)),
    (F.FLOAT8_E4M3FN, 0xFE, Fraction(-448)),
    (F.FLOAT8_E4M3FN, 0x7F, F.Special.NAN),
    (F.FLOAT8_E4M3FN, 0xFF, F.Special.NAN),
    (F.FLOAT8_E4M3FN, 0x80, F.Special.NEG_ZERO),
    (F.FLOAT8_E5M2, 0x3C, Fraction(1)),
    (F.FLOAT8_E5M2, 0x01, TWO**-16),
    (F.FLOAT8_E5M2, 0x7B, Fraction(57344)),
    (F.FLOAT8_E5M2, 0x7C, F.Special.POS_INF),
    (F.FLOAT8_E5M2, 0xFC, F.Special.NEG_INF),
    (F.FLOAT8_E5M2, 0x7D, F.Special.NAN),
    (F.FLOAT8_E8M0FNU, 0x00, TWO**-127),
    (F.FLOAT8_E8M0FNU, 0x7F, Fraction(1)),
    (F.FLOAT8_E8M0FNU, 0x80, Fraction(2)),
    (F.FLOAT8_E8M0FNU, 0xFE, TWO**127),
    (F.FLOAT8_E8M0FNU, 0xFF, F.Special.NAN),
]


@pytest.mark.parametrize("fmt, bits, expected", DECODE_CASES,
                         ids=[f"{c[0].name}-{c[1]:#x}" for c in DECODE_CASES])
def test_decode_hand_cases(fmt, bits, expected):
    assert F.decode(fmt, bits) == expected


@pytest.mark.parametrize("fmt", SMALL_FORMATS, ids=lambda f: f.name)
def test_decode_matches_torch_widening_every_pattern(fmt):
    # Widening to float64 is exact for all of these formats, so it is an independent decoder.
    widened = all_patterns(fmt).to(torch.float64).tolist()
    for bits, x in enumerate(widened):
        assert F.decode(fmt, bits) == value_of_float(x), f"{fmt.name} {bits:#x}"


def test_float32_decode_random_patterns_matches_struct():
    gen = torch.Generator().manual_seed(7)
    patterns = torch.randint(0, 2**32, (3000,), generator=gen, dtype=torch.int64).tolist()
    patterns += [0, 1, 0x80000000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x00800000, 0x007FFFFF]
    for bits in patterns:
        x = struct.unpack("<f", struct.pack("<I", bits))[0]
        assert F.decode(F.FLOAT32, bits) == value_of_float(x), hex(bits)
        back = F.round_to_bits(F.FLOAT32, F.decode(F.FLOAT32, bits))
        assert F.is_nan_bits(F.FLOAT32, back) if math.isnan(x) else back == bits


# NaN sets, by hand: IEEE formats have (2^m - 1) NaN mantissas per sign.
NAN_COUNTS = {"float16": 2 * 1023, "bfloat16": 2 * 127, "float8_e5m2": 2 * 3,
              "float8_e4m3fn": 2, "float8_e8m0fnu": 1}


@pytest.mark.parametrize("fmt", SMALL_FORMATS, ids=lambda f: f.name)
def test_nan_encodings(fmt):
    nan_patterns = [b for b in range(1 << fmt.total_bits) if F.is_nan_bits(fmt, b)]
    assert len(nan_patterns) == NAN_COUNTS[fmt.name]
    if fmt is F.FLOAT8_E4M3FN:
        assert nan_patterns == [0x7F, 0xFF]  # S.1111.111 only
    if fmt is F.FLOAT8_E8M0FNU:
        assert nan_patterns == [0xFF]
    torch_nan = torch.isnan(all_patterns(fmt).to(torch.float32)).nonzero().flatten().tolist()
    assert nan_patterns == torch_nan


# --- round trips ------------------------------------------------------------------------------


def _roundtrip_failures(fmt: F.FloatFormat, overflow: str | None = None) -> list[str]:
    failures = []
    for bits in range(1 << fmt.total_bits):
        back = F.round_to_bits(fmt, F.decode(fmt, bits), overflow)
        ok = F.is_nan_bits(fmt, back) if F.is_nan_bits(fmt, bits) else back == bits
        if not ok:
            failures.append(f"{bits:#x}->{back:#x}")
    return failures


@pytest.mark.parametrize("fmt", EIGHT_BIT, ids=lambda f: f.name)
def test_roundtrip_every_8bit_pattern_every_policy(fmt):
    policies = [p for p in F.OVERFLOW_POLICIES if fmt.has_inf or p != "inf"]
    for policy in [None, *policies]:
        assert _roundtrip_failures(fmt, policy) == [], policy


@pytest.mark.slow
@pytest.mark.parametrize("fmt", SIXTEEN_BIT, ids=lambda f: f.name)
def test_roundtrip_every_16bit_pattern(fmt):
    assert _roundtrip_failures(fmt) == []


# --- rounding, hand-derived ---------------------------------------------------------------------

NAN = "nan"  # expected: any NaN encoding
# (format, value, overflow policy or None, expected bits or NAN, why)
ROUNDING_CASES = [
    (F.FLOAT16, 1 + TWO**-11, None, 0x3C00, "tie between 1 and 1+2^-10 -> even 1.0"),
    (F.FLOAT16, 1 + 3 * TWO**-11, None, 0x3C02, "tie between odd 0x3C01 and even 0x3C02"),
    (F.FLOAT16, 1 + TWO**-11 + TWO**-40, None, 0x3C01, "just above the tie"),
    (F.FLOAT16, 1 + TWO**-11 - TWO**-40, None, 0x3C00, "just below the tie"),
    (F.FLOAT16, Fraction(2049), None, 0x6800, "int tie 2049 between 2048 and 2050 -> 2048"),
    (F.FLOAT16, Fraction(2051), None, 0x6802, "int tie 2051 between 2050 (odd) and 2052 -> 2052"),
    (F.FLOAT16, Fraction(65504), None, 0x7BFF, "max finite"),
    (F.FLOAT16, Fraction(65520) - TWO**-20, None, 0x7BFF, "just under max + half ulp"),
    (F.FLOAT16, Fraction(65520) - TWO**-20, "nan", 0x7BFF, "under the threshold: no overflow"),
    (F.FLOAT16, Fraction(65520), None, 0x7C00, "max + half ulp: tie to even overflows to inf"),
    (F.FLOAT16, Fraction(65520), "saturate", 0x7BFF, "saturate policy"),
    (F.FLOAT16, Fraction(65520), "nan", NAN, "nan policy"),
    (F.FLOAT16, Fraction(-65520), "inf", 0xFC00, "negative overflow to -inf"),
    (F.FLOAT16, Fraction(-65520), "saturate", 0xFBFF, "negative saturate"),
    (F.FLOAT16, Fraction(10**9), None, 0x7C00, "far overflow"),
    (F.FLOAT16, TWO**-25, None, 0x0000, "half the min subnormal: tie to even +0"),
    (F.FLOAT16, TWO**-25 + TWO**-60, None, 0x0001, "just above: min subnormal"),
    (F.FLOAT16, -(TWO**-25), None, 0x8000, "negative underflow keeps the sign: -0"),
    (F.FLOAT16, -(TWO**-30), None, 0x8000, "tiny negative -> -0"),
    (F.FLOAT16, 3 * TWO**-25, None, 0x0002, "tie between subnormals 1 and 2 -> 2"),
    (F.FLOAT16, Fraction(2047, 2) * TWO**-24, None, 0x0400, "largest subnormal/min normal tie"),
    (F.FLOAT16, F.Special.NEG_ZERO, None, 0x8000, "-0"),
    (F.FLOAT16, Fraction(0), None, 0x0000, "+0"),
    (F.FLOAT16, F.Special.POS_INF, None, 0x7C00, "+inf"),
    (F.FLOAT16, F.Special.NEG_INF, None, 0xFC00, "-inf"),
    (F.FLOAT16, F.Special.NAN, None, NAN, "NaN"),
    (F.FLOAT16, F.Special.POS_INF, "saturate", 0x7C00, "an exact inf is not an overflow"),
    (F.FLOAT16, F.Special.NEG_INF, "nan", 0xFC00, "an exact -inf is not an overflow"),
    (F.FLOAT8_E5M2, F.Special.POS_INF, "saturate", 0x7C, "an exact inf is not an overflow"),
    (F.BFLOAT16, 1 + TWO**-8, None, 0x3F80, "tie -> even"),
    (F.BFLOAT16, 1 + 3 * TWO**-8, None, 0x3F82, "tie -> even (up)"),
    (F.BFLOAT16, (2 - TWO**-8) * TWO**127, None, 0x7F80, "overflow threshold -> inf"),
    (F.BFLOAT16, (2 - TWO**-8) * TWO**127, "saturate", 0x7F7F, "threshold, saturate"),
    (F.BFLOAT16, (2 - TWO**-8) * TWO**127 - TWO**100, None, 0x7F7F, "below threshold"),
    (F.BFLOAT16, TWO**-134, None, 0x0000, "half min subnormal -> +0"),
    (F.BFLOAT16, 3 * TWO**-134, None, 0x0002, "subnormal tie -> even"),
    (F.FLOAT32, 1 + TWO**-24, None, 0x3F800000, "tie -> even"),
    (F.FLOAT32, 1 + TWO**-24 + TWO**-60, None, 0x3F800001, "above tie"),
    (F.FLOAT32, TWO**-150, None, 0x00000000, "half min subnormal -> +0"),
    (F.FLOAT32, 3 * TWO**-150, None, 0x00000002, "subnormal tie -> even"),
    (F.FLOAT32, (2 - TWO**-24) * TWO**127, None, 0x7F800000, "overflow threshold -> inf"),
    (F.FLOAT8_E4M3FN, Fraction(464), None, 0x7E, "448 + half ulp: ties to even 448 (0x7E even)"),
    (F.FLOAT8_E4M3FN, Fraction(464), "nan", 0x7E, "the tie does not overflow even under nan"),
    (F.FLOAT8_E4M3FN, Fraction(464) + TWO**-10, None, 0x7E, "above threshold: saturate"),
    (F.FLOAT8_E4M3FN, Fraction(464) + TWO**-10, "nan", NAN, "above threshold: nan policy"),
    (F.FLOAT8_E4M3FN, Fraction(-1000), None, 0xFE, "negative saturates to -448"),
    (F.FLOAT8_E4M3FN, Fraction(-1000), "nan", NAN, "negative overflow, nan policy"),
    (F.FLOAT8_E4M3FN, F.Special.POS_INF, None, 0x7E, "no inf: +inf saturates by default"),
    (F.FLOAT8_E4M3FN, F.Special.POS_INF, "nan", NAN, "no inf: nan policy"),
    (F.FLOAT8_E4M3FN, Fraction(240), None, 0x77, "exact"),
    (F.FLOAT8_E4M3FN, Fraction(248), None, 0x78, "tie 240/256 -> 256 (even 0x78)"),
    (F.FLOAT8_E4M3FN, TWO**-10, None, 0x00, "half min subnormal -> +0"),
    (F.FLOAT8_E4M3FN, TWO**-10 + TWO**-30, None, 0x01, "just above -> min subnormal"),
    (F.FLOAT8_E4M3FN, 3 * TWO**-10, None, 0x02, "tie 1/2 subnormal -> 2"),
    (F.FLOAT8_E4M3FN, 5 * TWO**-10, None, 0x02, "tie 2/3 subnormal -> 2"),
    (F.FLOAT8_E4M3FN, 15 * TWO**-10, None, 0x08, "tie largest subnormal/min normal -> 0x08"),
    (F.FLOAT8_E4M3FN, -(TWO**-11), None, 0x80, "negative underflow -> -0"),
    (F.FLOAT8_E5M2, Fraction(61440), None, 0x7C, "57344 + half ulp -> inf"),
    (F.FLOAT8_E5M2, Fraction(61440), "saturate", 0x7B, "saturate"),
    (F.FLOAT8_E5M2, Fraction(61440), "nan", NAN, "nan policy"),
    (F.FLOAT8_E5M2, Fraction(61439), None, 0x7B, "below threshold"),
    (F.FLOAT8_E5M2, 1 + TWO**-3, None, 0x3C, "tie 1/1.25 -> 1"),
    (F.FLOAT8_E5M2, 1 + 3 * TWO**-3, None, 0x3E, "tie 1.25/1.5 -> 1.5"),
    (F.FLOAT8_E5M2, TWO**-17, None, 0x00, "half min subnormal -> +0"),
    (F.FLOAT8_E5M2, 3 * TWO**-17, None, 0x02, "subnormal tie -> even"),
    (F.FLOAT8_E8M0FNU, Fraction(1), None, 0x7F, "1 = 2^0"),
    (F.FLOAT8_E8M0FNU, Fraction(3, 2), None, 0x80, "documented tie rule: 1.5 -> 2"),
    (F.FLOAT8_E8M0FNU, Fraction(3), None, 0x81, "documented tie rule: 3 -> 4"),
    (F.FLOAT8_E8M0FNU, Fraction(3, 2) - TWO**-40, None, 0x7F, "below the tie -> 1"),
    (F.FLOAT8_E8M0FNU, Fraction(5, 4), None, 0x7F, "linear nearest: 1.25 -> 1"),
    (F.FLOAT8_E8M0FNU, Fraction(7, 4), None, 0x80, "linear nearest: 1.75 -> 2"),
    (F.FLOAT8_E8M0FNU, TWO**127, None, 0xFE, "max"),
    (F.FLOAT8_E8M0FNU, Fraction(3, 2) * TWO**127, None, 0xFF, "overflow tie -> NaN (policy nan)"),
    (F.FLOAT8_E8M0FNU, Fraction(3, 2) * TWO**127, "saturate", 0xFE, "saturate"),
    (F.FLOAT8_E8M0FNU, Fraction(3, 2) * TWO**127 - 1, None, 0xFE, "below threshold"),
    (F.FLOAT8_E8M0FNU, TWO**-128, None, 0x00, "below the smallest value: 2^-127 is nearest"),
    (F.FLOAT8_E8M0FNU, TWO**-1000, None, 0x00, "far below: still 2^-127 (no zero)"),
    (F.FLOAT8_E8M0FNU, Fraction(5, 4) * TWO**-127, None, 0x00, "1.25*2^-127 -> 2^-127"),
    (F.FLOAT8_E8M0FNU, F.Special.POS_INF, None, 0xFF, "inf -> NaN"),
    (F.FLOAT8_E8M0FNU, F.Special.NAN, None, 0xFF, "NaN"),
]


@pytest.mark.parametrize(
    "fmt, value, overflow, expected, why", ROUNDING_CASES,
    ids=[f"{c[0].name}-{c[4]}" for c in ROUNDING_CASES],
)
def test_rounding_hand_cases(fmt, value, overflow, expected, why):
    bits = F.round_to_bits(fmt, value, overflow)
    if expected == NAN:
        assert F.is_nan_bits(fmt, bits), why
    else:
        assert bits == expected, f"{why}: got {bits:#x}"
    assert F.round_to_value(fmt, value, overflow) == F.decode(fmt, bits)


def test_round_accepts_int_and_float_exactly():
    assert F.round_to_bits(F.FLOAT16, 2049) == 0x6800
    assert F.round_to_bits(F.FLOAT16, 1.0 + 2.0**-11 + 2.0**-40) == 0x3C01
    assert F.round_to_bits(F.FLOAT16, -0.0) == 0x8000
    assert F.round_to_bits(F.FLOAT16, float("-inf")) == 0xFC00
    assert F.is_nan_bits(F.FLOAT16, F.round_to_bits(F.FLOAT16, float("nan")))


def test_rounding_rejects_bad_input():
    with pytest.raises(ValueError, match="overflow"):
        F.round_to_bits(F.FLOAT16, 1, overflow="clamp")
    with pytest.raises(ValueError, match="inf"):
        F.round_to_bits(F.FLOAT8_E4M3FN, 1000, overflow="inf")
    with pytest.raises(ValueError, match="no zero"):
        F.round_to_bits(F.FLOAT8_E8M0FNU, 0)
    with pytest.raises(ValueError, match="unsigned"):
        F.round_to_bits(F.FLOAT8_E8M0FNU, -1)
    with pytest.raises(TypeError, match="value"):
        F.round_to_bits(F.FLOAT16, "1.0")
    with pytest.raises(TypeError, match="bool"):
        F.round_to_bits(F.FLOAT16, True)
    with pytest.raises(ValueError, match="bits"):
        F.decode(F.FLOAT16, 1 << 16)
    with pytest.raises(ValueError, match="bits"):
        F.decode(F.FLOAT8_E4M3FN, -1)
    with pytest.raises(TypeError, match="bits"):
        F.decode(F.FLOAT16, 1.0)


def test_tensor_helpers_reinterpret_bits():
    bits = [0x3C00, 0x8000, 0x7C00, 0xFBFF, 0x7E01, 0x0001]
    t = F.bits_to_tensor(F.FLOAT16, bits, shape=(2, 3))
    assert t.dtype == torch.float16 and t.shape == (2, 3)
    assert F.tensor_to_bits(t) == bits
    assert t[0, 0].item() == 1.0 and t[0, 2].item() == math.inf
    decoded = F.decode_tensor(t)
    assert decoded[:4] == [Fraction(1), F.Special.NEG_ZERO, F.Special.POS_INF, Fraction(-65504)]
    assert decoded[4] is F.Special.NAN and decoded[5] == TWO**-24
    rounded = F.round_values_to_tensor(F.FLOAT8_E4M3FN, [Fraction(464), 1000, -1.5], shape=(3,))
    assert F.tensor_to_bits(rounded) == [0x7E, 0x7E, 0xBC]
    assert F.tensor_to_bits(F.bits_to_tensor(F.FLOAT32, [0xFFFFFFFF, 0x80000001])) == [
        0xFFFFFFFF, 0x80000001]
    with pytest.raises(ValueError, match="bits"):
        F.bits_to_tensor(F.FLOAT8_E5M2, [256])


def test_vectorised_bit_pattern_helpers():
    # Hand-written patterns: fp32 -0 and a NaN payload, bf16 -1 and all-ones, e4m3fn NaN, e8m0 2^0.
    cases = [
        (torch.float32, [-0.0, 1.0], [0x80000000, 0x3F800000]),
        (torch.bfloat16, [-1.0, 2.0], [0xBF80, 0x4000]),
        (torch.float8_e4m3fn, [448.0, -2.0], [0x7E, 0xC0]),
        (torch.float8_e8m0fnu, [1.0, 2.0**-127], [0x7F, 0x00]),
    ]
    for dtype, values, expected in cases:
        t = torch.tensor(values, dtype=torch.float64).to(dtype)
        got = bits_of(t)
        assert got.dtype == torch.int64 and got.tolist() == expected, dtype
        assert bits_of(tensor_from_bits(got, dtype)).tolist() == expected
    # Patterns in the top half (negative in a signed view) and NaN payloads survive.
    patterns = torch.tensor([[0xFFFFFFFF, 0x7FC00001], [0x80000001, 0]], dtype=torch.int64)
    back = tensor_from_bits(patterns, torch.float32)
    assert back.shape == (2, 2) and torch.isnan(back[0]).all()
    assert_bitwise_equal(bits_of(back), patterns)
    assert bits_of(tensor_from_bits(torch.tensor([0xFFFF]), torch.float16)).tolist() == [0xFFFF]
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        bits_of([1.0])
    with pytest.raises(TypeError, match="element width"):
        bits_of(torch.ones(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="element width"):
        tensor_from_bits(torch.zeros(2, dtype=torch.int64), torch.float64)
    with pytest.raises(TypeError, match="bits must be an integer tensor"):
        tensor_from_bits(torch.zeros(2), torch.float32)


def test_same_width_ints_reinterpret_every_8_to_64_bit_dtype():
    """The one dtype -> integer view table (verify.metrics' bitwise comparisons read it too).
    Hand-written patterns; 16- to 64-bit views are signed, so the top half is negative."""
    cases = [
        (torch.tensor([-0.0, 1.0], dtype=torch.float64), torch.int64, [-(2**63), 0x3FF0000000000000]),
        (torch.tensor([-0.0, 1.0], dtype=torch.float32), torch.int32, [-(2**31), 0x3F800000]),
        (torch.tensor([-2.0, 2.0], dtype=torch.bfloat16), torch.int16, [0xC000 - 2**16, 0x4000]),
        (torch.tensor([-2.0], dtype=torch.float64).to(torch.float8_e4m3fn), torch.uint8, [0xC0]),
        (torch.tensor([True, False]), torch.uint8, [1, 0]),
        (torch.tensor([-1, 7], dtype=torch.int64), torch.int64, [-1, 7]),
    ]
    for t, int_dtype, expected in cases:
        view = F.tensor_same_width_ints(t)
        assert view.dtype == int_dtype and view.tolist() == expected, t.dtype
    # A reinterpretation of a non-contiguous tensor's elements, not of its storage order.
    base = torch.tensor([[1.0, -0.0], [2.0, 0.5]], dtype=torch.float32)
    assert F.tensor_same_width_ints(base.t()).tolist() == [[0x3F800000, 0x40000000],
                                                         [-(2**31), 0x3F000000]]
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        F.tensor_same_width_ints([1.0])
    with pytest.raises(TypeError, match=r"element width in \{8, 16, 32, 64\} bits, got torch.complex128"):
        F.tensor_same_width_ints(torch.zeros(1, dtype=torch.complex128))


# --- agreement with torch's casts from float32 ------------------------------------------


def test_cast_candidates_hand_examples():
    # Sanity of the constructed inputs/expectations the agreement tests rely on.
    fp16 = float32_cast_candidates(F.FLOAT16, torch.tensor([0x3C00, 0x3C01, 0x7BFF]))
    pairs = dict(zip(fp16.values.tolist(), fp16.expected_bits.tolist()))
    assert pairs[1.0] == 0x3C00
    assert pairs[1 + 2**-11] == 0x3C00
    assert pairs[1 + 3 * 2**-11] == 0x3C02
    assert pairs[65520.0] == 0x7C00 and pairs[-65520.0] == 0xFC00
    assert pairs[float(torch.nextafter(torch.tensor(65520.0), torch.tensor(0.0)))] == 0x7BFF
    e4m3 = float32_cast_candidates(F.FLOAT8_E4M3FN, torch.tensor([0x7E]))
    pairs = dict(zip(e4m3.values.tolist(), e4m3.expected_bits.tolist()))
    assert pairs[464.0] == 0x7E and pairs[-464.0] == 0xFE
    assert pairs[float(torch.nextafter(torch.tensor(464.0), torch.tensor(1e9)))] == 0x7E
    # OCP's non-saturating conversion (torch before 2.13): the tie stays 448, past it NaN.
    e4m3 = float32_cast_candidates(F.FLOAT8_E4M3FN, torch.tensor([0x7E]), "nan")
    pairs = dict(zip(e4m3.values.tolist(), e4m3.expected_bits.tolist()))
    assert pairs[464.0] == 0x7E and pairs[-464.0] == 0xFE
    assert pairs[float(torch.nextafter(torch.tensor(464.0), torch.tensor(1e9)))] == 0x7F
    e8m0 = float32_cast_candidates(F.FLOAT8_E8M0FNU, torch.tensor([0x7F, 0xFE]))
    pairs = dict(zip(e8m0.values.tolist(), e8m0.expected_bits.tolist()))
    assert pairs[1.5] == 0x80 and pairs[1.5 * 2.0**127] == 0xFF and pairs[2.0**127] == 0xFE
    assert len(e8m0.values) == 8  # unsigned: no negated copies


@pytest.mark.parametrize("fmt", SMALL_FORMATS, ids=lambda f: f.name)
def test_torch_float32_casts_follow_rounding_rule_all_patterns(fmt):
    c = float32_cast_candidates(fmt, positive_finite_patterns(fmt), torch_policy(fmt))
    keep = outside_known_torch_behaviours(fmt, c.values)
    torch_bits = bits_of(c.values[keep].to(fmt.torch_dtype))
    expected = c.expected_bits[keep]
    both_nan = torch.tensor([F.is_nan_bits(fmt, int(t)) and F.is_nan_bits(fmt, int(e))
                             for t, e in zip(torch_bits.tolist(), expected.tolist())])
    mismatch = ((torch_bits != expected) & ~both_nan).nonzero().flatten()
    assert mismatch.numel() == 0, [
        (float(c.values[keep][i]), hex(int(torch_bits[i])), hex(int(expected[i])))
        for i in mismatch[:5]
    ]
    # Only the e8m0 subnormal interval is excluded, and it is a small part.
    assert int((~keep).sum()) == (1 if fmt is F.FLOAT8_E8M0FNU else 0)


@pytest.mark.parametrize("fmt", EIGHT_BIT, ids=lambda f: f.name)
def test_refgrad_follows_rounding_rule_8bit(fmt):
    c = float32_cast_candidates(fmt, positive_finite_patterns(fmt))
    assert refgrad_round_float32(fmt, c.values).tolist() == c.expected_bits.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", SIXTEEN_BIT, ids=lambda f: f.name)
def test_refgrad_follows_rounding_rule_16bit(fmt):
    every = positive_finite_patterns(fmt)
    n = every.numel()
    # Every positive tie; the float32 neighbours of ties and the negatives on a sample
    # (values "at" patterns are covered by the exhaustive round trip).
    c = float32_cast_candidates(fmt, every)
    ties = slice(n, 2 * n)
    assert_bitwise_equal(refgrad_round_float32(fmt, c.values[ties]), c.expected_bits[ties])
    sample = every[torch.randperm(n, generator=torch.Generator().manual_seed(3))[:2048]]
    s = float32_cast_candidates(fmt, sample)
    around_and_negative = slice(2 * sample.numel(), 8 * sample.numel())
    assert_bitwise_equal(
        refgrad_round_float32(fmt, s.values[around_and_negative]),
        s.expected_bits[around_and_negative],
    )


@pytest.mark.parametrize("fmt", SMALL_FORMATS, ids=lambda f: f.name)
def test_refgrad_matches_torch_on_random_float32(fmt):
    gen = torch.Generator().manual_seed(11)
    raw = torch.randint(-(2**31), 2**31, (1500,), generator=gen, dtype=torch.int64)
    arbitrary = raw.to(torch.int32).view(torch.float32)
    # Random values spread over the target's exponent range, both signs.
    exponents = torch.randint(fmt.min_exponent - fmt.mantissa_bits - 2,
                              fmt.min_exponent + (1 << fmt.exponent_bits) + 1, (1500,),
                              generator=gen)
    spread = ((1 + torch.rand(1500, generator=gen, dtype=torch.float64))
              * torch.exp2(exponents.to(torch.float64))).to(torch.float32)
    values = torch.cat([arbitrary, spread, -spread])
    values = values[outside_known_torch_behaviours(fmt, values) | torch.isnan(values)]
    torch_out = values.to(fmt.torch_dtype)
    torch_bits = bits_of(torch_out).tolist()
    ref_bits = refgrad_round_float32(fmt, values, torch_policy(fmt)).tolist()
    for x, t, r in zip(values.tolist(), torch_bits, ref_bits):
        if math.isnan(x) or F.is_nan_bits(fmt, r):  # a NaN's sign is torch's detail
            assert F.is_nan_bits(fmt, t) and F.is_nan_bits(fmt, r), f"{fmt.name}: {x!r}"
        else:
            assert t == r, f"{fmt.name}: {x!r} torch {t:#x} refgrad {r:#x}"


# --- other source dtypes ----------------------------------------------------------------


SIXTEEN_BIT_CASTS = [
    (source, target)
    for source in (torch.float16, torch.bfloat16)
    for target in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu,
                   torch.float16, torch.bfloat16)
    if source != target
]


@pytest.mark.parametrize("source, target", SIXTEEN_BIT_CASTS, ids=str)
def test_torch_16bit_sources_cast_like_float32(source, target):
    # float16/bfloat16 -> float32 is exact, and float32 -> target was checked above, so a
    # direct cast is correctly rounded exactly when it equals the cast through float32.
    every = tensor_from_bits(torch.arange(1 << 16, dtype=torch.int64), source)
    direct = bits_of(every.to(target))
    via_float32 = bits_of(every.to(torch.float32).to(target))
    nan = torch.isnan(every)
    assert_bitwise_equal(direct[~nan], via_float32[~nan])
    assert torch.isnan(tensor_from_bits(direct[nan], target).to(torch.float32)).all()
    if (source, target) == (torch.float16, torch.bfloat16):
        # Observed torch behaviour (not a rounding issue; IEEE leaves NaN payloads to the
        # implementation): fp16 -> bf16 directly turns every NaN, either sign and any payload,
        # into +0x7FC0; going through float32 gives other NaN encodings.
        assert set(direct[nan].tolist()) == {0x7FC0}


def test_refgrad_fp16_bf16_to_fp8_sample():
    gen = torch.Generator().manual_seed(5)
    for source in (F.FLOAT16, F.BFLOAT16):
        patterns = torch.randint(0, 1 << 16, (400,), generator=gen, dtype=torch.int64)
        x = tensor_from_bits(patterns, source.torch_dtype)
        for target in (F.FLOAT8_E4M3FN, F.FLOAT8_E5M2):
            got = bits_of(x.to(target.torch_dtype)).tolist()
            for value, t in zip(F.decode_tensor(x), got):
                r = F.round_to_bits(target, value, torch_policy(target))
                assert (F.is_nan_bits(target, t) and F.is_nan_bits(target, r)) or t == r


@pytest.mark.parametrize("fmt", SMALL_FORMATS, ids=lambda f: f.name)
def test_torch_float64_casts_round_twice_through_float32(fmt):
    """torch's float64 -> narrow cast equals rounding to float32 first, then to the target.

    Adversarial inputs sit a hair (2^-40 relative) above or below a target midpoint, so
    rounding to float32 lands exactly on the midpoint; the recorded disagreements with
    correct rounding are expected there, and only there.
    """
    gen = torch.Generator().manual_seed(13)
    patterns = positive_finite_patterns(fmt)[:-1]
    chosen = patterns[torch.randint(0, patterns.numel(), (300,), generator=gen)]
    low = tensor_from_bits(chosen, fmt.torch_dtype).to(torch.float64)
    high = tensor_from_bits(chosen + 1, fmt.torch_dtype).to(torch.float64)
    midpoint = (low + high) / 2
    nudge = torch.where(torch.rand(300, generator=gen) < 0.5, 1.0, -1.0).to(torch.float64)
    adversarial = midpoint * (1 + nudge * 2.0**-40)
    random64 = torch.randn(300, generator=gen, dtype=torch.float64) * 2.0 ** torch.randint(
        -8, 8, (300,), generator=gen).to(torch.float64)
    values = torch.cat([adversarial, random64.abs() if not fmt.signed else random64])
    torch_bits = bits_of(values.to(fmt.torch_dtype)).tolist()
    disagreements = 0
    for x, t in zip(values.tolist(), torch_bits):
        via_float32 = F.round_to_value(F.FLOAT32, x)
        if fmt is F.FLOAT8_E8M0FNU and (x <= 0 or 2.0**-127 < x < 1.5 * 2.0**-127):
            continue
        assert t == F.round_to_bits(fmt, via_float32, torch_policy(fmt)), f"{fmt.name} {x!r}"
        disagreements += t != F.round_to_bits(fmt, x, torch_policy(fmt))
    # Most adversarial inputs are misrounded (those whose tie already rounds the right way
    # are not), so the double rounding is really exercised.
    assert disagreements >= 100


def test_float64_to_float32_is_correctly_rounded():
    gen = torch.Generator().manual_seed(17)
    values = torch.randn(2000, generator=gen, dtype=torch.float64) * 1e-3
    got = bits_of(values.to(torch.float32)).tolist()
    assert got == [F.round_to_bits(F.FLOAT32, x) for x in values.tolist()]


# --- known torch behaviours --------------------------------------------------------------


@pytest.mark.parametrize("known", KNOWN_TORCH_BEHAVIOURS, ids=lambda k: k.name)
def test_known_torch_behaviour_is_exactly_as_recorded(known):
    # If torch changes, this fails: update the record (and the findings it feeds).
    assert known.torch_result() == known.expected_torch_bits(
        torch_policy(F.format_of(known.target_dtype)))
    assert known.refgrad_result() == known.correct_bits
    assert known.torch_bits != known.correct_bits


# (torch version, e4m3fn overflow policy): from each wheel's
# torch/headeronly/util/Float8_e4m3fn.h (2.11.0 and 2.13.0 also seen casting on the CPU), and
# PyTorch PR #178817's merge on 2026-04-17 for the 2.13.0 nightlies; None: cannot tell.
E4M3FN_OVERFLOW_BY_RELEASE = [
    ("2.11.0+cu130", "nan"),  # the lent H200's torch
    ("2.12.0", "nan"),
    ("2.12.0rc1", "nan"),
    ("2.12.1+cu130", "nan"),
    ("2.13.0.dev20260417+cpu", "nan"),  # a nightly built before the merge
    ("2.13.0.dev20260418", "saturate"),  # and after
    ("2.13.0a0+gitabc.nv26.05", None),  # a source build: before or after the merge
    ("2.13.0rc2", "saturate"),  # cut from the 2.13 branch, months after the merge
    ("2.13.0+cpu", "saturate"),
    ("2.14.0a0+gitdef", "saturate"),
    ("2.14.1", "saturate"),
    ("3.0", "saturate"),
]


@pytest.mark.parametrize("version, policy", E4M3FN_OVERFLOW_BY_RELEASE)
def test_torch_cast_overflow_follows_the_release(version, policy):
    assert torch_cast_overflow(F.FLOAT8_E4M3FN, version) == policy
    for fmt in (F.FLOAT16, F.BFLOAT16, F.FLOAT8_E5M2, F.FLOAT8_E8M0FNU):
        assert torch_cast_overflow(fmt, version) == fmt.default_overflow  # no change seen


@pytest.mark.parametrize("version", ["", "unknown", "2.13.0-custom build", None])
def test_a_version_torch_could_not_have_is_refused_by_name(version):
    with pytest.raises(ValueError, match="torch_version must be a torch version"):
        torch_cast_overflow(F.FLOAT8_E4M3FN, version)


def test_known_behaviours_of_one_policy_give_the_correct_bits_under_the_other():
    saturating = [k for k in KNOWN_TORCH_BEHAVIOURS if k.under_policy is not None]
    assert {k.example for k in saturating} == {1000.0, math.inf}
    for known in saturating:
        assert known.under_policy == "saturate"
        assert known.expected_torch_bits("nan") == known.correct_bits == 0x7F  # OCP NaN
        assert known.expected_torch_bits("saturate") == known.torch_bits == 0x7E  # 448
    assert all(k.present_under("nan") for k in KNOWN_TORCH_BEHAVIOURS if k.under_policy is None)


def test_known_torch_behaviours_cover_the_documented_cases():
    pairs = {(k.source_dtype, k.target_dtype) for k in KNOWN_TORCH_BEHAVIOURS}
    assert {("float64", "bfloat16"), ("float64", "float16"),
            ("float32", "float8_e8m0fnu"), ("float32", "float8_e4m3fn")} <= pairs
    examples = {(k.target_dtype, k.example) for k in KNOWN_TORCH_BEHAVIOURS}
    assert ("float8_e4m3fn", math.inf) in examples


def test_torch_e8m0_subnormal_round_up_interval_is_exact():
    # Every positive float32 subnormal: torch rounds (2^-127, 1.5*2^-127) up to 2^-126.
    subnormal_bits = torch.arange(1, 1 << 23, dtype=torch.int64)
    x = tensor_from_bits(subnormal_bits, torch.float32)
    torch_bits = bits_of(x.to(torch.float8_e8m0fnu))
    correct = (subnormal_bits >= 0x600000).to(torch.int64)  # 1.5*2^-127 ties up
    wrong = subnormal_bits[torch_bits != correct]
    low, high = E8M0_TORCH_SUBNORMAL_ROUND_UP
    assert wrong.numel() == 0x600000 - 0x400000 - 1
    assert float(tensor_from_bits(wrong[:1], torch.float32)) > low
    assert float(tensor_from_bits(wrong[-1:], torch.float32)) < high
    assert refgrad_round_float32(F.FLOAT8_E8M0FNU, x[wrong[::65536] - 1]).tolist() == [0] * 32


def test_torch_e8m0_drops_the_sign():
    gen = torch.Generator().manual_seed(19)
    x = torch.rand(1000, generator=gen) * 100 + 1e-3
    assert_bitwise_equal(bits_of((-x).to(torch.float8_e8m0fnu)), bits_of(x.to(torch.float8_e8m0fnu)))

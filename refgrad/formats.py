"""Bit-exact binary floating-point formats, decoded and rounded with exact arithmetic.

Every finite value of these formats is a dyadic rational, so it is represented
here as a :class:`fractions.Fraction`. The values that are not rational numbers
(NaN, the infinities) and negative zero (which equals +0 as a number but has its
own encoding) are members of :class:`Special`.

``round_to_bits`` is the single rounding step the rest of refgrad points at:
round to nearest, ties to even, from an exact value, with an explicit overflow
policy. Nothing here casts through torch or numpy; tensors are only
*reinterpreted* (``Tensor.view(int dtype)``) to read or write bit patterns.

Format rules (IEEE 754, OCP FP8 v1.0, OCP MX v1.0):

============== ==== ==== ==== ===== ======= ========================================
format         bits exp  man  bias  max     specials
============== ==== ==== ==== ===== ======= ========================================
float32          32    8   23   127 ~3.4e38  IEEE: inf, NaN (exp all ones)
float16          16    5   10    15  65504   IEEE
bfloat16         16    8    7   127 ~3.4e38  IEEE
float8_e5m2       8    5    2    15  57344   IEEE
float8_e4m3fn     8    4    3     7    448   no inf; NaN only S.1111.111
float8_e8m0fnu    8    8    0   127  2^127   unsigned, no zero, no inf, NaN 0xFF,
                                             no subnormals (0x00 is 2^-127)
============== ==== ==== ==== ===== ======= ========================================

Default overflow policy (what a value beyond the largest finite magnitude,
after rounding, becomes): ``"inf"`` for the IEEE-like formats (float32,
float16, bfloat16, float8_e5m2), ``"saturate"`` for float8_e4m3fn (the MX
element conversion saturates, and the format has no infinity), ``"nan"`` for
float8_e8m0fnu (no infinity; the MX scale encoding for "not a number").

Ties in float8_e8m0fnu: with no mantissa bits, "ties to even" is applied to the
integer significand used while rounding (1 or 2 for a value in [2^k, 2^(k+1))),
so an exact tie 1.5·2^k rounds up to 2^(k+1). IEEE 754 does not define the
rule for a one-digit significand; this is the convention chosen and documented.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

OVERFLOW_POLICIES = ("inf", "saturate", "nan")


class Special(enum.Enum):
    """Values that are not a plain rational number."""

    NAN = "nan"
    POS_INF = "+inf"
    NEG_INF = "-inf"
    NEG_ZERO = "-0"


Value = Fraction | Special
"""An exact value: a Fraction (``Fraction(0)`` is +0) or a :class:`Special`."""


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format, described by the facts rounding needs."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    signed: bool
    has_inf: bool
    has_zero: bool
    has_subnormals: bool
    nan_style: str  # "ieee": exponent all ones and mantissa != 0; "all_ones": S.1..1; "ff": 0xFF
    default_overflow: str
    torch_dtype_name: str

    def __post_init__(self) -> None:
        if self.nan_style not in ("ieee", "all_ones", "ff"):
            raise ValueError(f"nan_style must be 'ieee', 'all_ones' or 'ff', got {self.nan_style!r}")
        if self.default_overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"default_overflow must be one of {OVERFLOW_POLICIES}")
        if self.default_overflow == "inf" and not self.has_inf:
            raise ValueError(f"{self.name}: overflow policy 'inf' needs a format with infinities")

    @property
    def total_bits(self) -> int:
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_dtype_name)

    @property
    def sign_bit(self) -> int:
        """The mask of the sign bit (0 for unsigned formats)."""
        return 1 << (self.exponent_bits + self.mantissa_bits) if self.signed else 0

    @property
    def min_exponent(self) -> int:
        """The unbiased exponent of the smallest normal number."""
        # Without subnormals, exponent field 0 is an ordinary (normal) binade.
        return 1 - self.bias if self.has_subnormals else -self.bias

    @functools.cached_property
    def max_finite(self) -> Fraction:
        # Cached (the format is immutable): every rounding compares against it.
        return decode(self, self.max_finite_bits)

    @property
    def max_finite_bits(self) -> int:
        """Bit pattern of the largest finite positive value."""
        field_max = (1 << self.exponent_bits) - 1
        mant_max = (1 << self.mantissa_bits) - 1
        if self.nan_style == "ieee":
            return ((field_max - 1) << self.mantissa_bits) | mant_max
        if self.nan_style == "all_ones":
            return (field_max << self.mantissa_bits) | (mant_max - 1)
        return field_max - 1  # "ff": 0xFE

    @property
    def min_normal(self) -> Fraction:
        return Fraction(2) ** self.min_exponent

    @property
    def min_positive(self) -> Fraction:
        """The smallest positive value (a subnormal where the format has them)."""
        if self.has_subnormals:
            return Fraction(2) ** (self.min_exponent - self.mantissa_bits)
        return self.min_normal

    @property
    def unit_roundoff(self) -> Fraction:
        """u = 2^-(p) where p = mantissa_bits + 1 is the precision."""
        return Fraction(1, 2 ** (self.mantissa_bits + 1))

    @property
    def canonical_nan_bits(self) -> int:
        if self.nan_style == "ieee":
            field_max = (1 << self.exponent_bits) - 1
            quiet = 1 << (self.mantissa_bits - 1)
            return (field_max << self.mantissa_bits) | quiet
        if self.nan_style == "all_ones":
            return (1 << (self.exponent_bits + self.mantissa_bits)) - 1
        return 0xFF


FLOAT32 = FloatFormat("float32", 8, 23, 127, True, True, True, True, "ieee", "inf", "float32")
FLOAT16 = FloatFormat("float16", 5, 10, 15, True, True, True, True, "ieee", "inf", "float16")
BFLOAT16 = FloatFormat("bfloat16", 8, 7, 127, True, True, True, True, "ieee", "inf", "bfloat16")
FLOAT8_E5M2 = FloatFormat(
    "float8_e5m2", 5, 2, 15, True, True, True, True, "ieee", "inf", "float8_e5m2"
)
FLOAT8_E4M3FN = FloatFormat(
    "float8_e4m3fn", 4, 3, 7, True, False, True, True, "all_ones", "saturate", "float8_e4m3fn"
)
FLOAT8_E8M0FNU = FloatFormat(
    "float8_e8m0fnu", 8, 0, 127, False, False, False, False, "ff", "nan", "float8_e8m0fnu"
)

ALL_FORMATS: tuple[FloatFormat, ...] = (
    FLOAT32,
    FLOAT16,
    BFLOAT16,
    FLOAT8_E4M3FN,
    FLOAT8_E5M2,
    FLOAT8_E8M0FNU,
)

# Integer dtypes of the same width, for reinterpreting bits (16- to 64-bit ones are signed).
_SAME_WIDTH_INT = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}
# The widths whose unsigned patterns an int64 holds (tensor_bit_patterns and its inverse).
_PATTERN_WIDTHS = (8, 16, 32)


def format_of(dtype_or_name: torch.dtype | str | FloatFormat) -> FloatFormat:
    """The format for a torch dtype, a format name (e.g. ``"bfloat16"``), or a format."""
    if isinstance(dtype_or_name, FloatFormat):
        return dtype_or_name
    name = str(dtype_or_name).removeprefix("torch.")
    for fmt in ALL_FORMATS:
        if fmt.name == name:
            return fmt
    known = ", ".join(f.name for f in ALL_FORMATS)
    raise ValueError(f"unsupported format {dtype_or_name!r}; supported: {known}")


def _check_bits(fmt: FloatFormat, bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool):
        raise TypeError(f"bits must be an int, got {type(bits).__name__}")
    if not 0 <= bits < (1 << fmt.total_bits):
        raise ValueError(f"bits must be in [0, 2**{fmt.total_bits}) for {fmt.name}, got {bits}")


def is_nan_bits(fmt: FloatFormat, bits: int) -> bool:
    """True when ``bits`` encodes a NaN in ``fmt``."""
    magnitude = bits & ~fmt.sign_bit
    if fmt.nan_style == "ieee":
        field = magnitude >> fmt.mantissa_bits
        mantissa = magnitude & ((1 << fmt.mantissa_bits) - 1)
        return field == (1 << fmt.exponent_bits) - 1 and mantissa != 0
    if fmt.nan_style == "all_ones":
        return magnitude == (1 << (fmt.exponent_bits + fmt.mantissa_bits)) - 1
    return bits == 0xFF


def decode(fmt: FloatFormat, bits: int) -> Value:
    """The exact value encoded by ``bits`` in ``fmt``."""
    _check_bits(fmt, bits)
    if is_nan_bits(fmt, bits):
        return Special.NAN
    negative = bool(bits & fmt.sign_bit)
    magnitude = bits & ~fmt.sign_bit
    field = magnitude >> fmt.mantissa_bits
    mantissa = magnitude & ((1 << fmt.mantissa_bits) - 1)
    if fmt.has_inf and field == (1 << fmt.exponent_bits) - 1:
        return Special.NEG_INF if negative else Special.POS_INF
    if field == 0 and fmt.has_subnormals:
        value = times_pow2(mantissa, fmt.min_exponent - fmt.mantissa_bits)
    else:
        significand = (1 << fmt.mantissa_bits) | mantissa
        value = times_pow2(significand, field - fmt.bias - fmt.mantissa_bits)
    if value == 0:
        return Special.NEG_ZERO if negative else Fraction(0)
    return -value if negative else value


def times_pow2(integer: int, exponent: int) -> Fraction:
    """``integer * 2**exponent`` exactly (built from integers: the hot path of decoding)."""
    if exponent >= 0:
        return Fraction(integer << exponent)
    return Fraction(integer, 1 << -exponent)


def floor_log2(x: Fraction) -> int:
    """floor(log2(x)) for x > 0, exactly (shared by every refgrad module that needs it)."""
    numerator, denominator = x.numerator, x.denominator
    # By the bit lengths 2^(e-1) < x < 2^(e+1); x < 2^e is compared on integers.
    e = numerator.bit_length() - denominator.bit_length()
    if numerator << max(-e, 0) < denominator << max(e, 0):
        e -= 1
    return e


def _round_half_even(x: Fraction) -> int:
    """The integer nearest to x >= 0, ties to the even integer."""
    floor, remainder = divmod(x.numerator, x.denominator)  # x - floor = remainder / denominator
    if 2 * remainder > x.denominator or (2 * remainder == x.denominator and floor % 2 == 1):
        return floor + 1
    return floor


def _as_value(value: Value | int | float) -> Value:
    if isinstance(value, Special | Fraction):
        return value
    if isinstance(value, bool):
        raise TypeError("value must be a Fraction, int, float or Special, not bool")
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        # Python floats are binary64 dyadic rationals: Fraction(x) is exact.
        if value != value:
            return Special.NAN
        if value in (float("inf"), float("-inf")):
            return Special.POS_INF if value > 0 else Special.NEG_INF
        if value == 0.0 and math.copysign(1.0, value) < 0:
            return Special.NEG_ZERO
        return Fraction(value)
    raise TypeError(
        f"value must be a Fraction, int, float or Special, got {type(value).__name__}"
    )


def _overflow_bits(fmt: FloatFormat, negative: bool, policy: str) -> int:
    sign = fmt.sign_bit if negative else 0
    if policy == "inf":
        return sign | (((1 << fmt.exponent_bits) - 1) << fmt.mantissa_bits)
    if policy == "saturate":
        return sign | fmt.max_finite_bits
    return fmt.canonical_nan_bits


def round_to_bits(fmt: FloatFormat, value: Value | int | float, overflow: str | None = None) -> int:
    """Round an exact value to ``fmt``: nearest, ties to even; returns the bit pattern.

    ``overflow`` decides what a value whose rounded magnitude exceeds the largest
    finite value becomes: ``"inf"`` (±inf), ``"saturate"`` (±max finite) or
    ``"nan"``. ``None`` uses the format's documented default. For formats without
    infinities an infinite input follows the same policy; formats with
    infinities keep an infinite input infinite. NaN always gives the
    canonical NaN. float8_e8m0fnu has neither sign nor zero: a positive value
    below 2^-127 becomes 2^-127, and zero or a negative value is an error.
    """
    policy = fmt.default_overflow if overflow is None else overflow
    if policy not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    if policy == "inf" and not fmt.has_inf:
        raise ValueError(f"overflow='inf' is impossible for {fmt.name}, which has no infinity")
    value = _as_value(value)

    if value is Special.NAN:
        return fmt.canonical_nan_bits
    if value in (Special.POS_INF, Special.NEG_INF):
        negative = value is Special.NEG_INF
        if negative and not fmt.signed:
            raise ValueError(f"{fmt.name} is unsigned: cannot represent -inf")
        if fmt.has_inf:  # an exact infinity is representable: not an overflow
            return _overflow_bits(fmt, negative, "inf")
        return _overflow_bits(fmt, negative, policy)
    if value is Special.NEG_ZERO or value == 0:
        if not fmt.has_zero:
            raise ValueError(f"{fmt.name} has no zero")
        return fmt.sign_bit if value is Special.NEG_ZERO else 0

    negative = value < 0
    if negative and not fmt.signed:
        raise ValueError(f"{fmt.name} is unsigned: cannot represent {value}")
    magnitude = -value if negative else value
    sign = fmt.sign_bit if negative else 0

    # The quantum (weight of the last significand bit) at this magnitude; below the
    # normal range it stays at the subnormal quantum.
    exponent = max(floor_log2(magnitude), fmt.min_exponent)
    quantum_exp = exponent - fmt.mantissa_bits
    significand = _round_half_even(magnitude * times_pow2(1, -quantum_exp))  # THE rounding

    if significand == 0:
        if not fmt.has_zero:  # e8m0: nothing below 2^-127, so that is the nearest value
            return 0
        return sign
    rounded = times_pow2(significand, quantum_exp)
    if rounded > fmt.max_finite:
        return _overflow_bits(fmt, negative, policy)
    return sign | _encode_finite(fmt, rounded)


def _encode_finite(fmt: FloatFormat, magnitude: Fraction) -> int:
    """The unsigned bit pattern of an exactly representable positive magnitude."""
    exponent = floor_log2(magnitude)
    if exponent < fmt.min_exponent:  # subnormal
        mantissa = magnitude * times_pow2(1, fmt.mantissa_bits - fmt.min_exponent)
        assert mantissa.denominator == 1, "magnitude is not representable"
        return int(mantissa)
    scaled = magnitude * times_pow2(1, fmt.mantissa_bits - exponent)
    assert scaled.denominator == 1, "magnitude is not representable"
    mantissa = int(scaled) - (1 << fmt.mantissa_bits)
    field = exponent + fmt.bias
    return (field << fmt.mantissa_bits) | mantissa


def round_to_value(fmt: FloatFormat, value: Value | int | float, overflow: str | None = None) -> Value:
    """``value`` rounded to ``fmt`` (nearest, ties to even), as an exact value."""
    return decode(fmt, round_to_bits(fmt, value, overflow))


def _same_width_int(dtype: torch.dtype, name: str,
                    widths: tuple[int, ...] = _PATTERN_WIDTHS) -> tuple[int, torch.dtype]:
    width = torch.empty((), dtype=dtype).element_size() * 8
    if width not in widths:
        named = ", ".join(str(w) for w in widths)
        raise TypeError(f"{name} must have an element width in {{{named}}} bits, got {dtype}")
    return width, _SAME_WIDTH_INT[width]


def tensor_same_width_ints(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements reinterpreted (never cast) as integers of the same width, in place of
    its storage: uint8 for 8-bit dtypes, signed int16/int32/int64 above. Any 8- to 64-bit
    dtype (floats, integers, bool); two tensors' views are equal exactly when their bits are.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    _, int_view = _same_width_int(t.dtype, "t", tuple(_SAME_WIDTH_INT))
    return t.detach().contiguous().view(int_view)


def tensor_bit_patterns(t: torch.Tensor) -> torch.Tensor:
    """The unsigned bit patterns of ``t`` as an int64 tensor of the same shape and device.

    A reinterpretation, never a value cast; the one vectorised bits view every
    module shares (8-, 16- and 32-bit dtypes).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    width, _ = _same_width_int(t.dtype, "t")
    return tensor_same_width_ints(t).to(torch.int64) & ((1 << width) - 1)


def tensor_from_bit_patterns(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``dtype`` tensor whose elements have the unsigned patterns in the integer tensor ``bits``.

    The inverse of :func:`tensor_bit_patterns`: a reinterpretation, never a value cast.
    """
    width, int_view = _same_width_int(dtype, "dtype")
    if bits.dtype.is_floating_point or bits.dtype == torch.bool:
        raise TypeError(f"bits must be an integer tensor, got {bits.dtype}")
    bits = bits.to(torch.int64)
    # Signed views hold the top half of the patterns as negative integers.
    if width > 8:
        bits = torch.where(bits >= 1 << (width - 1), bits - (1 << width), bits)
    return bits.to(int_view).view(dtype)


def tensor_to_bits(t: torch.Tensor) -> list[int]:
    """The raw unsigned bit patterns of a tensor's elements, flattened in row-major order."""
    format_of(t.dtype)  # only the formats this module describes
    return tensor_bit_patterns(t.detach().cpu()).reshape(-1).tolist()


def bits_to_tensor(
    fmt: FloatFormat, bits: Sequence[int], shape: Sequence[int] | None = None
) -> torch.Tensor:
    """A ``fmt`` tensor whose elements have the given bit patterns (no value casts)."""
    bits = list(bits)
    for b in bits:
        _check_bits(fmt, b)
    out = tensor_from_bit_patterns(torch.tensor(bits, dtype=torch.int64), fmt.torch_dtype)
    return out.reshape(tuple(shape)) if shape is not None else out


def decode_tensor(t: torch.Tensor) -> list[Value]:
    """The exact values of a tensor's elements, flattened in row-major order."""
    fmt = format_of(t.dtype)
    return [decode(fmt, b) for b in tensor_to_bits(t)]


def round_values_to_tensor(
    fmt: FloatFormat,
    values: Iterable[Value | int | float],
    shape: Sequence[int] | None = None,
    overflow: str | None = None,
) -> torch.Tensor:
    """Round each exact value to ``fmt`` and pack the results into a tensor."""
    return bits_to_tensor(fmt, [round_to_bits(fmt, v, overflow) for v in values], shape)


def gamma(n: int, unit_roundoff: Fraction) -> Fraction:
    """Higham's ``gamma(n) = n u / (1 - n u)``, exactly (Accuracy and Stability, Lemma 3.1).

    The relative error bound of ``n`` successive roundings each of relative error at most
    ``u`` (``unit_roundoff``: a format's :attr:`FloatFormat.unit_roundoff`, or the
    per-step error of a composed rounding). ValueError when ``n < 0`` or ``n u >= 1``,
    where the bound does not exist.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    nu = n * Fraction(unit_roundoff)
    if nu >= 1:
        raise ValueError(f"gamma({n}) is undefined for unit roundoff {unit_roundoff}: n*u >= 1")
    return nu / (1 - nu)


def value_to_fraction(value: Value) -> Fraction:
    """The rational value of a finite Value (-0 is 0); a ValueError for NaN/inf."""
    if value is Special.NEG_ZERO:
        return Fraction(0)
    if isinstance(value, Special):
        raise ValueError(f"{value.value} has no rational value")
    return value

"""MXFP8 (OCP Microscaling v1.0, E4M3 elements) quantization, exactly as specified.

A tensor is cut into blocks of ``block_size`` consecutive values along its last
dimension. Each block shares one E8M0 scale ``2^e`` (bias 127, 0xFF = NaN) and
stores its values as E4M3 elements ``x / 2^e``.

The rules, per block (every step is exact rational arithmetic; the only
rounding is the RNE conversion of an element through ``refgrad.formats``):

1. ``amax`` = the largest magnitude in the block (-0 counts as 0).
2. Non-finite block: if any value is NaN or ±inf, the scale is 0xFF (NaN) and
   every element is 0x7F (the canonical E4M3 NaN); the block carries no value.
3. All-zero block (``amax == 0``): the scale is 0x00 (``e = -127``, the
   clamp of ``log2(0) = -inf``); each element is a signed zero, the sign of
   its input (so -0 stays 0x80).
4. Otherwise, with ``E = floor(log2 amax)`` (exact, also for subnormal
   inputs) the unbiased exponent ``e`` is

   - ``"floor"`` (OCP spec, torchao default): ``E - 8``; a block whose amax
     mantissa exceeds 1.75 saturates its largest elements to ±448;
   - ``"ceil"``: ``ceil(log2 amax) - 8``, i.e. ``E - 8 + [amax != 2^E]``;
   - ``"even"``: ``floor(log2 r) - 8`` where ``r`` is amax rounded to E4M3's
     4 significant bits, ties away from zero (torchao's "add half an ulp,
     mask"). Ties-to-even would give the same ``e``: the only tie that can
     carry into the next power of two is 1.9375, between 1.875 (odd) and 2;
   - ``"rceil"`` (Transformer Engine / cuBLAS): ``ceil(log2(amax / 448))``,
     the smallest ``e`` with ``amax <= 448 * 2^e``, on the exact quotient
     (TE divides in fp32; see ``fastgrad.mxfp8`` for where that can differ).

   then ``e`` is clamped to ``[-127, 127]`` (the E8M0 range; torchao allows
   128 for FLOOR/CEIL/EVEN, which would encode NaN).
5. Elements: ``round_to_bits(FLOAT8_E4M3FN, x / 2^e, overflow="saturate")``:
   round to nearest even, saturating to ±448; signs are kept, including the
   sign of a value that rounds to zero.

``dequantize`` multiplies each decoded element by its block's scale exactly and
rounds once to the output dtype (overflow to ±inf, as IEEE; only possible for
``ceil`` blocks whose amax is within a few ulps of float32's maximum).
"""

from __future__ import annotations

from fractions import Fraction

import torch

from refgrad.formats import (
    FLOAT8_E4M3FN,
    FLOAT8_E8M0FNU,
    Special,
    Value,
    decode,
    decode_tensor,
    floor_log2,
    format_of,
    round_to_bits,
    round_values_to_tensor,
)

SCALE_MODES: tuple[str, ...] = ("floor", "ceil", "even", "rceil")
INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
OUTPUT_DTYPES: tuple[torch.dtype, ...] = INPUT_DTYPES

E4M3_MAX = Fraction(448)
E4M3_EMAX = 8  # floor(log2(448))
E4M3_SIGNIFICANT_BITS = 4  # 1 implicit + 3 stored
E8M0_BIAS = 127
E8M0_MIN_EXPONENT = -127
E8M0_MAX_EXPONENT = 127
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F
NONFINITE = (Special.NAN, Special.POS_INF, Special.NEG_INF)


def validate_quantize_args(x: torch.Tensor, scale_mode: str, block_size: int) -> None:
    """Raise TypeError/ValueError naming the parameter and the rule it breaks."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x must have dtype in {INPUT_DTYPES}, got {x.dtype}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (blocks run along the last one)")
    if x.shape[-1] % block_size != 0:
        raise ValueError(
            f"the last dimension of x ({x.shape[-1]}) must be divisible by "
            f"block_size ({block_size})"
        )


def ceil_log2(value: Fraction) -> int:
    """``ceil(log2(value))`` for ``value > 0``, exactly."""
    exponent = floor_log2(value)
    return exponent if Fraction(2) ** exponent == value else exponent + 1


def round_to_significant_bits_half_up(value: Fraction, bits: int) -> Fraction:
    """``value > 0`` rounded to ``bits`` significant bits, ties away from zero."""
    quantum = Fraction(2) ** (floor_log2(value) - (bits - 1))
    scaled = value / quantum + Fraction(1, 2)
    return Fraction(scaled.numerator // scaled.denominator) * quantum


def unclamped_scale_exponent(amax: Fraction, scale_mode: str) -> int:
    """The unbiased scale exponent ``e`` of a block with finite ``amax > 0``, before clamping."""
    if amax <= 0:
        raise ValueError(f"amax must be > 0, got {amax}")
    if scale_mode == "floor":
        return floor_log2(amax) - E4M3_EMAX
    if scale_mode == "ceil":
        return ceil_log2(amax) - E4M3_EMAX
    if scale_mode == "even":
        rounded = round_to_significant_bits_half_up(amax, E4M3_SIGNIFICANT_BITS)
        return floor_log2(rounded) - E4M3_EMAX
    if scale_mode == "rceil":
        return ceil_log2(amax / E4M3_MAX)
    raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")


def scale_exponent(amax: Fraction, scale_mode: str) -> int:
    """The clamped unbiased exponent of a finite block (``amax == 0`` gives -127)."""
    if amax == 0:
        return E8M0_MIN_EXPONENT
    exponent = unclamped_scale_exponent(amax, scale_mode)
    return min(max(exponent, E8M0_MIN_EXPONENT), E8M0_MAX_EXPONENT)


def quantize_block(values: list[Value], scale_mode: str) -> tuple[int, list[int]]:
    """One block of exact values -> (E8M0 scale bits, E4M3 element bits)."""
    if any(v in NONFINITE for v in values):
        return E8M0_NAN, [E4M3_NAN] * len(values)
    amax = max(abs(v) if isinstance(v, Fraction) else Fraction(0) for v in values)
    exponent = scale_exponent(amax, scale_mode)
    scale_bits = exponent + E8M0_BIAS
    scale = Fraction(2) ** exponent
    assert decode(FLOAT8_E8M0FNU, scale_bits) == scale
    elements = []
    for v in values:
        scaled = Special.NEG_ZERO if v is Special.NEG_ZERO else v / scale
        elements.append(round_to_bits(FLOAT8_E4M3FN, scaled, overflow="saturate"))
    return scale_bits, elements


def quantize(
    x: torch.Tensor, *, scale_mode: str = "floor", block_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize ``x`` along its last dimension.

    Returns ``(scale_bits, element_bits)``: uint8 tensors of shapes
    ``(*x.shape[:-1], x.shape[-1] // block_size)`` and ``x.shape``.
    """
    validate_quantize_args(x, scale_mode, block_size)
    values = decode_tensor(x)
    scales: list[int] = []
    elements: list[int] = []
    for start in range(0, len(values), block_size):
        scale_bits, element_bits = quantize_block(values[start : start + block_size], scale_mode)
        scales.append(scale_bits)
        elements.extend(element_bits)
    scale_shape = (*x.shape[:-1], x.shape[-1] // block_size)
    return (
        torch.tensor(scales, dtype=torch.uint8).reshape(scale_shape),
        torch.tensor(elements, dtype=torch.uint8).reshape(x.shape),
    )


def validate_dequantize_args(
    scale_bits: torch.Tensor, element_bits: torch.Tensor, block_size: int, dtype: torch.dtype
) -> None:
    """Raise TypeError/ValueError naming the parameter and the rule it breaks."""
    for name, t in (("scale_bits", scale_bits), ("element_bits", element_bits)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise TypeError(f"{name} must be a uint8 tensor of bit patterns, got {t.dtype}")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if dtype not in OUTPUT_DTYPES:
        raise TypeError(f"dtype must be one of {OUTPUT_DTYPES}, got {dtype}")
    if element_bits.dim() == 0:
        raise ValueError("element_bits must have at least one dimension")
    expected = (*element_bits.shape[:-1], element_bits.shape[-1] // block_size)
    if element_bits.shape[-1] % block_size != 0 or tuple(scale_bits.shape) != expected:
        raise ValueError(
            f"scale_bits has shape {tuple(scale_bits.shape)} but element_bits of shape "
            f"{tuple(element_bits.shape)} with block_size={block_size} needs scales of "
            f"shape {expected} (and a last dimension divisible by block_size)"
        )


def dequantize(
    scale_bits: torch.Tensor,
    element_bits: torch.Tensor,
    *,
    block_size: int = 32,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The exact value ``element * 2^e`` of every element, rounded once to ``dtype``.

    A NaN scale (0xFF) or a NaN element (0x7F/0xFF) gives NaN.
    """
    validate_dequantize_args(scale_bits, element_bits, block_size, dtype)
    scales = [decode(FLOAT8_E8M0FNU, int(b)) for b in scale_bits.reshape(-1).tolist()]
    values: list[Value] = []
    for index, bits in enumerate(element_bits.reshape(-1).tolist()):
        element = decode(FLOAT8_E4M3FN, int(bits))
        scale = scales[index // block_size]
        if scale is Special.NAN or element is Special.NAN:
            values.append(Special.NAN)
        elif element is Special.NEG_ZERO:
            values.append(Special.NEG_ZERO)
        else:
            values.append(element * scale)
    return round_values_to_tensor(format_of(dtype), values, element_bits.shape, overflow="inf")

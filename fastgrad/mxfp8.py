"""Vectorised MXFP8 quantization (E8M0 block scales, E4M3 elements), bitwise equal to refgrad.

The rules are those of ``refgrad.mxfp8`` (the spec). Everything is integer work
on the float32 bit pattern, so no step depends on how torch rounds a float8
cast:

* amax is the integer max of the magnitude bits: for non-negative floats the
  bit patterns order like the values, and NaN/inf patterns sort above every
  finite one, so ``amax_bits >= 0x7F800000`` detects a non-finite block;
* the scale exponent reads the exponent field (and for ``ceil``/``rceil``/
  ``even`` one comparison on the fraction field) of amax;
* elements are ``x / 2^e`` rounded to nearest-even E4M3. In E4M3's normal
  range that is the float32 fraction rounded to 3 bits in place plus a
  rebiased exponent field; E4M3 subnormals, zeros and float32 subnormals go
  through the general formula ``(quantum_exponent + 9) * 8 + RNE(significand
  >> shift)``, which covers every case including the carry into the next
  binade. Both saturate at 0x7E (448).

Why not torch's casts: ``Tensor.to(torch.float8_e8m0fnu)`` rounds in linear
space with ties up (none of the four modes), and ``x.to(float8_e4m3fn)`` only
matches when ``x / 2^e`` is computed exactly first; the conformance table of
``verify run --check mxfp8`` shows both as peers.

On CUDA with Triton installed, the general formula runs fused in
``fastgrad.kernels.mxfp8`` (imported lazily).
"""

from __future__ import annotations

import math

import torch

# The argument contract (modes, dtypes, shapes) is the spec's; one copy of it, in
# refgrad, so the two implementations cannot drift apart on what they accept.
from refgrad.mxfp8 import (
    SCALE_MODES,
    validate_dequantize_args,
    validate_quantize_args,
)

_FP32_EXPONENT_MASK = 0x7F800000
_FP32_FRACTION_MASK = 0x007FFFFF
_FP32_MAGNITUDE_MASK = 0x7FFFFFFF
_FP32_IMPLICIT_BIT = 0x00800000
_FP32_BIAS = 127
_E4M3_EMAX = 8
_E4M3_MIN_QUANTUM_EXPONENT = -9  # subnormal spacing 2^-9
_E4M3_MAX_CODE = 0x7E  # 448; 0x7F is NaN
_E4M3_NAN = 0x7F
_E8M0_BIAS = 127
_E8M0_NAN = 0xFF
_SCALE_MIN, _SCALE_MAX = -127, 127
_FRACTION_OF_1_75 = 0x600000  # fraction field of a float32 with mantissa 1.75
_HALF_ULP_AT_3_BITS = 1 << 19  # half an E4M3 ulp, in float32 fraction units
_MAX_USEFUL_SHIFT = 25  # a 24-bit significand shifted by >= 25 rounds to 0


def _floor_log2_fraction_field(fraction: torch.Tensor) -> torch.Tensor:
    """floor(log2(f)) of a positive int32 < 2^23, read from its exact float32 conversion."""
    as_float_bits = fraction.to(torch.float32).view(torch.int32)
    return (as_float_bits >> 23) - _FP32_BIAS


def scale_exponents_from_amax_bits(amax_bits: torch.Tensor, scale_mode: str) -> torch.Tensor:
    """Clamped unbiased scale exponents (int32) from float32 amax bit patterns.

    Finite, non-negative ``amax_bits`` only; non-finite blocks are masked by the caller.
    """
    exponent_field = amax_bits >> 23
    fraction = amax_bits & _FP32_FRACTION_MASK
    floor_log2 = exponent_field - _FP32_BIAS
    if scale_mode == "floor":
        exponent = floor_log2 - _E4M3_EMAX
    elif scale_mode == "ceil":
        exponent = floor_log2 - _E4M3_EMAX + (fraction != 0).to(torch.int32)
    elif scale_mode == "even":
        # Rounding the mantissa to 3 bits only moves the exponent when it carries.
        exponent = ((amax_bits + _HALF_ULP_AT_3_BITS) >> 23) - _FP32_BIAS - _E4M3_EMAX
    elif scale_mode == "rceil":
        # amax <= 448 * 2^(E-8) = 1.75 * 2^E unless the mantissa exceeds 1.75.
        exponent = floor_log2 - _E4M3_EMAX + (fraction > _FRACTION_OF_1_75).to(torch.int32)
    else:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    # A zero or subnormal amax (< 2^-126) gives e <= -126 - 8 in every mode: the clamp.
    exponent = torch.where(exponent_field == 0, _SCALE_MIN, exponent)
    return exponent.clamp(_SCALE_MIN, _SCALE_MAX)


def e4m3_magnitude_codes_general(magnitude: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """Unsigned E4M3 codes (int32) of ``|x| / 2^exponent``, any magnitude; the reference formula.

    ``magnitude`` holds float32 bit patterns without the sign (finite). Round to
    nearest even on the 24-bit significand; the code ``(quantum_exponent + 9) * 8
    + significand`` covers E4M3 subnormals, normals and the carry into the next
    binade; saturate at 0x7E (448). The Triton kernel uses this same formula.
    """
    exponent_field = magnitude >> 23
    fraction = magnitude & _FP32_FRACTION_MASK
    is_subnormal = exponent_field == 0
    # |x| = significand * 2^lsb_exponent exactly.
    significand = torch.where(is_subnormal, fraction, fraction | _FP32_IMPLICIT_BIT)
    lsb_exponent = torch.where(is_subnormal, -149, exponent_field - 150)
    safe_fraction = torch.where(fraction == 0, 1, fraction)
    floor_log2 = torch.where(
        is_subnormal, -149 + _floor_log2_fraction_field(safe_fraction), exponent_field - 127
    )
    # The E4M3 quantum at the magnitude of x / 2^e: 3 bits below the leading one,
    # never finer than the subnormal spacing.
    quantum_exponent = torch.clamp(floor_log2 - exponent - 3, min=_E4M3_MIN_QUANTUM_EXPONENT)
    shift = (quantum_exponent - (lsb_exponent - exponent)).clamp(max=_MAX_USEFUL_SHIFT)
    kept = significand >> shift
    remainder = significand - (kept << shift)
    half = torch.ones_like(shift) << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((kept & 1) == 1))
    code = (quantum_exponent - _E4M3_MIN_QUANTUM_EXPONENT) * 8 + kept + round_up.to(torch.int32)
    return torch.where(magnitude == 0, 0, code.clamp(max=_E4M3_MAX_CODE))


def round_scaled_to_e4m3(
    bits: torch.Tensor, exponent: torch.Tensor, magnitude: torch.Tensor | None = None
) -> torch.Tensor:
    """E4M3 codes (int32, sign included) of ``x / 2^exponent`` for float32 bit patterns ``bits``.

    Round to nearest even, saturating to ±448; the sign is kept, also for zeros.
    ``exponent`` (one per row) broadcasts against ``bits``. Non-finite inputs are
    the caller's job. ``magnitude`` (``bits`` without the sign) may be passed in
    when the caller already has it.

    Fast path, for results in E4M3's normal range (``|x| / 2^e >= 2^-6``): round
    the float32 fraction to 3 bits in place (RNE: add 0x7FFFF plus the kept lsb,
    shift by 20; a carry lands in the exponent field as it should) and rebias the
    exponent field from ``127 + e`` to 7. The rest (E4M3 subnormals, zeros,
    float32 subnormals: rare in real tensors) goes through
    :func:`e4m3_magnitude_codes_general` on the gathered subset.
    """
    if magnitude is None:
        magnitude = bits & _FP32_MAGNITUDE_MASK
    kept_lsb = (magnitude >> 20).bitwise_and_(1)
    rounded = (magnitude + 0x7FFFF).add_(kept_lsb).bitwise_right_shift_(20)
    code = rounded.sub_((exponent + (_FP32_BIAS - 7)) * 8).clamp_(max=_E4M3_MAX_CODE)
    # Below 2^-6 * 2^e, or a float32 zero/subnormal (exponent field 0, which the
    # rebiasing above cannot read): per-row threshold on the exponent field.
    small = (magnitude >> 23) < (exponent + (_FP32_BIAS - 6)).clamp(min=1)
    if bool(small.any()):
        index = small.nonzero(as_tuple=True)
        code[index] = e4m3_magnitude_codes_general(
            magnitude[index], exponent.expand_as(magnitude)[index]
        )
    sign = (bits >> 24).bitwise_and_(0x80)  # arithmetic shift: bit 31 lands on bit 7
    return code.bitwise_or_(sign)


QuantizedPair = tuple[torch.Tensor, torch.Tensor]


def validate_quantize_out(x: torch.Tensor, block_size: int, out: QuantizedPair | None) -> None:
    """``out`` must be None or ``(scale_bits, element_bits)``: contiguous uint8 on ``x``'s device."""
    if out is None:
        return
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError("out must be a (scale_bits, element_bits) tuple of tensors")
    scale_shape = (*x.shape[:-1], x.shape[-1] // block_size)
    for name, tensor, shape in (
        ("out[0] (scale_bits)", out[0], scale_shape),
        ("out[1] (element_bits)", out[1], tuple(x.shape)),
    ):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.uint8 or tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"{name} must be uint8 with shape {tuple(shape)}, got {tensor.dtype} "
                f"{tuple(tensor.shape)}"
            )
        if tensor.device != x.device or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {x.device}")


def quantize_torch(
    x: torch.Tensor,
    *,
    scale_mode: str = "floor",
    block_size: int = 32,
    out: QuantizedPair | None = None,
) -> QuantizedPair:
    """The vectorised torch path of :func:`quantize` (any device)."""
    validate_quantize_args(x, scale_mode, block_size)
    validate_quantize_out(x, block_size, out)
    bits = x.detach().to(torch.float32).contiguous().view(torch.int32)
    blocks = bits.reshape(-1, block_size)
    magnitude = blocks & _FP32_MAGNITUDE_MASK
    amax_bits = magnitude.amax(dim=1, keepdim=True)
    nonfinite = amax_bits >= _FP32_EXPONENT_MASK
    exponent = scale_exponents_from_amax_bits(torch.where(nonfinite, 0, amax_bits), scale_mode)
    # A non-finite block is all NaN codes; zero its bits first so no inf/NaN pattern
    # reaches the rounding (the codes are overwritten below).
    any_nonfinite = bool(nonfinite.any())
    if any_nonfinite:
        blocks = torch.where(nonfinite, 0, blocks)
        magnitude = torch.where(nonfinite, 0, magnitude)
    codes = round_scaled_to_e4m3(blocks, exponent, magnitude)
    if any_nonfinite:
        codes = torch.where(nonfinite, _E4M3_NAN, codes)
    scales = torch.where(nonfinite, _E8M0_NAN, exponent + _E8M0_BIAS)
    scale_shape = (*x.shape[:-1], x.shape[-1] // block_size)
    if out is not None:
        # copy_ casts int32 -> uint8 like .to(torch.uint8): no uint8 temporaries.
        out[0].copy_(scales.reshape(scale_shape))
        out[1].copy_(codes.reshape(x.shape))
        return out
    return (
        scales.to(torch.uint8).reshape(scale_shape),
        codes.to(torch.uint8).reshape(x.shape),
    )


def triton_usable(x: torch.Tensor, block_size: int) -> bool:
    """True when ``x`` lives on CUDA, Triton can be imported (checked lazily) and
    ``block_size`` is a power of two (the kernel's ``tl.arange`` needs one)."""
    from fastgrad.kernels import triton_available

    return x.is_cuda and block_size & (block_size - 1) == 0 and triton_available()


def quantize(
    x: torch.Tensor,
    *,
    scale_mode: str = "floor",
    block_size: int = 32,
    out: QuantizedPair | None = None,
) -> QuantizedPair:
    """MXFP8-quantize ``x`` along its last dimension; bitwise equal to ``refgrad.mxfp8.quantize``.

    Returns ``(scale_bits, element_bits)`` as uint8 tensors on ``x``'s device;
    with ``out=(scale_bits, element_bits)`` (contiguous uint8 of those shapes)
    the codes are written straight into them, and ``out`` is returned.
    Uses the Triton kernel on CUDA when Triton is installed.
    """
    validate_quantize_args(x, scale_mode, block_size)
    validate_quantize_out(x, block_size, out)
    if triton_usable(x, block_size):
        from fastgrad.kernels.mxfp8 import quantize_triton

        return quantize_triton(x, scale_mode=scale_mode, block_size=block_size, out=out)
    return quantize_torch(x, scale_mode=scale_mode, block_size=block_size, out=out)


def e4m3_code_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32 value of each of the 256 E4M3 codes, built from the bit layout (no casts)."""
    codes = torch.arange(256, dtype=torch.int32, device=device)
    exponent_field = (codes >> 3) & 0xF
    mantissa = (codes & 7).to(torch.float32)
    # 2^(field - 10) as a float32 bit pattern: the E4M3 quantum of that binade.
    quantum = ((torch.clamp(exponent_field, min=1) - 10 + _FP32_BIAS) << 23).view(torch.float32)
    magnitude = torch.where(exponent_field == 0, mantissa, mantissa + 8) * quantum
    magnitude = torch.where((codes & 0x7F) == _E4M3_NAN, float("nan"), magnitude)
    return torch.where(codes >= 128, -magnitude, magnitude)


def e8m0_scale_values(scale_bits: torch.Tensor) -> torch.Tensor:
    """float32 ``2^(s-127)`` for each E8M0 code ``s`` (0x00 is the subnormal 2^-127; 0xFF NaN)."""
    codes = scale_bits.to(torch.int32)
    normal = (codes << 23).view(torch.float32)
    smallest = torch.tensor(0x00400000, dtype=torch.int32, device=codes.device).view(
        torch.float32
    )
    values = torch.where(codes == 0, smallest, normal)
    return torch.where(codes == _E8M0_NAN, float("nan"), values)


def dequantize(
    scale_bits: torch.Tensor,
    element_bits: torch.Tensor,
    *,
    block_size: int = 32,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``element * 2^e`` per element, rounded once to ``dtype``; bitwise equal to refgrad.

    The float32 product is exact (4 significant bits times a power of two, never
    below 2^-136) except for overflow to inf, so the cast to bf16/fp16 is the only
    rounding. NaNs come out as the canonical quiet NaN (torch 2.13's CPU
    float32->bfloat16 cast turns NaN into 0xFFFF, so it is re-written).
    """
    validate_dequantize_args(scale_bits, element_bits, block_size, dtype)
    table = e4m3_code_values(element_bits.device)
    elements = table[element_bits.reshape(-1, block_size).to(torch.int64)]
    scales = e8m0_scale_values(scale_bits.reshape(-1, 1))
    values = (elements * scales).reshape(element_bits.shape).to(dtype)
    return torch.where(torch.isnan(values), _canonical_nan(dtype, values.device), values)


def _canonical_nan(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The positive quiet NaN with an all-zero payload, built from its bit pattern."""
    if dtype == torch.float32:
        return torch.tensor(0x7FC00000, dtype=torch.int32, device=device).view(dtype)
    pattern = 0x7FC0 if dtype == torch.bfloat16 else 0x7E00
    return torch.tensor(pattern, dtype=torch.int16, device=device).view(dtype)


PARAM_DTYPE = torch.bfloat16  # dtype of all-gathered (and non-quantized) MXFP8-model params


class MXFP8Parameter:
    """A weight held as MXFP8 bits in its own storage (E8M0 scales + E4M3 elements).

    ``copy_from(values)`` quantizes ``values`` straight into that storage;
    ``dequantize()`` gives the values the forward pass computes with.
    ``main_grad`` is set by the ``fastgrad.buffer.ParamAndGradBuffer`` holding it.
    """

    def __init__(
        self, value: torch.Tensor, *, scale_mode: str = "floor", block_size: int = 32
    ) -> None:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError("value must be a floating-point torch.Tensor")
        scale_bits, element_bits = quantize(
            value.detach().to(PARAM_DTYPE), scale_mode=scale_mode, block_size=block_size
        )
        self.shape = tuple(value.shape)
        self.scale_mode = scale_mode
        self.block_size = block_size
        self.scale_bits = scale_bits
        self.element_bits = element_bits
        self.main_grad: torch.Tensor | None = None

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.element_bits.device

    def copy_from(self, values: torch.Tensor) -> None:
        """Quantize ``values`` (any float dtype, ``numel`` elements) into this parameter, in place."""
        if values.numel() != self.numel():
            raise ValueError(f"values has {values.numel()} elements, the parameter {self.numel()}")
        quantize(
            values.reshape(self.shape),
            scale_mode=self.scale_mode,
            block_size=self.block_size,
            out=(self.scale_bits, self.element_bits),
        )

    def dequantize(self, dtype: torch.dtype = PARAM_DTYPE) -> torch.Tensor:
        """The parameter's values (exact in bf16 and fp32 for the scales quantize produces)."""
        return dequantize(self.scale_bits, self.element_bits, block_size=self.block_size, dtype=dtype)

    def __repr__(self) -> str:
        return f"MXFP8Parameter(shape={self.shape}, scale_mode={self.scale_mode!r})"

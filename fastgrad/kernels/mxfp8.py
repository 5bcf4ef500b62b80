"""Triton MXFP8 quantization kernel: the integer arithmetic of ``fastgrad.mxfp8``, fused.

One program quantizes ``BLOCKS_PER_PROGRAM`` blocks of ``BLOCK_SIZE`` values:
load, amax of the magnitude bits, scale exponent, E4M3 codes, two stores.
Every step is integer work on the float32 bit pattern: float32 and bfloat16
inputs are loaded as raw bits (bf16 bits are the top half of the float32
pattern), float16 through one exact widening cast, and the only other float
operation converts an integer below 2^23 to float32 (exact). So the result does not depend on the
GPU's float rounding or denormal-flushing modes and is bitwise equal to
``refgrad.mxfp8.quantize``.

Import this module only when Triton is installed; ``fastgrad.mxfp8.quantize``
does so lazily, on CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The argument contract lives in refgrad (the spec); importing it from there,
# not from fastgrad.mxfp8, keeps this module out of an import cycle with it.
from refgrad.mxfp8 import validate_quantize_args

SCALE_MODE_CODES = {"floor": 0, "ceil": 1, "even": 2, "rceil": 3}
DEFAULT_BLOCKS_PER_PROGRAM = 64


@triton.jit
def _mxfp8_quantize_kernel(
    x_ptr,
    scale_ptr,
    element_ptr,
    n_blocks,
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    SOURCE_KIND: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    cols = tl.arange(0, BLOCK_SIZE)
    row_ok = rows < n_blocks
    offsets = rows.to(tl.int64)[:, None] * BLOCK_SIZE + cols[None, :]
    mask = row_ok[:, None]
    if SOURCE_KIND == 0:  # float32, passed as its int32 bit pattern
        bits = tl.load(x_ptr + offsets, mask=mask, other=0)
    elif SOURCE_KIND == 1:  # bfloat16 bits (int16): the top half of the float32 pattern
        bits = tl.load(x_ptr + offsets, mask=mask, other=0).to(tl.int32) << 16
    else:  # float16: an exact widening cast (fp16 subnormals are fp32 normals)
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF

    # ---- scale: integer max of magnitude bits orders like the values; NaN/inf sort on top.
    amax = tl.max(magnitude, axis=1)
    nonfinite = amax >= 0x7F800000
    amax = tl.where(nonfinite, 0, amax)
    amax_field = amax >> 23
    amax_fraction = amax & 0x7FFFFF
    if SCALE_MODE == 0:
        exponent = amax_field - 127 - 8
    elif SCALE_MODE == 1:
        exponent = amax_field - 127 - 8 + (amax_fraction != 0).to(tl.int32)
    elif SCALE_MODE == 2:
        exponent = ((amax + (1 << 19)) >> 23) - 127 - 8
    else:
        exponent = amax_field - 127 - 8 + (amax_fraction > 0x600000).to(tl.int32)
    exponent = tl.where(amax_field == 0, -127, exponent)
    exponent = tl.minimum(tl.maximum(exponent, -127), 127)
    scale_code = tl.where(nonfinite, 255, exponent + 127)
    tl.store(scale_ptr + rows, scale_code.to(tl.uint8), mask=row_ok)

    # ---- elements: RNE of x / 2^e on the 24-bit significand, E4M3 code in one formula.
    e = exponent[:, None]
    field = magnitude >> 23
    fraction = magnitude & 0x7FFFFF
    is_subnormal = field == 0
    significand = tl.where(is_subnormal, fraction, fraction | 0x800000)
    lsb_exponent = tl.where(is_subnormal, -149, field - 150)
    safe_fraction = tl.where(fraction == 0, 1, fraction)
    fraction_log2 = (safe_fraction.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    floor_log2 = tl.where(is_subnormal, -149 + fraction_log2, field - 127)
    quantum_exponent = tl.maximum(floor_log2 - e - 3, -9)
    shift = tl.minimum(quantum_exponent - (lsb_exponent - e), 25)
    kept = significand >> shift
    remainder = significand - (kept << shift)
    half = tl.full(shift.shape, 1, tl.int32) << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((kept & 1) == 1))
    code = (quantum_exponent + 9) * 8 + kept + round_up.to(tl.int32)
    code = tl.where(magnitude == 0, 0, tl.minimum(code, 0x7E))
    code = code | ((bits < 0).to(tl.int32) << 7)
    code = tl.where(nonfinite[:, None], 0x7F, code)
    tl.store(element_ptr + offsets, code.to(tl.uint8), mask=mask)


def quantize_triton(
    x: torch.Tensor,
    *,
    scale_mode: str = "floor",
    block_size: int = 32,
    blocks_per_program: int = DEFAULT_BLOCKS_PER_PROGRAM,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize ``x`` with the Triton kernel; same contract as ``fastgrad.mxfp8.quantize``.

    ``block_size`` and ``blocks_per_program`` must be powers of two (``tl.arange``).
    ``out=(scale_bits, element_bits)``: contiguous uint8 tensors the kernel writes
    into (validated by ``fastgrad.mxfp8.quantize``, the public entry point).
    """
    validate_quantize_args(x, scale_mode, block_size)
    for name, value in (("block_size", block_size), ("blocks_per_program", blocks_per_program)):
        # 0 & -1 == 0, so the power-of-two test alone would let 0 through.
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two for the Triton kernel, got {value}")
    source = x.detach().contiguous()
    if source.dtype == torch.float32:
        kernel_source, source_kind = source.view(torch.int32), 0
    elif source.dtype == torch.bfloat16:
        kernel_source, source_kind = source.view(torch.int16), 1
    else:
        kernel_source, source_kind = source, 2
    n_blocks = source.numel() // block_size
    if out is None:
        scales = torch.empty(n_blocks, dtype=torch.uint8, device=x.device)
        elements = torch.empty(source.shape, dtype=torch.uint8, device=x.device)
    else:
        scales, elements = out[0].view(-1), out[1]
    if n_blocks:
        grid = (triton.cdiv(n_blocks, blocks_per_program),)
        _mxfp8_quantize_kernel[grid](
            kernel_source,
            scales,
            elements,
            n_blocks,
            BLOCK_SIZE=block_size,
            BLOCKS_PER_PROGRAM=blocks_per_program,
            SCALE_MODE=SCALE_MODE_CODES[scale_mode],
            SOURCE_KIND=source_kind,
        )
    if out is not None:
        return out
    return scales.reshape(*x.shape[:-1], x.shape[-1] // block_size), elements

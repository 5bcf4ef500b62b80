"""refgrad.mxfp8: hand-derived blocks for every scale mode, the special-block rules and errors.

E4M3 codes used below (sign | 4-bit exponent field | 3-bit mantissa, bias 7):
  448 = 1.75*2^8 -> 0x7E; 256 = 2^8 -> 0x78; 240 = 1.875*2^7 -> 0x77;
  224 = 1.75*2^7 -> 0x76; 1 -> 0x38; 0.5 -> 0x30; 4 -> 0x48; 2^-3 -> 0x20;
  subnormal k*2^-9 -> k. E8M0: 2^e -> e + 127.
"""

from __future__ import annotations

import math

import pytest
import torch

from refgrad import mxfp8
from verify.metrics import assert_bitwise_equal


def block(*values: float, dtype: torch.dtype = torch.float32, size: int = 32) -> torch.Tensor:
    """One block: ``values`` then zeros."""
    padded = list(values) + [0.0] * (size - len(values))
    return torch.tensor([padded], dtype=torch.float64).to(dtype)


def quantize_one(x: torch.Tensor, mode: str, block_size: int = 32) -> tuple[int, list[int]]:
    scales, elements = mxfp8.quantize(x, scale_mode=mode, block_size=block_size)
    return int(scales.reshape(-1)[0]), elements.reshape(-1).tolist()


# (values, {mode: (scale code, first element codes)})
HAND_CASES = [
    # amax 448 = 1.75*2^8: floor/even/rceil e=0; ceil e=1 (448 is not a power of two).
    (
        (448.0, 1.0),
        {
            "floor": (127, [0x7E, 0x38]),
            "even": (127, [0x7E, 0x38]),
            "rceil": (127, [0x7E, 0x38]),
            "ceil": (128, [0x76, 0x30]),
        },
    ),
    # amax 480 = 1.875*2^8: floor/even keep e=0 and saturate 480 -> 448;
    # ceil e=1; rceil: ceil(log2(480/448)) = 1. 480/2 = 240 -> 0x77.
    (
        (480.0, -1.0),
        {
            "floor": (127, [0x7E, 0xB8]),
            "even": (127, [0x7E, 0xB8]),
            "ceil": (128, [0x77, 0xB0]),
            "rceil": (128, [0x77, 0xB0]),
        },
    ),
    # amax 1.9375: floor e=-8 (1.9375*256 = 496 saturates); even rounds the mantissa
    # to 2.0 (a tie, up) -> e=-7, so does ceil; rceil: ceil(log2(1.9375/448)) = -7.
    # 1.9375*128 = 248 ties between 240 (odd mantissa) and 256 (even) -> 256 = 0x78.
    (
        (1.9375,),
        {
            "floor": (119, [0x7E]),
            "even": (120, [0x78]),
            "ceil": (120, [0x78]),
            "rceil": (120, [0x78]),
        },
    ),
    # amax 1.0, a power of two: every mode gives e=-8 (rceil: ceil(-8.807) = -8).
    # 0.3 * 256 = 76.8 -> quantum 8 in [64, 128) -> 80 = 1.25*2^6 -> field 13, mantissa 2.
    (
        (1.0, 0.3),
        {mode: (119, [0x78, 13 * 8 + 2]) for mode in ("floor", "ceil", "even", "rceil")},
    ),
    # amax 1.875 (mantissa above 1.75, below the even-rounding carry at 1.9375):
    # floor/even e=-8, 1.875*256 = 480 saturates; ceil/rceil e=-7, 240 -> 0x77.
    (
        (1.875,),
        {
            "floor": (119, [0x7E]),
            "even": (119, [0x7E]),
            "ceil": (120, [0x77]),
            "rceil": (120, [0x77]),
        },
    ),
]


@pytest.mark.parametrize("values, expected", HAND_CASES)
def test_hand_derived_blocks(values, expected):
    for mode, (scale, elements) in expected.items():
        got_scale, got_elements = quantize_one(block(*values), mode)
        assert got_scale == scale, mode
        assert got_elements[: len(elements)] == elements, mode
        assert all(code == 0 for code in got_elements[len(elements) :]), mode


def test_rceil_differs_from_floor_just_above_1_75():
    above = 448.0 + 2.0**-15  # the next float32 after 448: mantissa 1.75 + 2^-23
    assert quantize_one(block(448.0), "rceil")[0] == 127  # 448 <= 448 * 2^0
    assert quantize_one(block(above), "rceil")[0] == 128  # needs e = 1
    assert quantize_one(block(above), "floor") == (127, [0x7E] + [0] * 31)  # saturates


def test_subnormal_amax_clamps_scale_and_keeps_elements():
    # fp32 subnormals: floor(log2 amax) <= -127, so every mode clamps e to -127 (code 0).
    # 2^-130 * 2^127 = 2^-3 -> 0x20; 3*2^-133 * 2^127 = 1.5*2^-5 -> field 2, mantissa 4.
    x = block(2.0**-130, -3 * 2.0**-133, 2.0**-149)
    for mode in mxfp8.SCALE_MODES:
        scale, elements = quantize_one(x, mode)
        assert scale == 0
        # 2^-149 * 2^127 = 2^-22 rounds to +0.
        assert elements[:3] == [0x20, 0x80 | (2 * 8 + 4), 0x00]


def test_scale_clamped_at_minus_127_for_small_normal_amax():
    # amax 2^-125: floor gives e = -133, clamped to -127; 2^-125 * 2^127 = 4 -> 0x48.
    for mode in mxfp8.SCALE_MODES:
        assert quantize_one(block(2.0**-125), mode)[:1] == (0,)
        assert quantize_one(block(2.0**-125), mode)[1][0] == 0x48


def test_all_zero_block_keeps_signs():
    x = block(0.0, -0.0, 0.0, -0.0)
    for mode in mxfp8.SCALE_MODES:
        scale, elements = quantize_one(x, mode)
        assert scale == 0
        assert elements[:4] == [0x00, 0x80, 0x00, 0x80]


@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_nonfinite_block_is_nan_scale_and_nan_elements(special):
    x = block(1.0, special, -2.0)
    for mode in mxfp8.SCALE_MODES:
        assert quantize_one(x, mode) == (0xFF, [0x7F] * 32)


def test_ties_round_to_even_and_signs_survive_underflow():
    # amax 448 -> floor e = 0, so elements are the values themselves.
    # 8.5 -> 8 (0x50), 9.5 -> 10 (0x52), 2^-10 -> 0 (tie to even 0), 3*2^-10 -> 2*2^-9 (0x02),
    # -2^-11 -> -0 (0x80).
    scale, elements = quantize_one(block(448.0, 8.5, 9.5, 2.0**-10, 3 * 2.0**-10, -(2.0**-11)), "floor")
    assert scale == 127
    assert elements[:6] == [0x7E, 0x50, 0x52, 0x00, 0x02, 0x80]


def test_blocks_run_along_last_dimension_and_other_block_sizes():
    x = torch.tensor([[1.0, 2.0, 448.0, 0.5], [0.0, 0.0, 3.0, 1.0]])
    scales, elements = mxfp8.quantize(x, scale_mode="floor", block_size=2)
    # block amaxes 2, 448, 0, 3 -> e = -7, 0, -127 (zero block), -7.
    assert scales.tolist() == [[120, 127], [0, 120]]
    # 1*2^7 = 128 -> 0x70, 2*2^7 = 256 -> 0x78, 448 -> 0x7E, 0.5 -> 0x30, 3*2^7 = 384 -> 0x7C.
    assert elements.tolist() == [[0x70, 0x78, 0x7E, 0x30], [0, 0, 0x7C, 0x70]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_input_dtypes_match_fp32_for_equal_values(dtype):
    values = (448.0, 1.9375, -0.3, 2.0**-9, 0.0)
    wide = block(*values).to(dtype).float()  # the values the narrow tensor really holds
    for mode in mxfp8.SCALE_MODES:
        assert quantize_one(block(*values, dtype=dtype), mode) == quantize_one(wide, mode)


def test_dequantize_hand_cases():
    scales = torch.tensor([[127, 0, 0xFF, 254]], dtype=torch.uint8)
    elements = torch.tensor([[0x7E, 0x80, 0x01, 0x38, 0x38, 0x00, 0x7E, 0x01]], dtype=torch.uint8)
    out = mxfp8.dequantize(scales, elements, block_size=2)
    assert out[0, 0].item() == 448.0
    assert out[0, 1].item() == 0.0 and math.copysign(1.0, out[0, 1].item()) < 0  # -0
    assert out[0, 2].item() == 2.0**-136  # 2^-9 * 2^-127, an fp32 subnormal
    assert out[0, 3].item() == 2.0**-127
    assert math.isnan(out[0, 4].item()) and math.isnan(out[0, 5].item())  # NaN scale
    assert out[0, 6].item() == math.inf  # 448 * 2^127 overflows fp32
    assert out[0, 7].item() == 2.0**-9 * 2.0**127
    bf16 = mxfp8.dequantize(scales, elements, block_size=2, dtype=torch.bfloat16)
    assert bf16[0, 2].item() == 0.0  # 2^-136 is below half of bf16's 2^-133
    assert bf16[0, 3].item() == 2.0**-127


def test_quantize_dequantize_round_trip_of_representable_values():
    x = block(448.0, -1.75, 0.5, 2.0**-9, -(2.0**-6), 0.0, 3.0)
    for mode in ("floor", "even"):
        scales, elements = mxfp8.quantize(x, scale_mode=mode)
        assert_bitwise_equal(mxfp8.dequantize(scales, elements), x)


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="block_size"):
        mxfp8.quantize(torch.zeros(2, 33))
    with pytest.raises(ValueError, match="scale_mode"):
        mxfp8.quantize(torch.zeros(32), scale_mode="nearest")
    with pytest.raises(TypeError, match="dtype"):
        mxfp8.quantize(torch.zeros(32, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        mxfp8.quantize([0.0] * 32)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        mxfp8.quantize(torch.zeros(32), block_size=0)
    with pytest.raises(ValueError, match="at least one dimension"):
        mxfp8.quantize(torch.tensor(1.0), block_size=1)
    with pytest.raises(TypeError, match="uint8"):
        mxfp8.dequantize(torch.zeros(1), torch.zeros(32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="shape"):
        mxfp8.dequantize(torch.zeros(2, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8))

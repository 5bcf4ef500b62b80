"""fastgrad.mxfp8 against refgrad.mxfp8 (the spec): bitwise, every mode, dtype and special block."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from triton_interpreter import missing_reason

from fastgrad import mxfp8 as fast
from refgrad import mxfp8 as ref
from refgrad.formats import (
    FLOAT8_E4M3FN,
    Special,
    bits_to_tensor,
    decode,
    format_of,
    tensor_bit_patterns,
)
from verify.fixtures.mxfp8 import random_blocks, special_blocks
from verify.metrics import assert_bitwise_equal

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HYPOTHESIS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def assert_same_quantization(x: torch.Tensor, mode: str, block_size: int = 32) -> None:
    expected = ref.quantize(x, scale_mode=mode, block_size=block_size)
    got = fast.quantize(x, scale_mode=mode, block_size=block_size)
    assert_bitwise_equal(expected[0], got[0], msg=f"scales differ ({mode}, {x.dtype})")
    assert_bitwise_equal(expected[1], got[1], msg=f"elements differ ({mode}, {x.dtype})")


def from_bits(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    return bits_to_tensor(format_of(dtype), bits)


@st.composite
def raw_blocks(draw, dtype):
    """Two blocks of arbitrary bit patterns (NaN, inf, subnormals included)."""
    width = 32 if dtype == torch.float32 else 16
    bits = draw(st.lists(st.integers(0, (1 << width) - 1), min_size=64, max_size=64))
    return from_bits(bits, dtype).reshape(2, 32)


@st.composite
def spread_blocks(draw):
    """Blocks of finite fp32 values whose exponents sit close together (realistic amax mixes)."""
    base = draw(st.integers(-150, 120))
    mantissas = draw(st.lists(st.integers(0, (1 << 23) - 1), min_size=32, max_size=32))
    offsets = draw(st.lists(st.integers(-12, 0), min_size=32, max_size=32))
    signs = draw(st.lists(st.booleans(), min_size=32, max_size=32))
    values = [
        (-1.0 if s else 1.0) * (1 + m / 2**23) * 2.0 ** max(base + o, -149)
        for m, o, s in zip(mantissas, offsets, signs)
    ]
    return torch.tensor(values, dtype=torch.float64).to(torch.float32).reshape(1, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@HYPOTHESIS
@given(data=st.data())
def test_raw_bit_blocks_match_refgrad(dtype, data):
    x = data.draw(raw_blocks(dtype))
    for mode in ref.SCALE_MODES:
        assert_same_quantization(x, mode)


@HYPOTHESIS
@given(x=spread_blocks())
def test_spread_exponent_blocks_match_refgrad(x):
    for mode in ref.SCALE_MODES:
        assert_same_quantization(x, mode)
        assert_same_quantization(x.to(torch.bfloat16), mode)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ref.SCALE_MODES)
def test_special_blocks_match_refgrad(dtype, mode):
    _, x = special_blocks(dtype)
    assert_same_quantization(x, mode)


@pytest.mark.parametrize("mode", ref.SCALE_MODES)
def test_other_shapes_and_block_sizes(mode):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 48, generator=g) * torch.exp2(torch.randint(-30, 30, (2, 3, 1), generator=g))
    assert_same_quantization(x, mode, block_size=16)
    assert_same_quantization(x, mode, block_size=3)  # not a power of two: still fine on CPU
    scales, elements = fast.quantize(x, scale_mode=mode, block_size=16)
    assert scales.shape == (2, 3, 3) and elements.shape == (2, 3, 48)
    assert scales.dtype == torch.uint8 and elements.dtype == torch.uint8


@HYPOTHESIS
@given(
    scales=st.lists(st.integers(0, 255), min_size=2, max_size=2),
    elements=st.lists(st.integers(0, 255), min_size=64, max_size=64),
)
def test_dequantize_matches_refgrad_for_any_codes(scales, elements):
    scale_bits = torch.tensor(scales, dtype=torch.uint8)
    element_bits = torch.tensor(elements, dtype=torch.uint8)
    for dtype in DTYPES:
        expected = ref.dequantize(scale_bits, element_bits, dtype=dtype)
        got = fast.dequantize(scale_bits, element_bits, dtype=dtype)
        assert_bitwise_equal(tensor_bit_patterns(expected), tensor_bit_patterns(got), msg=str(dtype))


def test_e4m3_code_table_matches_refgrad_decode():
    table = fast.e4m3_code_values()
    for code in range(256):
        value = decode(FLOAT8_E4M3FN, code)
        if value is Special.NAN:
            assert torch.isnan(table[code])
        elif value is Special.NEG_ZERO:
            assert table[code].item() == 0.0 and table[code].signbit()
        else:
            assert table[code].item() == float(value), code


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"x": torch.zeros(2, 33)}, ValueError, "divisible by block_size"),
        ({"x": torch.zeros(32), "scale_mode": "up"}, ValueError, "scale_mode"),
        ({"x": torch.zeros(32, dtype=torch.float64)}, TypeError, "dtype"),
        ({"x": torch.zeros(32, dtype=torch.int32)}, TypeError, "dtype"),
        ({"x": torch.zeros(32), "block_size": 0}, ValueError, "block_size must be >= 1"),
        ({"x": torch.zeros(32), "block_size": 2.0}, TypeError, "block_size must be an int"),
        ({"x": "not a tensor"}, TypeError, "x must be a torch.Tensor"),
    ],
)
def test_quantize_errors(kwargs, error, match):
    x = kwargs.pop("x")
    with pytest.raises(error, match=match):
        fast.quantize(x, **kwargs)
    with pytest.raises(error, match=match):
        ref.quantize(x, **kwargs)


def test_dequantize_errors():
    codes = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(TypeError, match="scale_bits must be a uint8"):
        fast.dequantize(torch.zeros(2), codes)
    with pytest.raises(ValueError, match="needs scales of shape"):
        fast.dequantize(torch.zeros(3, dtype=torch.uint8), codes)
    with pytest.raises(TypeError, match="dtype must be one of"):
        fast.dequantize(torch.zeros(2, dtype=torch.uint8), codes, dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_into_out_matches_refgrad_in_place(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.cat([special_blocks(dtype)[1], random_blocks(16, g, dtype)])  # several rows
    for mode in ref.SCALE_MODES:
        expected = ref.quantize(x, scale_mode=mode)
        out = (torch.full_like(expected[0], 0xAB), torch.full_like(expected[1], 0xAB))
        pointers = (out[0].data_ptr(), out[1].data_ptr())
        assert fast.quantize(x, scale_mode=mode, out=out) is out
        assert (out[0].data_ptr(), out[1].data_ptr()) == pointers
        assert_bitwise_equal(expected[0], out[0], msg=mode)
        assert_bitwise_equal(expected[1], out[1], msg=mode)


def test_quantize_out_errors():
    x = torch.zeros(2, 64)
    good = (torch.zeros(2, 2, dtype=torch.uint8), torch.zeros(2, 64, dtype=torch.uint8))
    with pytest.raises(TypeError, match="out must be a"):
        fast.quantize(x, out=list(good))
    with pytest.raises(ValueError, match=r"out\[0\].*shape \(2, 2\)"):
        fast.quantize(x, out=(torch.zeros(4, dtype=torch.uint8), good[1]))
    with pytest.raises(ValueError, match=r"out\[1\].*uint8"):
        fast.quantize(x, out=(good[0], torch.zeros(2, 64)))
    with pytest.raises(ValueError, match="contiguous"):
        fast.quantize(x, out=(good[0], torch.zeros(64, 2, dtype=torch.uint8).T))


def test_mxfp8_parameter_copy_from_writes_its_own_storage():
    g = torch.Generator().manual_seed(4)
    param = fast.MXFP8Parameter(torch.randn(8, 64, generator=g))
    pointers = (param.scale_bits.data_ptr(), param.element_bits.data_ptr())
    values = torch.randn(8 * 64, generator=g).to(torch.bfloat16)
    param.copy_from(values)
    expected = ref.quantize(values.reshape(8, 64))
    assert (param.scale_bits.data_ptr(), param.element_bits.data_ptr()) == pointers
    assert_bitwise_equal(param.scale_bits, expected[0])
    assert_bitwise_equal(param.element_bits, expected[1])


def test_triton_not_used_on_cpu():
    assert not fast.triton_usable(torch.zeros(32), 32)


@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_triton_kernel_logic_in_interpreter():
    """TRITON_INTERPRET=1 runs the kernel on CPU; faithful for its integer/fp32 logic.

    A subprocess, because the interpreter flag is read when the kernel is defined.
    """
    script = (
        "import torch\n"
        "from fastgrad.kernels.mxfp8 import quantize_triton\n"
        "from refgrad import mxfp8 as ref\n"
        "from verify.fixtures.mxfp8 import special_blocks, random_blocks\n"
        "from verify.metrics import bitwise_equal\n"
        "for dtype in (torch.float32, torch.float16, torch.bfloat16):\n"
        "    g = torch.Generator().manual_seed(5)\n"
        "    x = torch.cat([special_blocks(dtype)[1], random_blocks(8, g, dtype)])\n"
        "    for mode in ref.SCALE_MODES:\n"
        "        s, e = quantize_triton(x, scale_mode=mode, blocks_per_program=8)\n"
        "        rs, re = ref.quantize(x, scale_mode=mode)\n"
        "        assert bitwise_equal(s, rs) and bitwise_equal(e, re), (dtype, mode)\n"
        "        out = (torch.full_like(rs, 0xAB), torch.full_like(re, 0xAB))\n"
        "        got = quantize_triton(x, scale_mode=mode, blocks_per_program=8, out=out)\n"
        "        assert got is out and bitwise_equal(out[0], rs) and bitwise_equal(out[1], re)\n"
        "for bad in (0, 3, -4):\n"
        "    try:\n"
        "        quantize_triton(torch.zeros(64), blocks_per_program=bad)\n"
        "    except ValueError as exc:\n"
        "        assert 'blocks_per_program must be a power of two' in str(exc)\n"
        "    else:\n"
        "        raise AssertionError(f'blocks_per_program={bad} accepted')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_quantize_matches_refgrad(dtype):
    g = torch.Generator().manual_seed(11)
    x = torch.cat([special_blocks(dtype)[1], random_blocks(256, g, dtype)])
    for mode in ref.SCALE_MODES:
        expected = ref.quantize(x, scale_mode=mode)
        scales, elements = fast.quantize(x.cuda(), scale_mode=mode)  # Triton when installed
        assert_bitwise_equal(expected[0], scales.cpu())
        assert_bitwise_equal(expected[1], elements.cpu())
        out = (torch.full_like(scales, 0xAB), torch.full_like(elements, 0xAB))
        assert fast.quantize(x.cuda(), scale_mode=mode, out=out) is out  # written in place
        assert_bitwise_equal(expected[0], out[0].cpu())
        assert_bitwise_equal(expected[1], out[1].cpu())
        torch_path = fast.quantize_torch(x.cuda(), scale_mode=mode)
        assert_bitwise_equal(expected[0], torch_path[0].cpu())
        assert_bitwise_equal(expected[1], torch_path[1].cpu())
        deq = fast.dequantize(scales, elements, dtype=dtype)
        ref_deq = ref.dequantize(expected[0], expected[1], dtype=dtype)
        assert_bitwise_equal(tensor_bit_patterns(ref_deq), tensor_bit_patterns(deq.cpu()))

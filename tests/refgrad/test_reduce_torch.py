"""refgrad.reduce_torch: torch's DP reductions modelled element by element; hand-derived values
and torch's own CPU elementwise ops (the arithmetic the models claim to follow)."""

import pytest
import torch

from gradvocab import Averaging
from refgrad import reduce_scatter as refc
from refgrad.reduce_torch import (
    FSDP2DivideFactors,
    cast,
    compress_hook_all_reduce,
    divide_like_torch,
    fsdp2_accumulate,
    fsdp2_divide_factors,
    fsdp2_reduce_scatter,
)
from verify.metrics import assert_bitwise_equal


def _bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("divisor", [3, 6, 1.5, 16.0])
def test_divide_is_torch_cpu_div(dtype, divisor):
    x = (torch.randn(500, generator=torch.Generator().manual_seed(7)) * 4).to(dtype)
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), 2.0**-24]).to(dtype)
    (got,) = divide_like_torch([x], divisor)
    assert_bitwise_equal(_bits(got), _bits(x.clone().div_(divisor)))


def test_cuda_division_multiplies_by_the_reciprocal():
    # fp32(1/3) = 11184811 * 2^-25. 5 / 3 = 13981013.33 * 2^-23 rounds to 13981013 * 2^-23;
    # 5 * fp32(1/3) = 13981013.75 * 2^-23 rounds to 13981014 * 2^-23.
    x = torch.tensor([5.0])
    (cpu,) = divide_like_torch([x], 3, device="cpu")
    (cuda,) = divide_like_torch([x], 3, device="cuda")
    assert cpu.item() == 13981013 * 2.0**-23 and cuda.item() == 13981014 * 2.0**-23


def test_compress_hook_hand_derived():
    # fp32 1 + 2^-20 rounds to 1 in fp16; / 2 = 0.5; two ranks: 0.5 + 0.25 = 0.75 exactly
    a, b = torch.tensor([1 + 2.0**-20]), torch.tensor([0.5])
    out = compress_hook_all_reduce([a, b], torch.float16, order="rank")
    assert [t.dtype for t in out] == [torch.float32] * 2 and out[0].item() == 0.75
    # the division underflows first: 2^-24 (fp16's smallest subnormal) / 2 rounds to 0 (even)
    tiny = torch.tensor([2.0**-24])
    assert compress_hook_all_reduce([tiny, tiny], torch.float16, order="rank")[0].item() == 0.0
    assert refc.all_reduce([tiny, tiny], accumulate="fp32", order="rank", op=Averaging.AVG)[0].item() == 2.0**-24


# Expected values from torch 2.13's _get_gradient_divide_factors
# (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), run by hand: fp32/bf16 without a
# factor -> (None, None, AVG), SUM at W = 1; fp16 -> pre doubles from 1 while
# factor % pre == 0 and factor / pre > pre, post = factor / pre, SUM. W = 8: 1 -> 2 -> 4
# (8 / 4 = 2 is not > 4); W = 3: 1 -> 2 (3 % 2 != 0); W = 64: 1 -> 2 -> 4 -> 8 (64 / 8 = 8);
# W = 2: 1 -> 2 (2 / 2 = 1 is not > 2), post 1.
@pytest.mark.parametrize("dtype,world,want", [
    (torch.float32, 4, FSDP2DivideFactors(Averaging.AVG)),
    (torch.bfloat16, 1, FSDP2DivideFactors(Averaging.SUM)),
    (torch.float16, 8, FSDP2DivideFactors(Averaging.SUM, predivide=4.0, postdivide=2.0)),
    (torch.float16, 3, FSDP2DivideFactors(Averaging.SUM, predivide=2.0, postdivide=1.5)),
    (torch.float16, 64, FSDP2DivideFactors(Averaging.SUM, predivide=8.0, postdivide=8.0)),
    (torch.float16, 2, FSDP2DivideFactors(Averaging.SUM, predivide=2.0, postdivide=1.0)),
])
def test_divide_factors_hand_derived(dtype, world, want):
    assert fsdp2_divide_factors(dtype, world) == want


def test_divide_factors_forced_and_given():
    # torch: fp32/bf16 with a factor other than the group's size -> PREMUL_SUM(1 / factor);
    # forced to SUM (no overflow risk) -> (None, factor, SUM); factor == W -> AVG
    given = fsdp2_divide_factors(torch.float32, 4, factor=2.0)
    assert given == FSDP2DivideFactors(Averaging.SUM, premultiplier=0.5) and given.premul_sum
    assert fsdp2_divide_factors(torch.float32, 4, factor=1.0, force_sum=True) \
        == FSDP2DivideFactors(Averaging.SUM, postdivide=1.0)
    assert fsdp2_divide_factors(torch.bfloat16, 4, factor=4) == FSDP2DivideFactors(Averaging.AVG)
    assert not fsdp2_divide_factors(torch.bfloat16, 4).premul_sum


@pytest.mark.parametrize("kwargs,error", [
    ({"op": "avg"}, ValueError),  # a string is not the type
    ({"op": Averaging.PRESCALE}, ValueError),  # not a collective's op
    ({"op": Averaging.AVG, "postdivide": 2.0}, ValueError),  # AVG divides by itself
    ({"op": Averaging.AVG, "premultiplier": 0.5}, ValueError),
    ({"op": Averaging.SUM, "premultiplier": 0.5, "predivide": 2.0}, ValueError),
    ({"op": Averaging.SUM, "predivide": 2}, TypeError),  # an int, not a float
    ({"op": Averaging.SUM, "postdivide": True}, TypeError),
    ({"op": Averaging.SUM, "postdivide": 0.0}, ValueError),
    ({"op": Averaging.SUM, "premultiplier": float("inf")}, ValueError),
])
def test_divide_factors_record_refuses(kwargs, error):
    with pytest.raises(error, match="FSDP2DivideFactors"):
        FSDP2DivideFactors(**kwargs)


def test_reduce_scatter_refuses_premul_sum():
    inputs = [torch.ones(2), torch.ones(2)]
    with pytest.raises(ValueError, match="PREMUL_SUM"):
        fsdp2_reduce_scatter(inputs, reduce_dtype=None, orig_dtype=torch.float32, order="rank",
                             factor=4.0)


def test_fsdp2_reduce_scatter_avg_backends():
    # bf16 AVG over 3 ranks of 1, 1, 2: gloo sums to 4 and divides once (4/3 rounded);
    # NCCL multiplies each by bf16(1/3) = 0.333984375 first.
    inputs = [torch.full((3,), v, dtype=torch.bfloat16) for v in (1.0, 1.0, 2.0)]
    gloo = fsdp2_reduce_scatter(inputs, reduce_dtype=None, orig_dtype=torch.bfloat16, order="rank")
    nccl = fsdp2_reduce_scatter(inputs, reduce_dtype=None, orig_dtype=torch.bfloat16, order="rank",
                                avg_backend="nccl")
    assert gloo[0].item() == torch.tensor(4 / 3).to(torch.bfloat16).item()
    third = torch.tensor(1 / 3).to(torch.bfloat16).float()
    one = (torch.tensor(1.0) * third).to(torch.bfloat16).float()
    two = (torch.tensor(2.0) * third).to(torch.bfloat16).float()
    assert nccl[0].item() == ((one + one).to(torch.bfloat16).float() + two).to(torch.bfloat16).item()
    # fp16 at W = 2: pre 2, post 1: the same as the sum of halves; output cast to fp32
    halves = fsdp2_reduce_scatter([torch.tensor([3.0, 5.0]), torch.tensor([1.0, 1.0])],
                                  reduce_dtype=torch.float16, orig_dtype=torch.float32, order="rank")
    assert [t.tolist() for t in halves] == [[2.0], [3.0]] and halves[0].dtype == torch.float32


def test_fsdp2_accumulate_upcasts_first():
    # bf16 grads 1 and 2^-9: in bf16 1 + 2^-9 rounds to 1; upcast to fp32 first it is kept
    grads = [torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0**-9], dtype=torch.bfloat16)]
    assert fsdp2_accumulate(grads, reduce_dtype=None).item() == 1.0
    upcast = fsdp2_accumulate(grads, reduce_dtype=torch.float32)
    assert upcast.dtype == torch.float32 and upcast.item() == 1 + 2.0**-9


def test_cast_rounds_to_nearest_even():
    x = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8])
    assert cast([x], torch.bfloat16)[0].tolist() == [1.0, 1 + 2.0**-6]

"""refgrad.reduce_scatter: hand-derived cases, IEEE specials, and agreement with torch's own arithmetic."""

from __future__ import annotations

import functools

import pytest
import torch

from gradvocab import Averaging
from refgrad import formats
from refgrad import reduce_scatter as rc
from verify.metrics import assert_bitwise_equal, bitwise_equal

DTYPES = (torch.float16, torch.bfloat16)


def _ranks(values_per_rank, dtype=torch.float16):
    return [torch.tensor(v, dtype=dtype) for v in values_per_rank]


def _random_ranks(world_size, numel, dtype, seed, spread=6.0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(world_size):
        mag = torch.exp2(spread * (torch.rand(numel, generator=g) - 0.5))
        out.append((torch.randn(numel, generator=g) * mag).to(dtype))
    return out


def test_ring_order_starts_after_the_owner_and_ends_on_it():
    assert rc.ring_order(4, 0) == [1, 2, 3, 0]
    assert rc.ring_order(4, 3) == [0, 1, 2, 3]
    assert rc.ring_order(3, 1) == [2, 0, 1]
    assert rc.ring_order(4, 0, reverse=True) == [3, 2, 1, 0]
    assert rc.ring_order(4, 2, reverse=True) == [1, 0, 3, 2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reverse_ring_equals_the_forward_ring_only_for_three_ranks(dtype):
    # W=3: forward (c+1, c+2, c) and reverse (c+2, c+1, c) differ only in the order of the
    # first two addends, and IEEE addition is commutative. W=4 orders differ for real.
    three = _random_ranks(3, 3 * 40, dtype, seed=21)
    forward = torch.cat(rc.reduce_scatter(three, accumulate="wire", order="ring"))
    reverse = torch.cat(rc.reduce_scatter(three, accumulate="wire", order="ring_reverse"))
    assert_bitwise_equal(forward, reverse)
    four = _random_ranks(4, 4 * 40, dtype, seed=22)
    forward = torch.cat(rc.reduce_scatter(four, accumulate="wire", order="ring"))
    reverse = torch.cat(rc.reduce_scatter(four, accumulate="wire", order="ring_reverse"))
    assert not bitwise_equal(formats.tensor_bit_patterns(forward), formats.tensor_bit_patterns(reverse))
    for c in range(4):
        parts = [four[r][c * 40 : (c + 1) * 40] for r in rc.ring_order(4, c, reverse=True)]
        assert_bitwise_equal(functools.reduce(torch.add, parts), reverse[c * 40 : (c + 1) * 40])


def test_wire_rounds_every_step_while_fp32_rounds_once():
    # fp16 around 1 has ulp 2^-10: 1 + 2^-11 is a tie and rounds to even (1),
    # so adding 2^-11 twice in fp16 is lost; in fp32 the sum 1 + 2^-10 is exact.
    inputs = _ranks([[1.0] * 3, [2.0**-11] * 3, [2.0**-11] * 3])
    wire = rc.reduce_scatter(inputs, accumulate="wire", order="rank")
    fp32 = rc.reduce_scatter(inputs, accumulate="fp32", order="rank")
    assert [t.item() for t in wire] == [1.0, 1.0, 1.0]
    assert [t.item() for t in fp32] == [1.0 + 2.0**-10] * 3


def test_ring_order_changes_the_result_per_chunk():
    # Chunk 0 is summed as x1 + x2 + x0 = (2^-11 + 2^-11) + 1 = 1 + 2^-10 exactly;
    # chunks 1 and 2 start next to the 1 and lose both halves to ties-to-even.
    inputs = _ranks([[1.0] * 3, [2.0**-11] * 3, [2.0**-11] * 3])
    ring = rc.reduce_scatter(inputs, accumulate="wire", order="ring")
    assert [t.item() for t in ring] == [1.0 + 2.0**-10, 1.0, 1.0]


def test_tree_sums_adjacent_pairs():
    # (1 + 2^-11) + (2^-11 + 0) = 1 + 2^-11 -> tie -> 1 in fp16; rank order gives 1 too,
    # but (2^-11 + 2^-11) + 1 in the pairing [2^-11, 2^-11, 1, 0] gives 1 + 2^-10.
    inputs = _ranks([[2.0**-11] * 4, [2.0**-11] * 4, [1.0] * 4, [0.0] * 4])
    tree = rc.reduce_scatter(inputs, accumulate="wire", order="tree")
    assert [t.item() for t in tree] == [1.0 + 2.0**-10] * 4
    inputs = _ranks([[1.0] * 4, [2.0**-11] * 4, [2.0**-11] * 4, [0.0] * 4])
    tree = rc.reduce_scatter(inputs, accumulate="wire", order="tree")
    assert [t.item() for t in tree] == [1.0] * 4


def test_tree_passes_an_odd_rank_up_unchanged():
    # Pairs (x0 + x1), x2 carried: (1 + 2^-11) -> 1, then 1 + 2^-11 -> 1.
    inputs = _ranks([[1.0] * 3, [2.0**-11] * 3, [2.0**-11] * 3])
    tree = rc.reduce_scatter(inputs, accumulate="wire", order="tree")
    assert [t.item() for t in tree] == [1.0] * 3


def test_overflow_in_the_wire_is_sticky_but_fp32_recovers():
    inputs = _ranks([[65504.0] * 2, [65504.0] * 2, [-65504.0] * 2])
    wire = rc.all_reduce(inputs, accumulate="wire", order="rank")
    fp32 = rc.all_reduce(inputs, accumulate="fp32", order="rank")
    assert torch.isinf(wire[0]).all() and (wire[0] > 0).all()
    assert (fp32[0] == 65504.0).all()


def test_ieee_specials():
    nan, inf = float("nan"), float("inf")
    inputs = _ranks([[nan, inf, -0.0, 0.0], [1.0, -inf, -0.0, -0.0]])
    for accumulate in rc.ACCUMULATE_MODES:
        out = rc.all_reduce(inputs, accumulate=accumulate, order="rank")[0]
        assert torch.isnan(out[0]) and torch.isnan(out[1])
        assert out[2].item() == 0.0 and torch.signbit(out[2])  # -0 + -0 = -0
        assert out[3].item() == 0.0 and not torch.signbit(out[3])  # +0 + -0 = +0


def test_exact_cancellation_gives_positive_zero():
    inputs = _ranks([[3.0, -2.0**-24], [-3.0, 2.0**-24]])
    out = rc.all_reduce(inputs, accumulate="wire", order="rank")[0]
    assert not torch.signbit(out).any() and (out == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_wire_rank_order_equals_torch_low_precision_addition(dtype, world_size):
    inputs = _random_ranks(world_size, 8 * world_size, dtype, seed=world_size)
    expected = functools.reduce(torch.add, inputs)  # elementwise fp16/bf16 adds, rank order
    got = torch.cat(rc.reduce_scatter(inputs, accumulate="wire", order="rank"))
    assert_bitwise_equal(expected, got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_fp32_rank_order_equals_torch_float32_accumulation(dtype, world_size):
    inputs = _random_ranks(world_size, 8 * world_size, dtype, seed=100 + world_size, spread=30.0)
    acc = inputs[0].to(torch.float32)
    for t in inputs[1:]:
        acc = acc + t.to(torch.float32)
    got = torch.cat(rc.reduce_scatter(inputs, accumulate="fp32", order="rank"))
    assert_bitwise_equal(acc.to(dtype), got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ring_equals_torch_addition_in_rotated_order(dtype):
    world_size, chunk = 4, 6
    inputs = _random_ranks(world_size, world_size * chunk, dtype, seed=7)
    outputs = rc.reduce_scatter(inputs, accumulate="wire", order="ring")
    for c in range(world_size):
        parts = [inputs[r][c * chunk : (c + 1) * chunk] for r in rc.ring_order(world_size, c)]
        assert_bitwise_equal(functools.reduce(torch.add, parts), outputs[c])


def test_tree_equals_torch_pairwise_addition():
    inputs = _random_ranks(5, 10, torch.bfloat16, seed=11)
    a, b, c, d, e = inputs
    expected = ((a + b) + (c + d)) + e  # levels: [ab, cd, e] -> [abcd, e] -> [abcde]
    got = torch.cat(rc.reduce_scatter(inputs, accumulate="wire", order="tree"))
    assert_bitwise_equal(expected, got)


def test_all_reduce_is_reduce_scatter_then_gather():
    inputs = _random_ranks(3, 12, torch.float16, seed=3)
    for order in rc.ORDERS:
        scattered = torch.cat(rc.reduce_scatter(inputs, accumulate="wire", order=order))
        for out in rc.all_reduce(inputs, accumulate="wire", order=order):
            assert_bitwise_equal(scattered, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_avg_divides_the_fp32_accumulator_before_the_final_rounding(dtype):
    inputs = _random_ranks(3, 9, dtype, seed=5)
    acc = inputs[0].float() + inputs[1].float() + inputs[2].float()
    # Expected from exact arithmetic: fp32 IEEE quotient via float64 (53 >= 2*24+2 makes
    # the float64 -> float32 double rounding of a quotient innocuous).
    expected = (acc.double() / 3).float().to(dtype)
    got = torch.cat(rc.reduce_scatter(inputs, accumulate="fp32", order="rank", op=Averaging.AVG))
    assert_bitwise_equal(expected, got)


def test_avg_hand_case():
    # (1 + 1 + 1) / 3 = 1 exactly. (1 + 2^-11 + 2^-11): fp32 keeps the sum 1 + 2^-10 =
    # 1025/1024; / 3 = 1025/3072 rounds in fp32 to 11196417 * 2^-25 (11196416.67 rounded),
    # then to fp16 (ulp 2^-12 in [1/4, 1/2)): 11196417 / 2^13 = 1366.75 -> 1367 * 2^-12.
    # The wire loses both 2^-11 to ties-to-even: 1 / 3 -> 1365.33 -> 1365 * 2^-12.
    inputs = _ranks([[1.0, 1.0], [1.0, 2.0**-11], [1.0, 2.0**-11]])
    out = rc.all_reduce(inputs, accumulate="fp32", order="rank", op=Averaging.AVG)[0]
    assert out.tolist() == [1.0, 1367 * 2.0**-12]
    wire = rc.all_reduce(inputs, accumulate="wire", order="rank", op=Averaging.AVG)[0]
    assert wire.tolist() == [1.0, 1365 * 2.0**-12]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world_size", [3, 8, 1024])
def test_prescale_like_torch_matches_torch_multiplication(dtype, world_size):
    g = torch.Generator().manual_seed(world_size)
    # Include tiny values so the fp16 products become subnormal and lose bits.
    x = (torch.randn(64, generator=g) * torch.exp2(-20 * torch.rand(64, generator=g))).to(dtype)
    expected = x * (1.0 / world_size)
    got = rc.prescale_like_torch([x], 1.0 / world_size)[0]
    assert_bitwise_equal(expected, got)


def test_each_rounding_goes_through_refgrad_formats():
    # One addition = the exact IEEE sum rounded once.
    fmt = formats.FLOAT16
    assert rc.add(fmt, formats.round_to_value(fmt, 1), formats.round_to_value(fmt, 2.0**-11)) == 1
    assert rc.divide(formats.FLOAT32, formats.Special.NEG_ZERO, 3) is formats.Special.NEG_ZERO


def test_validation_errors():
    good = _ranks([[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(ValueError, match="accumulate"):
        rc.reduce_scatter(good, accumulate="fp64", order="rank")
    with pytest.raises(ValueError, match="order"):
        rc.reduce_scatter(good, accumulate="wire", order="random")
    with pytest.raises(ValueError, match="op"):
        rc.reduce_scatter(good, accumulate="wire", order="rank", op="max")
    for collective in (rc.reduce_scatter, rc.all_reduce):  # the type, not its old string
        with pytest.raises(ValueError, match=r"op must be one of Averaging.SUM, Averaging.AVG, got 'sum'"):
            collective(good, accumulate="wire", order="rank", op="sum")
    with pytest.raises(ValueError, match="op must be one of"):  # no scale in the collective itself
        rc.all_reduce(good, accumulate="wire", order="rank", op=Averaging.PRESCALE)
    with pytest.raises(ValueError, match="divisible"):
        rc.reduce_scatter(_ranks([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]), accumulate="wire", order="rank")
    with pytest.raises(ValueError, match="at least one"):
        rc.reduce_scatter([], accumulate="wire", order="rank")
    with pytest.raises(TypeError, match="sequence"):
        rc.reduce_scatter(torch.zeros(2, 2), accumulate="wire", order="rank")
    with pytest.raises(TypeError, match="dtype"):
        rc.reduce_scatter([good[0], good[1].to(torch.bfloat16)], accumulate="wire", order="rank")
    with pytest.raises(ValueError, match="shape"):
        rc.reduce_scatter([good[0], torch.zeros(4, dtype=torch.float16)], accumulate="wire",
                          order="rank")
    with pytest.raises(TypeError, match="Tensor"):
        rc.reduce_scatter([good[0], [1.0, 2.0]], accumulate="wire", order="rank")
    with pytest.raises(ValueError, match="factor"):
        rc.prescale_like_torch(good, -0.5)


def _finite_patterns(dtype):
    """Hypothesis strategy: bit patterns of finite values of ``dtype`` (subnormals, -0 included)."""
    from hypothesis import strategies as st

    exponent_mask = 0x7C00 if dtype == torch.float16 else 0x7F80
    return st.integers(0, 0xFFFF).filter(lambda b: b & exponent_mask != exponent_mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_property_refgrad_equals_torch_on_arbitrary_finite_patterns(dtype):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.integers(2, 6).flatmap(
        lambda w: st.lists(st.lists(_finite_patterns(dtype), min_size=w, max_size=w),
                           min_size=w, max_size=w)))
    def check(patterns):
        inputs = [formats.tensor_from_bit_patterns(torch.tensor(row), dtype) for row in patterns]
        wire = torch.cat(rc.reduce_scatter(inputs, accumulate="wire", order="rank"))
        assert_bitwise_equal(functools.reduce(torch.add, inputs), wire)
        acc = inputs[0].float()
        for t in inputs[1:]:
            acc = acc + t.float()
        fp32 = torch.cat(rc.reduce_scatter(inputs, accumulate="fp32", order="rank"))
        assert_bitwise_equal(acc.to(dtype), fp32)

    check()


def test_gloo_ring_cuts_the_buffer_as_gloo_does():
    """gloo's ring all-reduce owns 2 segments of ceil(n / 2W) elements per rank: at W = 4 and
    n = 76 element 19 lies in rank 0's chunk (elements 0..19), not in the reduce-scatter's
    chunk 1 (19..37). Hand-derived, bf16: ranks 0..3 hold 1, 2^30, -2^30, 0 there; rank 0's
    reverse-ring order 3, 2, 1, 0 keeps the 1 (0 - 2^30 + 2^30 + 1), chunk 1's 0, 3, 2, 1
    loses it (1 + 0 - 2^30 rounds to -2^30)."""
    values = [1.0, 2.0**30, -(2.0**30), 0.0]
    inputs = []
    for v in values:
        t = torch.zeros(76, dtype=torch.bfloat16)
        t[19] = v
        inputs.append(t)
    gloo = rc.all_reduce(inputs, accumulate="wire", order="gloo_ring")[0]
    reverse = rc.all_reduce(inputs, accumulate="wire", order="ring_reverse")[0]
    assert gloo[19].item() == 1.0 and reverse[19].item() == 0.0
    # where 2W divides the numel, gloo's segments are the reduce-scatter's chunks
    even = [torch.randn(64, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16) for r in range(4)]
    assert_bitwise_equal(rc.all_reduce(even, accumulate="wire", order="gloo_ring")[0],
                         rc.all_reduce(even, accumulate="wire", order="ring_reverse")[0])

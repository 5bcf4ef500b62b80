"""The fused exact norm (``cpu_kernels.square_bins``) against refgrad's exact sum of squares.

The kernel splits each fp32 square into parts on two (or more) fixed-point grids per
sub-block of ``SUB_BLOCK`` elements and bins element by element only where a sub-block
holds NaN/inf or ``|g| >= 2^127``. Every path must give refgrad's exact sum: ordinary
grads (two levels), a tiny square beside a huge one (every level down to 2^-298),
subnormals alone (the lowest field), the top binade, NaN/inf (the count, and the exact
sum of the rest), loss-scale unscaling, 16-bit grads, any row split and thread count.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastgrad.ddp import DistributedDataParallel
from fastgrad.optim import AdamWConfig, DistributedOptimizer
from fastgrad.optim import cpu_kernels as K
from fastgrad.optim.norm import limbs_from_bins, limbs_to_fraction
from fastgrad.optim.step_paths import FusedCpuPath
from gradvocab import DDPConfig
from refgrad import optim as R
from verify.metrics import assert_bitwise_equal

SUB = K.SUB_BLOCK
GRAD_KIND = {torch.float32: K.GRAD_FP32, torch.bfloat16: K.GRAD_BF16, torch.float16: K.GRAD_FP16}
# fp32 bit patterns at the paths' edges: zero, subnormals, the first normals, 1 and its
# neighbours, the top of the level path (field 253) and the binade above (field 254)
EDGE_BITS = [0, 1, 2, 3, 0x7FFFFF, 0x400000, 0x800000, 0x800001, 0x3F800000, 0x3F7FFFFF,
             0x3F800001, 0x7EFFFFFF, 0x7EFFFFFE, 0x7E800000, 0x7F000000, 0x7F000001, 0x7F7FFFFF]
NONFINITE_BITS = [0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF]


def _fp32(bits: list[int] | np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(bits, dtype=np.uint32).view(np.int32).copy()).view(torch.float32)


def _rows(n: int, cuts: list[int], in_norm: list[int]) -> np.ndarray:
    """Rows over ``[0, n)`` cut at ``cuts`` and every CHUNK elements; ``in_norm`` cycles."""
    edges = sorted({0, n, *[c for c in cuts if 0 < c < n], *range(0, n, K.CHUNK)})
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        for a in range(lo, hi, K.CHUNK):
            rows.append((a, min(a + K.CHUNK, hi), a, 0, in_norm[len(rows) % len(in_norm)]))
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def _kernel_sum(g: torch.Tensor, work: np.ndarray, inv_scale: float | None) -> tuple[Fraction, int]:
    raw = g.view(torch.int32 if g.element_size() == 4 else torch.int16).numpy()
    low, high, nonfinite = K.square_bins(work, GRAD_KIND[g.dtype], raw,
                                         np.float32(1.0 if inv_scale is None else inv_scale))
    return limbs_to_fraction(limbs_from_bins(low, high)), nonfinite


def _refgrad_sum(g: torch.Tensor, work: np.ndarray, inv_scale: float | None) -> tuple[Fraction, int]:
    """refgrad's exact sum of the unscaled squares over the rows in the norm, skipping NaN/inf
    (which refgrad's step would skip), and the NaN/inf count over every row."""
    loss_scale = None if inv_scale is None else 1 / inv_scale
    total, nonfinite = Fraction(0), 0
    for lo, hi, _, _, in_norm in work.tolist():
        part = g[lo:hi].float()
        finite = torch.isfinite(part)
        nonfinite += int((~finite).sum())
        if in_norm:
            total += R.sum_of_squares(R.prepare_grads([part[finite]], loss_scale=loss_scale))
    return total, nonfinite


def _assert_refgrads(g: torch.Tensor, work: np.ndarray, inv_scale: float | None = None) -> None:
    assert _kernel_sum(g, work, inv_scale) == _refgrad_sum(g, work, inv_scale)


@st.composite
def adversarial_grads(draw):
    """fp32 grads of a few sub-blocks: a random exponent window (narrow: the two-level path;
    wide: more levels), planted edge values, NaN/inf, and rows cut anywhere."""
    n = draw(st.sampled_from([1, 5, SUB - 1, SUB + 1, 2 * SUB, 3 * SUB + 7]))
    top = draw(st.integers(1, 254))
    width = draw(st.sampled_from([0, 1, 12, 23, 24, 25, 60, 120, 254]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    fields = np.clip(top - rng.integers(0, width + 1, n), 0, 254)
    bits = (fields << 23) | rng.integers(0, 1 << 23, n) | (rng.integers(0, 2, n) << 31)
    bits[rng.random(n) < draw(st.sampled_from([0.0, 0.3]))] = 0  # zeros
    planted = draw(st.lists(st.tuples(st.integers(0, n - 1),
                                      st.sampled_from(EDGE_BITS) | st.integers(0, 0x7F7FFFFF),
                                      st.booleans()), max_size=6))
    for i, b, negative in planted:
        bits[i] = b | (negative << 31)
    if draw(st.booleans()):
        bits[draw(st.integers(0, n - 1))] = draw(st.sampled_from(NONFINITE_BITS))
    cuts = draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3))
    in_norm = draw(st.sampled_from([[1], [1, 0], [0, 1]]))
    inv_scale = draw(st.sampled_from([None, 2.0**-3, 2.0**-24]))
    return _fp32(bits), _rows(n, cuts, in_norm), inv_scale


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=adversarial_grads())
def test_fused_norm_is_refgrads_exact_sum_on_adversarial_grads(case):
    g, work, inv_scale = case
    _assert_refgrads(g, work, inv_scale)


def _mixed(n: int, *values: float) -> torch.Tensor:
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    g[: len(values)] = torch.tensor(values)
    return g


@pytest.mark.parametrize("g", [
    _mixed(3 * SUB + 3),  # ordinary grads: two levels everywhere
    _mixed(SUB, 2.0**126, 2.0**-149, 3.0 * 2.0**-149),  # every level, field 229 down to 1
    _mixed(SUB, 1e30, 1e-30, 1.0000001e-20),  # a few levels
    _mixed(2 * SUB) * 2.0**-130,  # subnormals and the lowest normals: the level at field 1
    _fp32([0x7FFFFF] * SUB + [1] * SUB),  # the largest and the smallest subnormal
    _fp32([0x7EFFFFFF] * (SUB + 1)),  # the top of the level path: squares just below 2^46 units
    _mixed(SUB, 2.0**127, -3.4e38),  # field 254: element by element
    torch.zeros(SUB + 1),
    -_mixed(SUB + 2, -0.0),
], ids=["gaussian", "every-level", "some-levels", "subnormal", "subnormal-edges", "field-253",
        "field-254", "zeros", "negative"])
def test_fused_norm_paths_are_refgrads_exact_sum(g):
    _assert_refgrads(g, _rows(g.numel(), [], [1]))


HALF_BELOW = 0xEE44D9  # a 24-bit mantissa whose square is 2^25 - 15 modulo 2^26


@pytest.mark.parametrize("deep", [False, True], ids=["two-levels", "every-level"])
@pytest.mark.parametrize("part", ["first", "second"])
def test_fused_norm_of_full_rows_at_the_largest_level_sums(part, deep):
    """Rows of CHUNK elements whose level sums are as large as the int64 bounds allow: every
    square just below 2^46 units of the first level, or every first remainder just below half
    that unit, of one sign (2^47 units of the second level). A level one field too coarse, or
    levels further apart, overflows int64 here (random grads never come near)."""
    assert (HALF_BELOW * HALF_BELOW) % 2**26 == 2**25 - 15
    if part == "first":  # field 127, the largest mantissa: square = (2^24 - 1)^2 units / 4
        bits = np.full(K.CHUNK, 0x3FFFFFFF)
    else:  # field 115: square / unit of field 128 = HALF_BELOW^2 / 2^26, just below k + 1/2
        bits = np.full(K.CHUNK, (115 << 23) | (HALF_BELOW - 2**23))
        bits[::SUB] = 0x3F800000  # 1.0 in every sub-block: the first level at field 128
    if deep:
        bits[1::SUB] = 1  # 2^-149 in every sub-block: every level down to field 1
    _assert_refgrads(_fp32(bits), _rows(K.CHUNK, [], [1]))


def test_fused_norm_counts_nonfinite_in_and_out_of_the_norm_and_sums_the_rest():
    g = _mixed(4 * SUB, 1e-20, 1e20)
    g[[3, SUB + 9, 3 * SUB]] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    work = _rows(g.numel(), [2 * SUB], [1, 0])  # the third NaN/inf is in a row out of the norm
    assert _kernel_sum(g, work, None)[1] == 3
    _assert_refgrads(g, work)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_norm_of_16_bit_grads_is_refgrads_exact_sum(dtype):
    info = torch.finfo(dtype)
    g = _mixed(2 * SUB + 5, float(info.max), float(info.tiny * info.eps), float(info.tiny)).to(dtype)
    g[SUB:] *= 2.0**-20
    _assert_refgrads(g, _rows(g.numel(), [SUB + 3], [1]), None if dtype == torch.bfloat16 else 2.0**-10)


def test_fused_norm_is_the_same_for_every_row_split_and_thread_count(monkeypatch):
    g = _mixed(3 * K.CHUNK + 11, 2.0**100, 2.0**-140) * torch.exp2(
        torch.randint(-60, 4, (3 * K.CHUNK + 11,), generator=torch.Generator().manual_seed(1)).float())
    want = _refgrad_sum(g, _rows(g.numel(), [], [1]), None)
    for threads in (1, 2, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        for cuts in ([], [1], [SUB - 1, K.CHUNK + SUB + 1], list(range(7, g.numel(), 5000))):
            assert _kernel_sum(g, _rows(g.numel(), cuts, [1]), None) == want, (threads, cuts)


class _Weights(torch.nn.Module):
    """``forward(c) = sum(w * c)``: the grads are the given tensors, exactly."""

    def __init__(self, sizes: list[int], gen: torch.Generator) -> None:
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n, generator=gen))
                                          for n in sizes])

    def forward(self, coeffs):
        return sum((w * c).sum() for w, c in zip(self.ws, coeffs))


def test_clipped_step_on_wide_range_grads_is_refgrads_norm_and_update():
    """The optimizer's clipped step where the norm takes every path (levels, deep levels, one
    sub-block element by element): the norm and the clipped update bitwise refgrad's."""
    gen = torch.Generator().manual_seed(0)
    sizes = [SUB + 300, 2 * SUB - 7, 500]
    model = _Weights(sizes, gen)
    ddp = DistributedDataParallel(model, config=DDPConfig(use_distributed_optimizer=True,
                                                          bucket_size=sum(sizes) + 1))
    hyper = R.AdamW(lr=1e-3, weight_decay=0.1)
    opt = DistributedOptimizer(ddp, AdamWConfig(lr=1e-3, weight_decay=0.1), max_grad_norm=1.0)
    assert isinstance(opt.path, FusedCpuPath)
    states = [R.ParamState(master=R.values(w)) for w in model.ws]
    for step in (1, 2):
        grads = [torch.randn(n, generator=gen)
                 * torch.exp2(torch.randint(-70, 10, (n,), generator=gen).float()) for n in sizes]
        grads[0][[0, 1]] = torch.tensor([2.0**80, 2.0**-149])  # every level in one sub-block
        grads[1][5] = 2.0**127  # one sub-block element by element (field 254)
        ddp.zero_grad_buffer()
        model(grads).backward()
        ddp.finish_grad_sync()
        result = opt.step()
        stepped, norm = R.optimizer_step(states, grads, [hyper] * 3, [step] * 3, max_norm=1.0)
        assert stepped and result.stepped and result.clip_coefficient < 1
        assert result.grad_norm == float(norm) and math.isfinite(result.grad_norm)
        opt.finish_param_sync()
        for w, state in zip(model.ws, states):
            want = R.to_tensor(state.master, w.shape)
            assert_bitwise_equal(w.detach().view(torch.int32), want.view(torch.int32), msg=str(step))

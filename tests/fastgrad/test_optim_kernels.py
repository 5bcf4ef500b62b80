"""fastgrad.optim's elementwise kernels, block by block, against refgrad's exact arithmetic.

The square root is fp64's, rounded to fp32 (innocuous double rounding:
53 >= 2*24 + 2); the AdamW update works in cache-sized blocks; the exact
norm bins squares by exponent. Each must give refgrad's bits.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from fastgrad.optim import AdamWConfig
from fastgrad.optim.norm import BLOCK as NORM_BLOCK
from fastgrad.optim.norm import limbs_to_fraction, local_square_limbs
from fastgrad.optim.update import BLOCK, adamw_update_, sqrt_fp32
from refgrad import formats
from refgrad import optim as R


def _fp32_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _sqrt_inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    random_bits = torch.randint(0, 0x7F800000, (3000,), generator=g).tolist()  # all finite >= 0
    subnormal = [1, 2, 3, 0x7FFFFF, 0x400000, 0x12345]
    extremes = [0, 0x00800000, 0x00800001, 0x7F7FFFFF, 0x7F7FFFFE, 0x3F800000, 0x3F800001, 0x3F7FFFFF]
    values = _fp32_from_bits(random_bits + subnormal + extremes)
    squares = torch.arange(0, 4097, dtype=torch.float32) ** 2  # exact squares
    # inputs next to the squares of midpoints of adjacent fp32 values (the rounding boundaries)
    base = _fp32_from_bits(torch.randint(0x00800000, 0x5F000000, (500,), generator=g).tolist())
    above = torch.nextafter(base, torch.full_like(base, float("inf")))
    mid_sq = ((base.double() + above.double()) / 2) ** 2  # exact in fp64 (50 bits)
    near = mid_sq.float()
    near = torch.cat([near, torch.nextafter(near, torch.zeros_like(near)),
                      torch.nextafter(near, torch.full_like(near, float("inf")))])
    return torch.cat([values, squares, near[torch.isfinite(near)]])


def test_sqrt_fp32_is_refgrads_correctly_rounded_sqrt():
    x = _sqrt_inputs()
    got = sqrt_fp32(x)
    want = R.to_tensor([R.sqrt_rounded(formats.FLOAT32, v) for v in R.values(x)], x.shape)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("weight_decay,step", [(0.1, 1), (0.0, 3)])
def test_blocked_adamw_update_matches_refgrad_across_block_edges(weight_decay, step):
    n = 2 * BLOCK + 37  # three blocks, the last partial
    g = torch.Generator().manual_seed(step)
    scale = torch.exp2(torch.randint(-20, 4, (4, n), generator=g).float())
    p, grad, m, v = torch.randn(4, n, generator=g) * scale
    v = v.abs()
    cfg = AdamWConfig(lr=1e-3, weight_decay=weight_decay)
    new = [t.clone() for t in (p, grad, m, v)]
    adamw_update_(new[0], new[1], new[2], new[3], cfg, step)
    edges = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, n - 1]
    picked = sorted(set(edges + torch.randint(0, n, (200,), generator=g).tolist()))
    s = R.adamw_scalars(R.AdamW(lr=1e-3, weight_decay=weight_decay), step)
    for i in picked:
        want = R.adamw_element(*(Fraction(float(t[i])) for t in (p, grad, m, v)), s)
        got = (Fraction(float(new[0][i])), Fraction(float(new[2][i])), Fraction(float(new[3][i])))
        assert got == want, i


def test_binned_norm_is_exact_over_blocks_subnormals_and_extremes():
    g = torch.Generator().manual_seed(5)
    n = 3 * NORM_BLOCK + 11
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-150, 127, (n,), generator=g).float())
    x = x[torch.isfinite(x)]
    x[:6] = _fp32_from_bits([1, 0x7FFFFF, 0x00800000, 0x7F7FFFFF, 0x80000001, 0xFF7FFFFF])
    limbs, nonfinite = local_square_limbs([x[:1000], x[1000:]])
    want = sum(Fraction(v) ** 2 for v in x.double().tolist())
    assert nonfinite == 0
    assert limbs_to_fraction(limbs) == want
    assert local_square_limbs([x])[0] == limbs

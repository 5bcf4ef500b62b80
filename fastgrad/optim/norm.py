"""Exact, partition-independent sum of squares of fp32 gradients.

Every fp32 value is ``m * 2^e`` with an integer ``m < 2^24`` and
``-149 <= e <= 104``, so its square is the integer ``m^2 < 2^48`` at bit
position ``2e + 298 >= 0`` of one big fixed-point integer. Each square is
split into three 32-bit pieces added into int64 *limbs* (limb ``k`` weighs
``2^(32k - 298)``). Integer addition is associative, so the limbs summed
locally and then ``all_reduce(SUM)``-ed over any set of ranks give the same
integer whatever the partition or order; it is rounded once, to fp64, at the
end (``float(Fraction)`` is correctly rounded). ``refgrad.optim`` computes the
same sum with Fractions.
"""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction

import torch

LIMB_BITS = 32
NUM_LIMBS = 20  # squares reach bit 2*104 + 298 + 48 = 554; 20 * 32 = 640 leaves room for carries
SCALE_EXPONENT = 298  # the sum is (integer) * 2^-298
CHUNK = 1 << 26  # elements per pass: 3 * 2^26 * 2^32 < 2^63, no int64 overflow
_MASK = (1 << LIMB_BITS) - 1


def _normalize(limbs: list[int]) -> list[int]:
    """Carry-propagate so every limb is < 2^32 (the value is unchanged)."""
    total = sum(v << (LIMB_BITS * k) for k, v in enumerate(limbs))
    out = [(total >> (LIMB_BITS * k)) & _MASK for k in range(NUM_LIMBS)]
    if total >> (LIMB_BITS * NUM_LIMBS):
        raise OverflowError("sum of squares exceeds the limb range")
    return out


def local_square_limbs(tensors: Iterable[torch.Tensor]) -> tuple[list[int], int]:
    """(normalized limbs of the exact sum of squares, count of NaN/inf elements)."""
    limbs = [0] * NUM_LIMBS
    nonfinite = 0
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        if flat.dtype != torch.float32:
            raise TypeError(f"expected fp32 grads, got {flat.dtype}")
        for start in range(0, flat.numel(), CHUNK):
            bits = flat[start : start + CHUNK].view(torch.int32).to(torch.int64) & 0x7FFFFFFF
            field = bits >> 23
            nonfinite += int((field == 255).sum())
            frac = bits & 0x7FFFFF
            mant = torch.where(field > 0, frac | 0x800000, frac)
            mant = torch.where(field == 255, torch.zeros_like(mant), mant)
            exponent = torch.where(field > 0, field, torch.ones_like(field)) - 150
            square = mant * mant  # exact, < 2^48
            position = 2 * exponent + SCALE_EXPONENT
            limb, shift = position >> 5, position & 31
            low = (square & _MASK) << shift  # < 2^63
            high = (square >> LIMB_BITS) << shift  # < 2^47
            acc = torch.zeros(NUM_LIMBS + 2, dtype=torch.int64, device=flat.device)
            acc.index_add_(0, limb, low & _MASK)
            acc.index_add_(0, limb + 1, (low >> LIMB_BITS) + (high & _MASK))
            acc.index_add_(0, limb + 2, high >> LIMB_BITS)
            limbs = _normalize([a + b for a, b in zip(limbs, acc.tolist()[:NUM_LIMBS])])
    return limbs, nonfinite


def limbs_to_fraction(limbs: Iterable[int]) -> Fraction:
    """The exact sum of squares the limbs encode."""
    total = sum(int(v) << (LIMB_BITS * k) for k, v in enumerate(limbs))
    return Fraction(total, 1 << SCALE_EXPONENT)

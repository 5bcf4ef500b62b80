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
BLOCK = 1 << 15  # elements per pass: temporaries stay in L2; 2^15 squares < 2^48 sum below 2^63
HALF_BITS = 24  # squares (< 2^48) are split into two 24-bit halves before summing
MAX_ELEMENTS = 1 << 38  # running bins gain < 2^39 per block: 2^23 blocks stay below 2^63
_MASK = (1 << LIMB_BITS) - 1
_EXPONENT_FIELDS = 256


def _normalize(limbs: list[int]) -> list[int]:
    """Carry-propagate so every limb is < 2^32 (the value is unchanged)."""
    total = sum(v << (LIMB_BITS * k) for k, v in enumerate(limbs))
    out = [(total >> (LIMB_BITS * k)) & _MASK for k in range(NUM_LIMBS)]
    if total >> (LIMB_BITS * NUM_LIMBS):
        raise OverflowError("sum of squares exceeds the limb range")
    return out


def _bins_to_integer(low_bins: list[int], high_bins: list[int]) -> int:
    """The exact sum (in units of 2^-298) of per-exponent-field bins of square halves.

    An fp32 value with exponent field ``f`` is ``m * 2^(max(f, 1) - 150)``, so the
    square's integer ``m^2`` sits at bit ``2 * (max(f, 1) - 150) + 298``. Field 255
    (NaN/inf) is left out.
    """
    total = 0
    for field in range(_EXPONENT_FIELDS - 1):
        square_sum = low_bins[field] + (high_bins[field] << HALF_BITS)
        if square_sum:
            total += square_sum << (2 * (max(field, 1) - 150) + SCALE_EXPONENT)
    return total


def limbs_from_bins(low_bins: list[int], high_bins: list[int]) -> list[int]:
    """Normalized limbs of per-exponent-field bins of square halves (see ``_bins_to_integer``);
    the fused CPU kernels (``cpu_kernels.square_bins``) produce such bins."""
    return _normalize([_bins_to_integer(low_bins, high_bins)])


def local_square_limbs(tensors: Iterable[torch.Tensor]) -> tuple[list[int], int]:
    """(normalized limbs of the exact sum of squares, count of NaN/inf elements).

    Squares are binned by exponent field: per block, the integer mantissa squares
    (exact in int64) are scatter-added into 256 per-field int64 bins (no overflow:
    2^15 * 2^48 < 2^63), whose 24-bit halves are added into running bins; those
    are shifted into place once, with Python integers, at the end. Integer sums are associative, so the result does not
    depend on the blocking or the order.
    """
    tensors = list(tensors)
    low = high = None
    count = 0
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        if flat.dtype != torch.float32:
            raise TypeError(f"expected fp32 grads, got {flat.dtype}")
        count += flat.numel()
        if count > MAX_ELEMENTS:
            raise OverflowError(f"more than 2^38 elements in one exact norm ({count})")
        if low is None:
            low = torch.zeros(_EXPONENT_FIELDS, dtype=torch.int64, device=flat.device)
            high = torch.zeros_like(low)
            block_bins = torch.zeros_like(low)
        for start in range(0, flat.numel(), BLOCK):
            bits = flat[start : start + BLOCK].view(torch.int32) & 0x7FFFFFFF
            field = bits >> 23
            # normal: (1 << 23) | fraction; subnormal (field 0): the fraction alone
            mant = bits.sub_((field - 1).clamp_(min=0) << 23).to(torch.int64)
            square = mant.mul_(mant)  # exact, < 2^48
            field = field.to(torch.int64)
            block_bins.zero_().index_add_(0, field, square)
            low += block_bins & ((1 << HALF_BITS) - 1)
            high += block_bins >> HALF_BITS
    if low is None:
        return [0] * NUM_LIMBS, 0
    low_list, high_list = low.tolist(), high.tolist()
    nonfinite = 0
    if low_list[-1] or high_list[-1]:  # NaN/inf squares (mantissa >= 2^23) landed in field 255
        nonfinite = sum(int((~torch.isfinite(t)).sum()) for t in tensors)
    return limbs_from_bins(low_list, high_list), nonfinite


def limbs_to_fraction(limbs: Iterable[int]) -> Fraction:
    """The exact sum of squares the limbs encode."""
    total = sum(int(v) << (LIMB_BITS * k) for k, v in enumerate(limbs))
    return Fraction(total, 1 << SCALE_EXPONENT)

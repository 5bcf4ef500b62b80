"""The exact references of ``verify accumulation``: the exact column sum and its correct rounding.

The correctly rounded value is always exact (``verify.oracle``). To keep the
oracle's input small, rows are summed in float64 where that is provably exact
(:func:`float64_sum_is_exact`), in groups of at most ``EXACT_GROUP_ROWS`` rows;
each exact group sum is split into three float32 parts with the same exact sum,
and the oracle rounds the ``3 * groups`` parts once. Columns where a group's
float64 sum is not provably exact go to the oracle with all W rows.
"""

from __future__ import annotations

import math

import torch

from refgrad.formats import tensor_bit_patterns
from verify.oracle import correctly_rounded_sum

# fp16 values are multiples of 2^-24 below 2^16: float64 sums up to 2^13 of them exactly.
EXACT_GROUP_ROWS = 2**13
_BF16_EXPONENT_NONE = 255  # above every finite exponent field: "no nonzero element"


def float64_sum_is_exact(stacked: torch.Tensor) -> torch.Tensor:
    """Per column: True where summing the column in float64, in any order, is exact.

    A column whose nonzero elements are integer multiples of a quantum ``q`` and
    below ``M`` in magnitude has every partial sum an integer multiple of ``q``
    below ``W·M``; when ``W·M/q <= 2^53`` each partial sum is a float64 number,
    so every IEEE addition returns it exactly. fp16: ``q >= 2^-24`` and
    ``M <= 2^16``, so every column qualifies for ``W <= 2^13``. bf16: ``q`` and
    ``M`` are read per column from the exponent fields (in int16: the bit
    patterns are never widened). Other dtypes: no column.
    """
    world_size, columns = stacked.shape
    log2_w = max(0, math.ceil(math.log2(world_size)))
    if stacked.dtype == torch.float16:
        return torch.full((columns,), 40 + log2_w <= 53, dtype=torch.bool, device=stacked.device)
    if stacked.dtype != torch.bfloat16:
        return torch.zeros(columns, dtype=torch.bool, device=stacked.device)
    bits = stacked.view(torch.int16) & 0x7FFF  # sign cleared: nonnegative int16
    exponent = bits >> 7  # biased exponent field; 0 for zeros and subnormals
    # x (nonzero) is a multiple of 2^(max(e,1)-134) and below 2^(e-126); zeros constrain nothing.
    quantum_exp = torch.where(bits == 0, _BF16_EXPONENT_NONE, exponent.clamp(min=1)).amin(dim=0)
    top_exp = exponent.amax(dim=0)
    return (top_exp < 255) & (top_exp.int() - quantum_exp.int() + 8 + log2_w <= 53)


def _split_into_three_float32(exact64: torch.Tensor) -> torch.Tensor:
    """``[3, n]`` float32 ``(a, b, c)`` with ``a + b + c == x`` exactly, for finite float64 x
    with |x| < 2^127 holding at most 53 significant bits above 2^-149 (checked)."""
    a = exact64.to(torch.float32)
    rest = exact64 - a.to(torch.float64)  # exact: x and a agree to within half an fp32 ulp of x
    b = rest.to(torch.float32)
    rest = rest - b.to(torch.float64)
    c = rest.to(torch.float32)
    # a value test (the remainder is zero), not a bitwise one: -0 would be as exact as +0
    if not torch.equal(rest - c.to(torch.float64), torch.zeros_like(rest)):
        raise ArithmeticError("float64 -> 3 x float32 split was not exact")
    # A -0 sum must stay -0: IEEE gives -0 only when every addend is -0.
    zero = a == 0
    return torch.stack([a, torch.where(zero, a, b), torch.where(zero, a, c)])


def _float64_column_sum(stacked: torch.Tensor) -> torch.Tensor:
    """Column sums in float64, -0 where every addend is -0 (as IEEE addition gives)."""
    sums = stacked.sum(dim=0, dtype=torch.float64)
    zero = sums == 0
    if bool(zero.any()):
        # torch's sum starts from +0, but IEEE makes a sum of only -0 addends -0.
        negative_zero_bits = 1 << (8 * stacked.element_size() - 1)
        all_negative_zero = (tensor_bit_patterns(stacked[:, zero]) == negative_zero_bits).all(dim=0)
        sums[zero] = torch.where(all_negative_zero, -0.0, 0.0).to(torch.float64)
    return sums


def _exact_parts(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(float64 column sum, columns whose group sums are all exact, per-group float64 sums)."""
    world_size = stacked.shape[0]
    group_sums, fast = [], None
    for start in range(0, world_size, EXACT_GROUP_ROWS):
        group = stacked[start : start + EXACT_GROUP_ROWS]
        sums = _float64_column_sum(group)
        group_fast = float64_sum_is_exact(group) & (sums.abs() < 2.0**127)
        fast = group_fast if fast is None else fast & group_fast
        group_sums.append(sums)
    total = group_sums[0].clone()
    for sums in group_sums[1:]:
        total.add_(sums)  # -0 + -0 stays -0; exact only with one group
    return total, fast, group_sums


def _parts_from_group_sums(stacked: torch.Tensor, group_sums: torch.Tensor,
                           group_exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`_exact_parts` from group sums computed elsewhere (the sweep's kernels): the
    same bits. Where a group's sum is exact its order does not matter; elsewhere the
    columns are summed again here, in torch's order, as :func:`_exact_parts` sums them."""
    fast = group_exact.all(dim=0)
    sums = group_sums
    slow = ~fast
    if bool(slow.any()):
        sums = group_sums.clone()
        for g, start in enumerate(range(0, stacked.shape[0], EXACT_GROUP_ROWS)):
            sums[g, slow] = _float64_column_sum(stacked[start : start + EXACT_GROUP_ROWS, slow])
    total = sums[0].clone()
    for group in sums[1:]:
        total.add_(group)
    return total, fast, list(sums)


def exact_references(stacked: torch.Tensor, group_sums: torch.Tensor | None = None,
                     group_exact: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum as float64, correctly rounded sum in the wire dtype), per column.

    The correctly rounded value is always exact. With at most ``EXACT_GROUP_ROWS``
    rows the float64 sum is exact wherever :func:`float64_sum_is_exact` holds;
    beyond that it is the float64 sum of exact group sums. Elsewhere (used only
    for the normwise error) it has error at most (W-1)·2^-53·sum|x|, ~10^10 below
    the errors measured here. ``group_sums`` and ``group_exact`` ([groups, columns]:
    each group's float64 sum and whether it is exact, as ``kernels.reduce_block``
    gives them) save summing the block again.
    """
    if group_sums is None or group_exact is None:
        exact64, fast, group_sums = _exact_parts(stacked)
    else:
        exact64, fast, group_sums = _parts_from_group_sums(stacked, group_sums, group_exact)
    if bool(fast.all()):
        parts = torch.cat([_split_into_three_float32(s) for s in group_sums])
        return exact64, correctly_rounded_sum(parts, stacked.dtype)
    rounded = torch.empty(exact64.shape, dtype=stacked.dtype, device=stacked.device)
    if bool(fast.any()):
        parts = torch.cat([_split_into_three_float32(s[fast]) for s in group_sums])
        rounded[fast] = correctly_rounded_sum(parts, stacked.dtype)
    slow = ~fast
    if bool(slow.any()):
        rounded[slow] = correctly_rounded_sum(stacked[:, slow], stacked.dtype)
    return exact64, rounded

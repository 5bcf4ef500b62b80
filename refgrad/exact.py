"""Exact sums and the correctly rounded sum: the oracle every other result is judged by.

Every finite binary floating-point value is a dyadic rational, so a sum of them
is computed here exactly with :class:`fractions.Fraction` and then rounded once,
to nearest with ties to even, by :func:`refgrad.formats.round_to_bits`. Nothing
else rounds.

IEEE 754 rules for the values that are not plain numbers (applied by
:func:`ieee_sum`):

- any NaN, or both +inf and -inf, gives NaN;
- otherwise an infinity wins, with its sign;
- a sum whose terms are all -0 is -0; any other exact zero is +0
  (the empty sum is +0);
- a finite exact sum that rounds beyond the largest finite value follows the
  target format's overflow policy (``refgrad.formats``; ``"inf"`` for
  float32/float16/bfloat16 by default).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fractions import Fraction

import torch

from refgrad.formats import Special, Value, decode_tensor, format_of, round_values_to_tensor

__all__ = ["correctly_rounded_sum", "exact_sum", "ieee_sum"]


def _is_exact_number(value: object) -> bool:
    return isinstance(value, Fraction | int) and not isinstance(value, bool)


def exact_sum(values: Iterable[Fraction | int]) -> Fraction:
    """The exact sum of finite rational values (Fraction or int); the empty sum is 0."""
    total = Fraction(0)
    for index, value in enumerate(values):
        if not _is_exact_number(value):
            raise TypeError(
                f"values[{index}] must be a Fraction or an int (an exact finite number), "
                f"got {type(value).__name__}; use ieee_sum for NaN, inf and -0"
            )
        total += value
    return total


def ieee_sum(values: Iterable[Value | int]) -> Value:
    """The exact sum of exact values, with IEEE 754 rules for NaN, infinities and signed zero.

    Returns a Fraction (``Fraction(0)`` is +0) or a :class:`Special`; see the
    module docstring for the rules. Nothing is rounded.
    """
    saw_nan = saw_pos_inf = saw_neg_inf = False
    only_negative_zeros = True
    saw_any = False
    total = Fraction(0)
    for index, value in enumerate(values):
        saw_any = True
        if value is Special.NAN:
            saw_nan = True
        elif value is Special.POS_INF:
            saw_pos_inf = True
        elif value is Special.NEG_INF:
            saw_neg_inf = True
        elif value is Special.NEG_ZERO:
            pass  # adds nothing, and keeps an all -0 sum negative
        elif _is_exact_number(value):
            total += value
            only_negative_zeros = False
        else:
            raise TypeError(
                f"values[{index}] must be a Fraction, an int or a refgrad.formats.Special, "
                f"got {type(value).__name__}"
            )
    if saw_nan or (saw_pos_inf and saw_neg_inf):
        return Special.NAN
    if saw_pos_inf:
        return Special.POS_INF
    if saw_neg_inf:
        return Special.NEG_INF
    if total == 0:
        return Special.NEG_ZERO if saw_any and only_negative_zeros else Fraction(0)
    return total


def correctly_rounded_sum(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype, overflow: str | None = None
) -> torch.Tensor:
    """Elementwise sum across ``tensors``, rounded once (nearest, ties to even) to ``dtype``.

    ``tensors`` is a non-empty sequence of same-shape tensors (for example one per
    rank) whose dtypes are formats known to ``refgrad.formats``; they may differ.
    Output element ``i`` is ``ieee_sum`` of element ``i`` of every tensor, rounded
    to ``dtype``; ``overflow`` is the policy of ``refgrad.formats.round_to_bits``
    (``None``: the format's default). The result lives on the first tensor's device.
    """
    if isinstance(tensors, torch.Tensor):
        raise TypeError(
            "tensors must be a sequence of tensors (one per rank), not a single tensor; "
            "pass list(stacked) to sum over the first dimension"
        )
    tensors = list(tensors)
    if not tensors:
        raise ValueError("tensors must contain at least one tensor")
    for index, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{index}] must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != tensors[0].shape:
            raise ValueError(
                f"tensors must all have the same shape: tensors[{index}] has shape "
                f"{tuple(t.shape)}, tensors[0] has {tuple(tensors[0].shape)}"
            )
    target = format_of(dtype)
    columns = zip(*(decode_tensor(t) for t in tensors))
    sums = [ieee_sum(column) for column in columns]
    result = round_values_to_tensor(target, sums, tuple(tensors[0].shape), overflow)
    return result.to(tensors[0].device)

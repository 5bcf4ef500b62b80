"""Reference semantics of reduce-scatter and all-reduce over a list of per-rank tensors.

Everything is exact arithmetic on decoded values (``refgrad.formats``), and every
rounding is one visible call to ``refgrad.formats.round_to_value``. Adding two
values is ``round_to_value(fmt, ieee_sum([a, b]))``: the exact IEEE sum
(NaN, +-inf and the sign of zero handled by ``refgrad.exact.ieee_sum``) rounded
once, which is the definition of IEEE addition.

Options:

* ``accumulate="wire"``: the partial sum is rounded to the input dtype after
  every addition (NCCL's reduction in the wire dtype).
* ``accumulate="fp32"``: the partial sum is rounded to fp32 after every addition
  and to the input dtype once at the end (production's all-to-all algorithm).
* ``order="ring"``: the chunk that ends on rank c (rank c's output) is
  accumulated starting from rank c+1 around the ring to rank c:
  ``((x[c+1] + x[c+2]) + ...) + x[c]`` (indices mod W), as in NCCL's ring.
* ``order="ring_reverse"``: the ring run the other way (each rank sends to
  rank - 1, as gloo's ring does): the chunk that ends on rank c is accumulated
  from rank c-1 down to rank c: ``((x[c-1] + x[c-2]) + ...) + x[c]``.
* ``order="gloo_ring"``: gloo's ring all-reduce as it cuts the buffer
  (``gloo/allreduce.cc``, ring: ``2W`` segments of ``ceil(numel / 2W)`` elements, rank
  ``c`` owning segments ``2c`` and ``2c + 1``, the ranks accumulated as ``ring_reverse``):
  element ``j`` is summed in ``ring_reverse``'s order of the chunk
  ``j // (2 * ceil(numel / 2W))``. The same as ``ring_reverse`` when ``2W`` divides the
  numel; gloo's reduce-scatter is this all-reduce, then each rank's ``numel / W`` chunk.
* ``order="rank"``: ``((x[0] + x[1]) + ...) + x[W-1]``.
* ``order="tree"``: pairwise: ranks are summed in adjacent pairs
  ``(x[0]+x[1]), (x[2]+x[3]), ...``, an odd one out passed up unchanged, level by
  level until one value remains.
* ``op=Averaging.AVG``: the final accumulator is divided by W in the accumulator's precision
  (one rounding) before the final rounding to the input dtype; ``Averaging.SUM`` the default.
  ``op`` must be the type (its string ``"avg"`` is refused: one spelling everywhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import torch

from gradvocab import Averaging
from refgrad import formats
from refgrad.exact import ieee_sum

ACCUMULATE_MODES = ("wire", "fp32")
ORDERS = ("ring", "ring_reverse", "gloo_ring", "rank", "tree")
# The collective's own ops, as gradvocab's Averaging (equal to the names "sum" and "avg"):
# how a pre- or post-scale is applied around them is the caller's, not the collective's.
OPS = (Averaging.SUM, Averaging.AVG)


def ring_order(world_size: int, chunk: int, *, reverse: bool = False) -> list[int]:
    """Ranks in the order the ring accumulates the chunk that ends on rank ``chunk``.

    Forward (NCCL: rank r sends to r+1): chunk+1, chunk+2, ..., chunk.
    Reverse (rank r sends to r-1): chunk-1, chunk-2, ..., chunk.
    """
    if reverse:
        return [(chunk - 1 - step) % world_size for step in range(world_size)]
    return [(chunk + 1 + step) % world_size for step in range(world_size)]


def add(fmt: formats.FloatFormat, a: formats.Value, b: formats.Value) -> formats.Value:
    """IEEE addition in ``fmt``: the exact sum, rounded once."""
    return formats.round_to_value(fmt, ieee_sum([a, b]))


def divide(fmt: formats.FloatFormat, value: formats.Value, divisor: int) -> formats.Value:
    """IEEE division of ``value`` by a positive integer in ``fmt``: exact quotient, rounded once."""
    if isinstance(value, formats.Special):
        return value  # NaN / W = NaN, +-inf / W = +-inf, -0 / W = -0
    return formats.round_to_value(fmt, Fraction(value) / divisor)


def accumulate_values(
    values: Sequence[formats.Value],
    *,
    wire: formats.FloatFormat,
    accumulate: str,
    tree: bool,
    average_by: int | None = None,
) -> formats.Value:
    """Reduce ``values`` (already in the order to add them) with the given rounding rules."""
    acc_fmt = wire if accumulate == "wire" else formats.FLOAT32
    if tree:
        level = list(values)
        while len(level) > 1:
            paired = [add(acc_fmt, level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
            if len(level) % 2:
                paired.append(level[-1])
            level = paired
        total = level[0]
    else:
        total = values[0]
        for value in values[1:]:
            total = add(acc_fmt, total, value)
    if average_by is not None:
        total = divide(acc_fmt, total, average_by)
    # A 16-bit value is exact in fp32, so with accumulate="wire" this rounding is the identity.
    return formats.round_to_value(wire, total)


def _validate(per_rank_inputs: Sequence[torch.Tensor], accumulate: str, order: str, op: Averaging):
    if isinstance(per_rank_inputs, torch.Tensor) or not isinstance(per_rank_inputs, Sequence):
        raise TypeError("per_rank_inputs must be a sequence of tensors, one per rank")
    if len(per_rank_inputs) == 0:
        raise ValueError("per_rank_inputs must hold at least one tensor (one per rank)")
    for i, t in enumerate(per_rank_inputs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"per_rank_inputs[{i}] must be a torch.Tensor, got {type(t).__name__}")
    first = per_rank_inputs[0]
    for i, t in enumerate(per_rank_inputs):
        if t.dtype != first.dtype:
            raise TypeError(
                f"per_rank_inputs[{i}].dtype is {t.dtype}, but rank 0's is {first.dtype}"
            )
        if t.shape != first.shape:
            raise ValueError(
                f"per_rank_inputs[{i}].shape is {tuple(t.shape)}, "
                f"but rank 0's is {tuple(first.shape)}"
            )
    if accumulate not in ACCUMULATE_MODES:
        raise ValueError(f"accumulate must be one of {ACCUMULATE_MODES}, got {accumulate!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    # The type, not its string: one rule for every averaging argument in refgrad (as
    # refgrad.pipeline.reduction.check_reduction), so no caller keeps a second spelling.
    if not isinstance(op, Averaging) or op not in OPS:
        raise ValueError(f"op must be one of Averaging.SUM, Averaging.AVG, got {op!r}")
    return formats.format_of(first.dtype)


def _reduce_chunks(
    per_rank_inputs: Sequence[torch.Tensor],
    accumulate: str,
    order: str,
    op: Averaging,
    *,
    scatter: bool,
) -> tuple[formats.FloatFormat, list[list[formats.Value]]]:
    wire = _validate(per_rank_inputs, accumulate, order, op)
    world_size = len(per_rank_inputs)
    numel = per_rank_inputs[0].numel()
    ring = order in ("ring", "ring_reverse")
    if (scatter or ring) and numel % world_size != 0:
        what = "a reduce-scatter" if scatter else "a ring all-reduce"
        raise ValueError(
            f"each input's numel ({numel}) must be divisible by the number of ranks "
            f"({world_size}) for {what}"
        )
    # Only the ring's order depends on the chunk; other orders treat the tensor as one chunk.
    chunks_count = world_size if (scatter or ring) else 1
    chunk_numel = numel // chunks_count
    decoded = [formats.decode_tensor(t.detach().cpu().contiguous()) for t in per_rank_inputs]
    average_by = world_size if op == Averaging.AVG else None
    gloo_chunk = 2 * -(-numel // (2 * world_size))  # two of gloo's segments per rank
    chunks = []
    for chunk in range(chunks_count):
        if ring:
            ranks = ring_order(world_size, chunk, reverse=order == "ring_reverse")
        else:
            ranks = list(range(world_size))
        results = []
        for j in range(chunk * chunk_numel, (chunk + 1) * chunk_numel):
            if order == "gloo_ring":
                ranks = ring_order(world_size, j // gloo_chunk, reverse=True)
            results.append(
                accumulate_values(
                    [decoded[r][j] for r in ranks],
                    wire=wire,
                    accumulate=accumulate,
                    tree=order == "tree",
                    average_by=average_by,
                )
            )
        chunks.append(results)
    return wire, chunks


def reduce_scatter(
    per_rank_inputs: Sequence[torch.Tensor],
    *,
    accumulate: str,
    order: str,
    op: Averaging = Averaging.SUM,
) -> list[torch.Tensor]:
    """Rank c's output: chunk c (of W equal chunks of the flattened inputs), reduced over ranks.

    Returns W one-dimensional tensors of ``numel // W`` elements in the inputs' dtype.
    """
    wire, chunks = _reduce_chunks(per_rank_inputs, accumulate, order, op, scatter=True)
    return [formats.round_values_to_tensor(wire, values, (len(values),)) for values in chunks]


def all_reduce(
    per_rank_inputs: Sequence[torch.Tensor],
    *,
    accumulate: str,
    order: str,
    op: Averaging = Averaging.SUM,
) -> list[torch.Tensor]:
    """Every rank's output: the whole reduced tensor (input shape).

    With a ring order this is a ring reduce-scatter (numel divisible by W)
    followed by an all-gather, which adds no rounding; other orders reduce every
    element in the same order and accept any numel.
    """
    wire, chunks = _reduce_chunks(per_rank_inputs, accumulate, order, op, scatter=False)
    shape = tuple(per_rank_inputs[0].shape)
    values = [v for chunk in chunks for v in chunk]
    return [formats.round_values_to_tensor(wire, values, shape) for _ in per_rank_inputs]


def prescale_like_torch(per_rank_inputs: Sequence[torch.Tensor], factor: float) -> list[torch.Tensor]:
    """Production's averaging pre-scale ``grad *= 1/W`` on a 16-bit tensor, as torch computes it.

    torch multiplies a 16-bit tensor by a Python float in fp32 ("opmath"): the
    factor is rounded to fp32, the product rounded to fp32, then to the tensor's
    dtype. Three visible roundings; exact only when the factor is a power of two
    and nothing underflows.
    """
    if not per_rank_inputs:
        raise ValueError("per_rank_inputs must hold at least one tensor (one per rank)")
    factor32 = formats.round_to_value(formats.FLOAT32, Fraction(factor))
    outputs = []
    for t in per_rank_inputs:
        wire = formats.format_of(t.dtype)
        scaled = []
        for value in formats.decode_tensor(t.detach().cpu().contiguous()):
            product = _multiply_exact(value, factor32)
            scaled.append(formats.round_to_value(wire, formats.round_to_value(formats.FLOAT32, product)))
        outputs.append(formats.round_values_to_tensor(wire, scaled, tuple(t.shape)))
    return outputs


def _multiply_exact(value: formats.Value, factor: formats.Value) -> formats.Value:
    """Exact product of a value and a positive finite factor, with IEEE specials."""
    if not isinstance(factor, Fraction) or factor <= 0:
        raise ValueError(f"factor must round to a positive finite fp32 value, got {factor!r}")
    if isinstance(value, formats.Special):
        return value  # NaN, +-inf and -0 keep their identity under a positive factor
    return value * factor

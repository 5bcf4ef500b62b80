"""Compiled (numba) reductions of ``verify accumulation``: every model in one pass per block.

The torch models (``models``) issue O(W) calls per block; at DP 65,536 a compute
block is only 512 columns wide, so the sweep spent its time in call overhead.
These kernels run the same reductions with the rank loop inside compiled code,
reading the 16-bit bits of a ``[W, columns]`` block once per model:

* ``ring``: NCCL's ring (chunk ``c`` from rank ``c + first_chunk + 1`` around),
  rounding to the wire dtype after every hop;
* ``tree``: pairwise, level by level, an odd one out passed up, rounding after
  every add;
* ``fp32``: rank order in an fp32 accumulator (the result rounded once by the
  caller), and, in the same pass, the float64 sum of every group of
  ``EXACT_GROUP_ROWS`` rows with, for bf16, the exponent range that decides
  whether that sum is exact (``reference.float64_sum_is_exact``).

Bits: a 16-bit value widens to fp32 exactly (bf16 by a shift, fp16 by LLVM's
half-to-float conversion); a 16-bit add is the fp32 sum rounded to nearest even
in the 16-bit format, as torch computes it (the double rounding is innocuous:
24 >= 2p + 2); the rounding is integer arithmetic on the fp32 bits (bf16) or one
add and subtract of a power-of-two constant that puts the fp16 ULP at fp32's
last place (fp16, subnormals included), overflow to infinity, the sign of a zero
kept; a NaN stays a NaN (its payload is torch's own business: its vectorised and
scalar bf16 casts give different ones). ``fastmath`` is off, so no operation is reordered or fused.
Every model is bitwise equal to ``models`` (``tests/verify/test_accumulation.py``),
whatever the thread split: columns are independent.

Columns are split over this thread and ``threads - 1`` helpers (the kernels
release the interpreter lock), as ``fastgrad.optim.cpu_kernels``.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np
import torch
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

from verify.studies.reduce_scatter.reference import EXACT_GROUP_ROWS

_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy",
        "boundscheck": False}
# Columns per tile.
TILE = 128
# Rows the tree reduces in cache before the levels above (a power of two).
TREE_BLOCK_ROWS = 256
NO_EXPONENT = 255  # above every finite bf16 exponent field: "no nonzero element"


@intrinsic
def _bits_of(typingctx, x):
    """The int32 bit pattern of a float32 (a register bitcast)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def _float_of(typingctx, x):
    """The float32 whose bit pattern is the int32 ``x``."""
    if x != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _fp16_to_float(typingctx, x):
    """The fp16 whose bits are the uint16 ``x``, widened exactly to float32."""
    if x != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@njit(inline="always", **_JIT)
def _bf16_to_float(bits):
    return _float_of(np.int32(np.int32(bits) << 16))


@njit(inline="always", **_JIT)
def _round_bf16(value):
    """``value`` (fp32) rounded to nearest even in bf16, as an fp32 number."""
    bits = _bits_of(value)
    rounded = np.int32((bits + np.int32(0x7FFF) + ((bits >> 16) & 1)) & np.int32(-65536))
    is_nan = (bits & np.int32(0x7FFFFFFF)) > np.int32(0x7F800000)
    return _float_of(np.int32(0x7FC00000)) if is_nan else _float_of(rounded)


@njit(inline="always", **_JIT)
def _round_fp16(value):
    """``value`` (fp32) rounded to nearest even in fp16, as an fp32 number.

    Adding ``1.5 x 2^(e + 13)`` (e: the value's binade, at least fp16's smallest
    normal one) puts the fp16 ULP at fp32's last place, so fp32's own rounding of
    the sum is fp16's; subtracting it back is exact. Magnitudes of 65,536 and more
    (65,520 and more before rounding) overflow to infinity."""
    bits = _bits_of(value)
    binade = min(max((bits >> 23) & 0xFF, np.int32(113)), np.int32(142))
    shift = _float_of(np.int32(((binade + 13) << 23) | 0x400000))
    magnitude = _bits_of((value + shift) - shift) & np.int32(0x7FFFFFFF)
    if magnitude >= np.int32(0x47800000):
        magnitude = np.int32(0x7F800000)
    signed = np.int32(magnitude | (bits & np.int32(-2147483648)))  # keeps -0
    is_nan = (bits & np.int32(0x7FFFFFFF)) > np.int32(0x7F800000)
    return value if is_nan else _float_of(signed)


@njit(inline="always", **_JIT)
def _widen(bits, is_bf16):
    return _bf16_to_float(bits) if is_bf16 else _fp16_to_float(bits)


@njit(inline="always", **_JIT)
def _round16(value, is_bf16):
    return _round_bf16(value) if is_bf16 else _round_fp16(value)


@njit(**_JIT)
def _ring(bits, is_bf16, j0, j1, chunk_numel, first_chunk, out):
    """Columns [j0, j1): chunk c summed from rank c + first_chunk + 1 around to rank c.

    Chunk c's addends are the rows of the steps g = c + first_chunk + 1 .. + W - 1
    (row g mod W), so at step g the chunks that add are a contiguous range (the one
    whose first step g is copies): one pass over the rows in step order, each step a
    contiguous run of columns, vectorised like the other kernels."""
    world = bits.shape[0]
    c0, c1 = j0 // chunk_numel, (j1 - 1) // chunk_numel + 1
    first_step = c0 + first_chunk + 1
    row = first_step % world
    for g in range(first_step, first_step + world + (c1 - c0) - 1):
        starting = g - first_chunk - 1  # the chunk whose first addend is this row
        if c0 <= starting < c1:
            lo, hi = max(j0, starting * chunk_numel), min(j1, (starting + 1) * chunk_numel)
            source = bits[row, lo:hi]
            target = out[lo:hi]
            for k in range(hi - lo):
                target[k] = _widen(source[k], is_bf16)
        adding_lo = max(c0, g - first_chunk - world)
        adding_hi = min(c1 - 1, starting - 1)
        if adding_lo <= adding_hi:
            lo, hi = max(j0, adding_lo * chunk_numel), min(j1, (adding_hi + 1) * chunk_numel)
            source = bits[row, lo:hi]
            target = out[lo:hi]
            for k in range(hi - lo):
                target[k] = _round16(target[k] + _widen(source[k], is_bf16), is_bf16)
        row = row + 1 if row + 1 < world else 0


@njit(**_JIT)
def _tree_levels(scratch, n, width, is_bf16):
    """Pairwise levels over scratch[0:n] in place until one row is left (in scratch[0])."""
    while n > 1:
        pairs = n // 2
        for p in range(pairs):
            left, right, target = scratch[2 * p], scratch[2 * p + 1], scratch[p]
            for k in range(width):
                target[k] = _round16(left[k] + right[k], is_bf16)
        if n % 2:
            source, target = scratch[n - 1], scratch[pairs]
            for k in range(width):
                target[k] = source[k]
        n = pairs + n % 2


@njit(**_JIT)
def _tree_of_rows(bits, is_bf16, r0, r1, j0, j1, scratch):
    """The pairwise tree of rows [r0, r1) (at most 2 x len(scratch)), into scratch[0]."""
    width = j1 - j0
    n = (r1 - r0) // 2
    for p in range(n):
        left, right, target = bits[r0 + 2 * p, j0:j1], bits[r0 + 2 * p + 1, j0:j1], scratch[p]
        for k in range(width):
            target[k] = _round16(_widen(left[k], is_bf16) + _widen(right[k], is_bf16), is_bf16)
    if (r1 - r0) % 2:
        source, target = bits[r1 - 1, j0:j1], scratch[n]
        for k in range(width):
            target[k] = _widen(source[k], is_bf16)
        n += 1
    _tree_levels(scratch, n, width, is_bf16)


@njit(**_JIT)
def _tree(bits, is_bf16, j0, j1, scratch, upper, out):
    """Columns [j0, j1) (at most TILE): adjacent pairs per level, an odd one passed up.

    Level by level over all W rows would stream W/2 partial sums through memory per
    level. The first log2(TREE_BLOCK_ROWS) levels never pair rows of different aligned
    blocks of TREE_BLOCK_ROWS rows, and the tail block (fewer rows) reduces to one value
    with its odd ones passed up, as they are in the whole level; so each block is reduced
    in cache, then the levels above run over the block values (``upper``)."""
    world = bits.shape[0]
    width = j1 - j0
    blocks = world // TREE_BLOCK_ROWS
    for b in range(blocks):
        _tree_of_rows(bits, is_bf16, b * TREE_BLOCK_ROWS, (b + 1) * TREE_BLOCK_ROWS, j0, j1,
                      scratch)
        upper[b, :width] = scratch[0, :width]
    n = blocks
    if world % TREE_BLOCK_ROWS:
        _tree_of_rows(bits, is_bf16, blocks * TREE_BLOCK_ROWS, world, j0, j1, scratch)
        upper[n, :width] = scratch[0, :width]
        n += 1
    _tree_levels(upper, n, width, is_bf16)
    out[j0:j1] = upper[0, :width]


@njit(**_JIT)
def _rank_order(bits, is_bf16, j0, j1, fp32_out, group_sums, low_exponent, high_exponent):
    """Columns [j0, j1): the fp32 rank-order sum; per group of EXACT_GROUP_ROWS rows the
    float64 sum (from -0: IEEE's sum of -0s is -0) and, for bf16, the smallest exponent
    field of a nonzero element (at least 1) and the largest exponent field. One loop per
    accumulator: a loop storing to two arrays is not vectorised."""
    world = bits.shape[0]
    width = j1 - j0
    acc32 = np.empty(width, np.float32)
    acc64 = np.empty(width, np.float64)
    low = np.empty(width, np.int32)
    high = np.empty(width, np.int32)
    acc32[:] = -0.0
    for g in range((world + EXACT_GROUP_ROWS - 1) // EXACT_GROUP_ROWS):
        acc64[:] = -0.0
        low[:] = NO_EXPONENT
        high[:] = 0
        for i in range(g * EXACT_GROUP_ROWS, min(world, (g + 1) * EXACT_GROUP_ROWS)):
            row = bits[i, j0:j1]
            for k in range(width):
                acc32[k] += _widen(row[k], is_bf16)
            for k in range(width):
                acc64[k] += np.float64(_widen(row[k], is_bf16))
            if is_bf16:
                for k in range(width):
                    magnitude = np.int32(row[k]) & 0x7FFF
                    low[k] = min(low[k], max(magnitude >> 7, np.int32(1)) if magnitude
                                 else np.int32(NO_EXPONENT))
                for k in range(width):
                    high[k] = max(high[k], (np.int32(row[k]) & 0x7FFF) >> 7)
        group_sums[g, j0:j1] = acc64
        low_exponent[g, j0:j1] = low
        high_exponent[g, j0:j1] = high
    fp32_out[j0:j1] = acc32


@dataclass
class BlockReduction:
    """What the kernels computed for one ``[W, columns]`` block (fp32 values of 16-bit results)."""

    ring: torch.Tensor | None
    tree: torch.Tensor | None
    fp32_accumulator: torch.Tensor | None
    group_sums: torch.Tensor  # [groups, columns] float64
    group_exact: torch.Tensor  # [groups, columns] bool: that group's float64 sum is exact


def _split_columns(columns: int, chunk_numel: int) -> list[tuple[int, int]]:
    """Tiles of at most TILE columns, on chunk boundaries where chunks are narrower."""
    step = TILE if chunk_numel >= TILE else max(1, TILE // chunk_numel) * chunk_numel
    return [(j, min(columns, j + step)) for j in range(0, columns, step)]


def reduce_block(stacked: torch.Tensor, chunk_numel: int, first_chunk: int,
                 methods: tuple[str, ...], threads: int | None = None) -> BlockReduction:
    """Run ``methods`` (``ring``, ``tree``, ``fp32``) on ``stacked`` ([W, columns], fp16 or
    bf16, contiguous); the ring's columns are chunks ``first_chunk ..`` of ``chunk_numel``.
    ``threads``: how many threads split the columns (default: torch's thread count)."""
    if stacked.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"stacked must be float16 or bfloat16, got {stacked.dtype}")
    world, columns = stacked.shape
    if chunk_numel <= 0 or columns % chunk_numel:
        raise ValueError(f"stacked has {columns} columns, not a whole number of chunks of "
                         f"{chunk_numel}")
    bits = stacked.contiguous().view(torch.int16).numpy().view(np.uint16)
    groups = -(-world // EXACT_GROUP_ROWS)
    ring = np.empty(columns, np.float32) if "ring" in methods else None
    tree = np.empty(columns, np.float32) if "tree" in methods else None
    fp32 = np.empty(columns, np.float32)
    sums = np.empty((groups, columns), np.float64)
    low = np.empty((groups, columns), np.int32)
    high = np.empty((groups, columns), np.int32)
    is_bf16 = stacked.dtype == torch.bfloat16
    tiles = _split_columns(columns, chunk_numel)

    def tile_work(scratch: np.ndarray, upper: np.ndarray, j0: int, j1: int) -> None:
        _rank_order(bits, is_bf16, j0, j1, fp32, sums, low, high)
        if ring is not None:
            _ring(bits, is_bf16, j0, j1, chunk_numel, first_chunk, ring)
        if tree is not None:
            _tree(bits, is_bf16, j0, j1, scratch, upper, tree)

    _run_tiles(tile_work, tiles, world, torch.get_num_threads() if threads is None else threads)
    group_sums = torch.from_numpy(sums)
    if is_bf16:
        rows = torch.tensor([min(EXACT_GROUP_ROWS, world - g * EXACT_GROUP_ROWS)
                             for g in range(groups)]).unsqueeze(1)
        log2_rows = torch.ceil(torch.log2(rows.double())).long()
        low_t, high_t = torch.from_numpy(low).long(), torch.from_numpy(high).long()
        # reference.float64_sum_is_exact: every partial sum an integer multiple of 2^(q-134)
        # below 2^(top-126) x rows, i.e. at most 53 significant bits.
        exact = (high_t < NO_EXPONENT) & (high_t - low_t + 8 + log2_rows <= 53)
    else:
        # fp16: multiples of 2^-24 below 2^16, so 2^13 rows sum exactly in float64.
        exact = torch.ones(groups, columns, dtype=torch.bool)
    exact &= group_sums.abs() < 2.0**127
    return BlockReduction(None if ring is None else torch.from_numpy(ring),
                          None if tree is None else torch.from_numpy(tree),
                          torch.from_numpy(fp32) if "fp32" in methods else None,
                          group_sums, exact)


def _run_tiles(work, tiles: list[tuple[int, int]], world: int, threads: int) -> None:
    """``work(scratch, upper, j0, j1)`` for every tile, on this thread and ``threads - 1``
    helpers, each taking the next tile when done; the first error is raised."""
    workers = max(1, min(threads, len(tiles)))
    next_tile = itertools.count()  # next() is atomic under the GIL
    errors: list[BaseException] = []

    def drain() -> None:
        scratch = (np.empty((TREE_BLOCK_ROWS // 2, TILE), np.float32),
                   np.empty((world // TREE_BLOCK_ROWS + 1, TILE), np.float32))
        try:
            for i in iter(next_tile.__next__, None):
                if i >= len(tiles) or errors:
                    return
                work(*scratch, *tiles[i])
        except BaseException as exc:  # noqa: BLE001 - must reach the caller
            errors.append(exc)

    helpers = [threading.Thread(target=drain, daemon=True) for _ in range(workers - 1)]
    for helper in helpers:
        helper.start()
    drain()
    for helper in helpers:
        helper.join()
    if errors:
        raise errors[0]


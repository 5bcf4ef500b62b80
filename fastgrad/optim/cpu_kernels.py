"""Fused CPU kernels (numba) of the optimizer step: one pass per shard per phase.

The torch-op path (``norm.py``, ``update.py``) makes about ten passes over
memory per element and a copy of the grads; these kernels make one for the
exact norm and one for the update (which also writes the fp32/bf16 param
copy), read the grads straight from the grad buffer (fp32, bf16 or fp16,
widened exactly by bit manipulation), and split the work over the cores.

Bits. Every operation and its order per element is ``refgrad.optim``'s, each
on fp32 values with one fp32 rounding: numba types ``float32 op float32`` as
float32, ``fastmath`` is off (LLVM then never contracts ``a*b + c`` into a
fused multiply-add), and the square root is fp64's rounded to fp32
(innocuous double rounding, 53 >= 2*24 + 2, as ``update.sqrt_fp32``; LLVM
knows that and emits the fp32 ``sqrtps``, also correctly rounded).
``tests/fastgrad/test_optim_kernels.py`` checks all of it against refgrad.

The exact norm. It yields int64 bins per exponent field ``f`` in units of
``2^(2 max(f, 1) - 300)``, as ``norm.local_square_limbs``, whose exact sum is
the sum of squares; integer sums are associative, so the limbs are identical
whatever the chunking or the thread count. Binning each element (a scatter,
one store-to-load chain per element) took 10.1 ms of one thread's CPU per 10^7
elements, this vectorized pass 4.0 ms: per sub-block of ``SUB_BLOCK`` elements
the squares are split on fixed grids instead (Rump, Ogita and Oishi's
ExtractScalar, SIAM J. Sci. Comput. 31(1), 2008, Lemma 3.3). With ``f1`` one field above the largest ``|g|``'s, every
square ``s`` (exact in fp64: 48 significant bits) is below ``2^46 u1``, ``u1``
field ``f1``'s unit. ``sigma = 1.5 * 2^K`` has ulp ``u1``, so ``t = fl(sigma
+ s)`` stays in sigma's binade: ``q = t - sigma`` (a multiple of ``u1``, at
most ``2^46 u1``) and ``r = s - q`` (``|r| <= u1/2``) are exact, and ``q / u1``
is ``t``'s fraction bits minus sigma's, an integer summed in int64. The
remainders are split the same way at ``f2 = f1 - 24`` (``|r| <= 2^47 u2``:
still in the binade). When every second remainder is 0 the sub-block's sum is
exactly ``acc1 u1 + acc2 u2``; otherwise (a square below about ``2^-48`` of
the largest) levels 24 fields apart follow until none is left, at the latest
at field 1, whose unit ``2^-298`` divides every fp32 square. A row (at most
``2^15`` elements) adds less than ``2^48`` per element to any bin: below
``2^63``. Sub-blocks with NaN/inf or ``|g| >= 2^127`` (whose ``f1`` would be
255) are binned element by element.

Work is described by a table of rows ``(lo, hi, buf, group, in_norm)``:
shard elements ``[lo, hi)`` (compact optimizer-state index) whose grads (and
param copy) start at ``buf`` in the bucket group's buffer, updated with param
group ``group``'s scalars, counted in the norm when ``in_norm``. Rows hold at
most ``CHUNK`` elements, split over threads in contiguous slices (``_run_rows``).
"""

from __future__ import annotations

import itertools
import math
import threading

import numpy as np
import torch
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

CHUNK = 1 << 15  # elements per work row: a row's 2^15 squares (< 2^48 each) sum below 2^63
GRAD_FP32, GRAD_BF16, GRAD_FP16 = 0, 1, 2
OUT_NONE, OUT_FP32, OUT_BF16 = 0, 1, 2
ADAMW_COLUMNS = ("lr", "beta1", "beta2", "eps", "decay", "one_minus_beta1", "one_minus_beta2",
                 "bc1", "bc2", "has_wd")
SGD_COLUMNS = ("lr", "momentum", "wd", "first")
_FIELDS = 256
SLICES_PER_THREAD = 8  # pieces per thread: a slowed thread takes fewer
SUB_BLOCK = 1 << 11  # elements of the norm whose squares share level units (L1-resident)
_LEVEL_FIELDS = 24  # fields between levels: 48 bits, the fraction bits a level can hold (52 - 4)
_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}


@intrinsic
def _bits_of(typingctx, x):
    """The int32 bit pattern of a float32 (a register bitcast)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def _bits64_of(typingctx, x):
    """The int64 bit pattern of a float64."""
    if x != types.float64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@intrinsic
def _float_of(typingctx, x):
    """The float32 whose bit pattern is the int32 ``x``."""
    if x != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@njit(inline="always", **_JIT)
def _fp16_to_fp32_bits(h):
    """Exact widening of fp16 bits ``h`` (int64 in [0, 2^16)) to fp32 bits (int64)."""
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    f = h & 0x3FF
    if e == 31:  # inf/NaN (payload kept, as torch's conversion)
        return sign | 0x7F800000 | (f << 13)
    if e != 0:
        return sign | ((e + 112) << 23) | (f << 13)
    if f == 0:
        return sign
    shift = 0  # subnormal f * 2^-24: normalize the mantissa
    while (f & 0x400) == 0:
        f <<= 1
        shift += 1
    return sign | ((113 - shift) << 23) | ((f & 0x3FF) << 13)


@njit(inline="always", **_JIT)
def _grads_fp32(kind, g32, g16, buf, k, scratch):
    """The row's ``k`` grads from buffer offset ``buf`` as an fp32 array: a view of an
    fp32 buffer, or bf16/fp16 widened exactly into ``scratch`` (int32, >= k)."""
    if kind == GRAD_FP32:
        return g32[buf : buf + k]
    if kind == GRAD_BF16:
        for j in range(k):
            scratch[j] = np.int32(np.int64(g16[buf + j]) << 16)
    else:
        for j in range(k):
            bits = _fp16_to_fp32_bits(np.int64(g16[buf + j]))
            scratch[j] = np.int32(bits - (1 << 32) if bits >= (1 << 31) else bits)
    return scratch[:k].view(np.float32)


@njit(**_JIT)
def _widen(kind, g32, g16, n):
    scratch = np.empty(n, dtype=np.int32)
    return _grads_fp32(kind, g32, g16, 0, n, scratch).copy()


@njit(inline="always", **_JIT)
def _scatter_squares(g, inv_scale, in_norm, row_bins):
    """Element by element: each exact mantissa square into its exponent field's bin (field
    255, NaN/inf, gets them too; callers ignore it). Returns the NaN/inf count."""
    bad = 0
    for j in range(g.shape[0]):
        bits = np.int64(_bits_of(g[j] * inv_scale)) & 0x7FFFFFFF
        field = bits >> 23
        # normal: (1 << 23) | fraction; subnormal (field 0): the fraction alone
        mant = bits - (max(field - 1, 0) << 23)
        bad += field == 255
        if in_norm:
            row_bins[field] += mant * mant
    return bad


@njit(inline="always", **_JIT)
def _sigma(field):
    """``1.5 * 2^K`` whose fp64 ulp is field ``field``'s bin unit ``2^(2 field - 300)``."""
    return math.ldexp(1.5, 2 * field - 248)


@njit(inline="always", **_JIT)
def _two_levels(g, inv_scale, f1, row_bins):
    """The squares' sum in the units of fields ``f1`` and ``f2 = max(f1 - 24, 1)``, added to
    ``row_bins`` when every square is a multiple of ``f2``'s unit; False (nothing added)
    otherwise. Vectorized: no scatter."""
    f2 = max(f1 - _LEVEL_FIELDS, 1)
    s1, s2 = _sigma(f1), _sigma(f2)
    b1, b2 = _bits64_of(s1), _bits64_of(s2)
    acc1 = acc2 = left = 0
    for j in range(g.shape[0]):
        x = np.float64(g[j] * inv_scale)
        s = x * x  # exact: 48 significant bits
        t1 = s1 + s
        r1 = s - (t1 - s1)  # both exact (see the module docstring)
        t2 = s2 + r1
        r2 = r1 - (t2 - s2)
        acc1 += _bits64_of(t1) - b1  # (t - sigma) / unit, read from t's fraction bits
        acc2 += _bits64_of(t2) - b2
        left |= _bits64_of(r2) & 0x7FFFFFFFFFFFFFFF  # a nonzero remainder (either sign)
    if left:
        return False
    row_bins[f1] += acc1
    row_bins[f2] += acc2
    return True


@njit(inline="always", **_JIT)
def _all_levels(g, inv_scale, f1, row_bins, rem):
    """As ``_two_levels``, level after level (each ``_LEVEL_FIELDS`` fields lower, down to
    field 1, whose unit 2^-298 divides every fp32 square) until nothing is left."""
    for j in range(g.shape[0]):
        x = np.float64(g[j] * inv_scale)
        rem[j] = x * x
    field = f1
    while True:
        sigma = _sigma(field)
        base = _bits64_of(sigma)
        acc = left = 0
        for j in range(g.shape[0]):
            t = sigma + rem[j]
            r = rem[j] - (t - sigma)
            rem[j] = r
            acc += _bits64_of(t) - base
            left |= _bits64_of(r) & 0x7FFFFFFFFFFFFFFF
        row_bins[field] += acc
        if left == 0:
            return
        field = max(field - _LEVEL_FIELDS, 1)


@njit(**_JIT)
def _square_bins(work, g32, g16, kind, inv_scale, bins, nonfinite):
    """Per row: the exact sum of squares as int64 per-field bins, and the NaN/inf count.

    Per sub-block: the largest ``|g|`` fixes the level units; sub-blocks with NaN/inf (or
    ``|g| >= 2^127``, whose first level would need field 255) take ``_scatter_squares``.
    """
    rem = np.empty(SUB_BLOCK, dtype=np.float64)
    for r in range(work.shape[0]):
        lo, hi, buf, in_norm = work[r, 0], work[r, 1], work[r, 2], work[r, 4]
        k = hi - lo
        scratch = np.empty(0 if kind == GRAD_FP32 else k, dtype=np.int32)  # fp32: read in place
        g = _grads_fp32(kind, g32, g16, buf, k, scratch)
        row_bins = bins[r]
        row_bins[:] = 0
        bad = 0
        for a in range(0, k, SUB_BLOCK):
            sub = g[a : a + SUB_BLOCK]  # sliced: indices from 0 vectorize (no gathers)
            top = np.int32(0)
            for j in range(sub.shape[0]):
                top = max(top, _bits_of(sub[j] * inv_scale) & np.int32(0x7FFFFFFF))
            if top >= 0x7F000000:
                bad += _scatter_squares(sub, inv_scale, in_norm, row_bins)
            elif in_norm and top:
                f1 = max(top >> 23, 1) + 1  # squares < 2^(2 (f1 - 1) - 252) = 2^46 units of f1
                if not _two_levels(sub, inv_scale, f1, row_bins):
                    _all_levels(sub, inv_scale, f1, row_bins, rem)
        nonfinite[r] = bad


@njit(inline="always", **_JIT)
def _store_params(out_kind, out32, out16, buf, p):
    """The row's new fp32 params ``p`` into the param buffer at ``buf``: as they are (fp32) or
    rounded to nearest even (bf16; NaN -> 0x7FC0, as torch's conversion)."""
    if out_kind == OUT_FP32:
        dst = out32[buf : buf + p.size]
        for j in range(p.size):
            dst[j] = p[j]
    elif out_kind == OUT_BF16:
        for j in range(p.size):
            bits = np.int64(_bits_of(p[j])) & 0xFFFFFFFF
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            out16[buf + j] = 0x7FC0 if p[j] != p[j] else rounded


@njit(inline="always", **_JIT)
def _adamw_element(pj, gj, mj, vj, lr, b1, b2, eps, decay, omb1, omb2, bc1, bc2):
    """One element of ``refgrad.optim.adamw_element``: the new ``(p, m, v)``."""
    pj = pj * decay
    mj = mj * b1 + gj * omb1
    vj = vj * b2 + (gj * gj) * omb2
    denom = np.float32(math.sqrt(np.float64(vj / bc2))) + eps
    return pj - lr * ((mj / bc1) / denom), mj, vj


@njit(**_JIT)
def _adamw(work, g32, g16, kind, gscale, table, p, m, v, out_kind, out32, out16):
    """AdamW on every row, in ``refgrad.optim.adamw_element``'s order; writes the param copy
    (fp32: in the same loop, which saves a pass over the row)."""
    inv_scale, clip = gscale[0], gscale[1]
    for r in range(work.shape[0]):
        lo, hi, buf, grp = work[r, 0], work[r, 1], work[r, 2], work[r, 3]
        lr, b1, b2, eps, decay = table[grp, 0], table[grp, 1], table[grp, 2], table[grp, 3], table[grp, 4]
        omb1, omb2, bc1, bc2 = table[grp, 5], table[grp, 6], table[grp, 7], table[grp, 8]
        if table[grp, 9] == 0:
            decay = np.float32(1.0)  # no weight decay: p * 1 == p
        k = hi - lo
        scratch = np.empty(0 if kind == GRAD_FP32 else k, dtype=np.int32)  # fp32: read in place
        g = _grads_fp32(kind, g32, g16, buf, k, scratch)
        pr, mr, vr = p[lo:hi], m[lo:hi], v[lo:hi]
        if out_kind == OUT_FP32:
            dst = out32[buf : buf + k]
            for j in range(k):
                gj = (g[j] * inv_scale) * clip  # x * 1 == x: unscaling / clipping off cost no bits
                pr[j], mr[j], vr[j] = _adamw_element(pr[j], gj, mr[j], vr[j], lr, b1, b2, eps,
                                                     decay, omb1, omb2, bc1, bc2)
                dst[j] = pr[j]
        else:
            for j in range(k):
                gj = (g[j] * inv_scale) * clip
                pr[j], mr[j], vr[j] = _adamw_element(pr[j], gj, mr[j], vr[j], lr, b1, b2, eps,
                                                     decay, omb1, omb2, bc1, bc2)
            _store_params(out_kind, out32, out16, buf, pr)


@njit(**_JIT)
def _sgd(work, g32, g16, kind, gscale, table, p, momentum, out_kind, out32, out16):
    """SGD (torch semantics, dampening 0) on every row, in ``refgrad.optim.sgd_element``'s order."""
    inv_scale, clip = gscale[0], gscale[1]
    for r in range(work.shape[0]):
        lo, hi, buf, grp = work[r, 0], work[r, 1], work[r, 2], work[r, 3]
        lr, mu, wd, first = table[grp, 0], table[grp, 1], table[grp, 2], table[grp, 3] != 0
        k = hi - lo
        scratch = np.empty(0 if kind == GRAD_FP32 else k, dtype=np.int32)  # fp32: read in place
        g = _grads_fp32(kind, g32, g16, buf, k, scratch)
        pr, br = p[lo:hi], momentum[lo:hi]
        for j in range(k):
            gj = (g[j] * inv_scale) * clip
            if wd != 0:
                gj = gj + wd * pr[j]
            if mu != 0:
                gj = gj if first else mu * br[j] + gj
                br[j] = gj
            pr[j] = pr[j] - lr * gj
        _store_params(out_kind, out32, out16, buf, pr)


# --------------------------------------------------------------------------- numpy entry points

# Parallelism: the kernels are compiled ``nogil`` and one-threaded; the rows are split
# into contiguous slices run on plain threads, one per intra-op thread torch uses.
# numba's own parallel backend (an OpenMP pool) is not used: it shares torch's GNU
# OpenMP runtime, whose idle workers spin after every kernel and took the cores from
# the gloo progress threads carrying the overlapped param all-gather (the forward's
# wait doubled in bench/bench_optim.py), and a child fork()ed after that pool started
# is terminated by numba. Plain threads end with the call: nothing survives a fork.


def _run_rows(kernel, work: np.ndarray, per_row: tuple[np.ndarray, ...], *args) -> None:
    """``kernel(work[s], *per_row[s], *args)`` over contiguous slices ``s`` of the rows, on
    this thread and ``torch.get_num_threads() - 1`` helpers that each take the next slice
    when done (a thread that shares its core with another process's work, or with an
    OpenMP worker still spinning after the last torch op, then simply takes fewer).
    Rows are independent (disjoint elements; per-row outputs in ``per_row``), so the
    split changes no bit."""
    rows = work.shape[0]
    workers = max(1, min(torch.get_num_threads(), rows))
    pieces = min(rows, SLICES_PER_THREAD * workers)
    bounds = [rows * i // pieces for i in range(pieces + 1)]
    next_piece = itertools.count()  # next() is atomic under the GIL
    errors: list[BaseException] = []  # the first one is raised in the caller

    def drain() -> None:
        try:
            for i in iter(next_piece.__next__, None):
                if i >= pieces or errors:
                    return
                lo, hi = bounds[i], bounds[i + 1]
                kernel(work[lo:hi], *(a[lo:hi] for a in per_row), *args)
        except BaseException as exc:  # noqa: BLE001 - a helper's error must reach the caller,
            errors.append(exc)  # not vanish with its thread (a half-applied step)

    helpers = [threading.Thread(target=drain, daemon=True) for _ in range(workers - 1)]
    for helper in helpers:
        helper.start()
    drain()
    # No deadline: a helper only runs the kernel on a bounded slice and waits on nothing.
    for helper in helpers:
        helper.join()
    if errors:
        raise errors[0]


_EMPTY32 = np.zeros(0, dtype=np.float32)
_EMPTY16 = np.zeros(0, dtype=np.uint16)


def grad_arrays(kind: int, grad_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(g32, g16)`` for the kernels from a grad buffer's raw bits (the unused one empty)."""
    if kind == GRAD_FP32:
        return grad_bits.view(np.float32), _EMPTY16
    return _EMPTY32, grad_bits.view(np.uint16)


def out_arrays(out_kind: int, param_bits: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``(out32, out16)`` for the kernels from a param buffer's raw bits."""
    if out_kind == OUT_FP32:
        return param_bits.view(np.float32), _EMPTY16
    if out_kind == OUT_BF16:
        return _EMPTY32, param_bits.view(np.uint16)
    return _EMPTY32, _EMPTY16


def _square_bins_rows(work, bins, nonfinite, g32, g16, kind, inv_scale) -> None:
    """:func:`_square_bins` with its per-row outputs first (the order ``_run_rows`` passes)."""
    _square_bins(work, g32, g16, kind, inv_scale, bins, nonfinite)


def square_bins(work: np.ndarray, kind: int, grad_bits: np.ndarray, inv_scale: np.float32
                ) -> tuple[list[int], list[int], int]:
    """``(low, high, nonfinite)``: the 24-bit halves of the per-field square sums (as
    ``norm._bins_to_integer`` takes them) and the count of NaN/inf grads."""
    rows = work.shape[0]
    bins = np.empty((rows, _FIELDS), dtype=np.int64)
    nonfinite = np.empty(rows, dtype=np.int64)
    if rows:
        g32, g16 = grad_arrays(kind, grad_bits)
        _run_rows(_square_bins_rows, work, (bins, nonfinite), g32, g16, kind, np.float32(inv_scale))
    # each row's bin < 2^63; the halves summed over rows stay below 2^63 for < 2^39 elements
    low = (bins & ((1 << 24) - 1)).sum(axis=0)
    high = (bins >> 24).sum(axis=0)
    return low.tolist(), high.tolist(), int(nonfinite.sum())


def adamw(work, kind, grad_bits, gscale, table, p, m, v, out_kind, param_bits) -> None:
    """One fused AdamW pass over ``work`` (see the module docstring)."""
    if work.shape[0]:
        g32, g16 = grad_arrays(kind, grad_bits)
        out32, out16 = out_arrays(out_kind, param_bits)
        _run_rows(_adamw, work, (), g32, g16, kind, gscale, table, p, m, v, out_kind, out32, out16)


def sgd(work, kind, grad_bits, gscale, table, p, momentum, out_kind, param_bits) -> None:
    """One fused SGD pass over ``work``."""
    if work.shape[0]:
        g32, g16 = grad_arrays(kind, grad_bits)
        out32, out16 = out_arrays(out_kind, param_bits)
        _run_rows(_sgd, work, (), g32, g16, kind, gscale, table, p, momentum, out_kind, out32,
                  out16)


def widen(kind: int, grad_bits: np.ndarray) -> np.ndarray:
    """The grads the kernels see: ``grad_bits`` widened to fp32 (exact; for tests)."""
    g32, g16 = grad_arrays(kind, grad_bits)
    return _widen(kind, g32, g16, grad_bits.shape[0])

"""``verify accumulation``: how reduction error grows with the data-parallel size N.

For every DP size N, wire dtype (fp16, bf16) and input distribution, N per-rank
gradient tensors are reduced the ways real collectives and the code people train with do it
(ring, tree, fp32 accumulation; torch DDP's compress hook and FSDP2's ``reduce_dtype``, which
average: measured as N times their mean)
(``models`` is the readable spec; the sweep runs ``kernels``, the same reductions
compiled, bitwise equal), and each result is compared with the correctly rounded
exact sum (``reference``): normwise relative error against the exact sum, max and median
ULP distance, and the fraction of elements correctly rounded. Per method the
growth exponent (the log-log slope of the error against N) is fitted and printed
beside the theory (``sqrt(N)·u`` typical, ``(N-1)·u`` worst case) and beside
Megatron-Core's published error figures, which are printed, never tuned to.

Inputs are generated in column blocks of ``block_elements`` (each block from its
own seed, so a point's data does not depend on how it is computed); each block is
drawn, cast and reduced by a worker thread, and its figures are added to the
point's in block order. Memory is a block per thread plus O(numel) per point,
whatever N is.

``--backend dist`` (under torchrun, ``dist``) measures the process group's real
reduce-scatter and all-reduce instead, and reports which model they match.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from verify.metrics import ulp_distance
from verify.studies.reduce_scatter.kernels import reduce_block
from verify.studies.reduce_scatter.models import (
    DISTRIBUTIONS,
    DTYPES,
    METHODS,
    UNIT_ROUNDOFF,
    as_sum,
    compress_hook_prescale,
    fsdp2_finish,
    fsdp2_prescale,
    generate,
)
from verify.studies.reduce_scatter.reference import exact_references

DEFAULT_DP: tuple[int, ...] = tuple(2**k for k in range(1, 11))
MAX_DP = 2**16  # the oracle takes up to 2^23 rows; the sweep's cost grows with N
DEFAULT_NUMEL = 98 * 1024  # 100352: >= 10^5 elements per point, divisible by every default N
# Elements of one generation block of [N, columns] (fixes the data: never change it).
BLOCK_ELEMENTS = 2**23

# Megatron-Core's published "gradient error" figures (no metric or distribution given),
# printed beside our measurements of fp16 data for ring (wire) and fp32 accumulation.
PUBLISHED_CLAIMS: dict[str, dict[int, float]] = {
    "ring": {8: 1e-5, 64: 8e-5, 512: 6e-4},
    "fp32": {8: 1e-7, 64: 8e-7, 512: 6e-6},
}

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


@dataclass
class _Accumulator:
    """Running sums of one (dtype, distribution, N, method) point over column blocks."""

    sq_error: float = 0.0
    sq_exact: float = 0.0
    sq_error_fp32: float = 0.0
    ulps: list[torch.Tensor] = field(default_factory=list)

    def add(self, result: torch.Tensor, exact64: torch.Tensor, rounded: torch.Tensor,
            fp32_acc: torch.Tensor | None = None) -> None:
        self.sq_error += float(torch.sum((result.double() - exact64) ** 2))
        self.sq_exact += float(torch.sum(exact64**2))
        if fp32_acc is not None:
            self.sq_error_fp32 += float(torch.sum((fp32_acc.double() - exact64) ** 2))
        self.ulps.append(ulp_distance(result, rounded).ulps)


@dataclass
class Point:
    """One measured point of the sweep."""

    dtype: str
    distribution: str
    dp: int
    method: str
    numel: int
    rel_error: float
    max_ulp: int
    median_ulp: float
    frac_correctly_rounded: float
    theory_typical: float
    theory_worst: float
    rel_error_fp32_accumulator: float | None = None


def _finish(acc: _Accumulator, dtype: str, distribution: str, dp: int, method: str) -> Point:
    ulps = torch.cat(acc.ulps)
    u = UNIT_ROUNDOFF[dtype]
    norm = math.sqrt(acc.sq_exact)
    return Point(
        dtype=dtype,
        distribution=distribution,
        dp=dp,
        method=method,
        numel=int(ulps.numel()),
        rel_error=math.sqrt(acc.sq_error) / norm if norm else float("nan"),
        max_ulp=int(ulps.max()),
        median_ulp=float(ulps.double().median()),
        frac_correctly_rounded=float((ulps == 0).double().mean()),
        theory_typical=math.sqrt(dp) * u,
        theory_worst=(dp - 1) * u,
        rel_error_fp32_accumulator=(
            math.sqrt(acc.sq_error_fp32) / norm if method == "fp32" and norm else None
        ),
    )


@dataclass(frozen=True)
class SweepConfig:
    """What to sweep; validated on construction."""

    dp_sizes: tuple[int, ...] = DEFAULT_DP
    dtypes: tuple[str, ...] = tuple(DTYPES)
    distributions: tuple[str, ...] = DISTRIBUTIONS
    methods: tuple[str, ...] = METHODS
    numel: int = DEFAULT_NUMEL
    seed: int = 0
    block_elements: int = BLOCK_ELEMENTS  # elements per generation block of [N, columns]

    def __post_init__(self) -> None:
        if not self.dp_sizes or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in self.dp_sizes
        ):
            raise ValueError(f"dp_sizes must be integers >= 2, got {self.dp_sizes}")
        if any(n > MAX_DP for n in self.dp_sizes):
            raise ValueError(f"dp_sizes must be <= {MAX_DP}, got {self.dp_sizes}")
        for name, values, allowed in (
            ("dtypes", self.dtypes, tuple(DTYPES)),
            ("distributions", self.distributions, DISTRIBUTIONS),
            ("methods", self.methods, METHODS),
        ):
            if not values or any(v not in allowed for v in values):
                raise ValueError(f"{name} must be a non-empty subset of {allowed}, got {values}")
        for name in ("numel", "seed", "block_elements"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.block_elements < 1:
            raise ValueError(f"block_elements must be >= 1, got {self.block_elements}")
        if self.numel < 1:
            raise ValueError(f"numel must be >= 1, got {self.numel}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    def numel_for(self, dp: int) -> int:
        """Elements per point at DP size ``dp``: numel rounded up to a multiple of dp."""
        return -(-self.numel // dp) * dp


def _seed_for(config: SweepConfig, distribution: str, dp: int, block: int) -> int:
    return (
        config.seed * 1_000_003
        + DISTRIBUTIONS.index(distribution) * 100_003
        + dp * 1_009
        + block
    )


def _generation_blocks(config: SweepConfig, dp: int) -> list[tuple[int, int, int]]:
    """The generation blocks ``(index, first column, columns)`` of a point at DP ``dp``."""
    numel = config.numel_for(dp)
    chunk_numel = numel // dp
    chunks_per_block = max(1, config.block_elements // (dp * chunk_numel))
    block_columns = chunks_per_block * chunk_numel
    return [(index, start, min(block_columns, numel - start))
            for index, start in enumerate(range(0, numel, block_columns))]


Reduced = tuple[dict[str, tuple[torch.Tensor, torch.Tensor | None]], torch.Tensor, torch.Tensor]


def _reduce(stacked: torch.Tensor, chunk_numel: int, first_chunk: int, methods: Sequence[str],
            threads: int | None = None) -> Reduced:
    """Every method's result (and fp32's accumulator), then the exact references, of one
    block: the compiled kernels (``kernels``), bitwise the torch ``models``."""
    block = reduce_block(stacked, chunk_numel, first_chunk, tuple(methods), threads=threads)
    dtype = stacked.dtype
    world = stacked.shape[0]
    results: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for method in methods:
        if method == "ring":
            results[method] = (block.ring.to(dtype), None)
        elif method == "tree":
            results[method] = (block.tree.to(dtype), None)
        elif method == "fp32":
            results[method] = (block.fp32_accumulator.to(dtype), block.fp32_accumulator)
        elif method == "compress_hook":
            ring = reduce_block(compress_hook_prescale(stacked), chunk_numel, first_chunk, ("ring",),
                                threads=threads).ring.to(dtype)
            results[method] = (as_sum(ring, world), None)
        else:  # fsdp2
            inputs, post, op = fsdp2_prescale(stacked)
            ring = reduce_block(inputs, chunk_numel, first_chunk, ("ring",), threads=threads).ring
            results[method] = (as_sum(fsdp2_finish(ring.to(dtype), world, post, op), world), None)
    exact64, rounded = exact_references(stacked, block.group_sums, block.group_exact)
    return results, exact64, rounded


def _measure_block(config: SweepConfig, distribution: str, dp: int,
                   block: tuple[int, int, int], *, threads: int | None) -> dict[str, Reduced]:
    """One generation block's inputs, drawn from its own seed, reduced in every dtype."""
    index, start, columns = block
    gen = torch.Generator().manual_seed(_seed_for(config, distribution, dp, index))
    sample = generate(distribution, dp, columns, gen)
    chunk_numel = config.numel_for(dp) // dp
    return {dtype: _reduce(sample.to(DTYPES[dtype]), chunk_numel, start // chunk_numel,
                           config.methods, threads)
            for dtype in config.dtypes}


Progress = Callable[[float, int, str, bool], None]
"""``progress(groups_done, groups_total, label, group_finished)``: after every generation
block (``groups_done`` then counts the fraction of the (distribution, N) group done)
and after every group."""


def run_sweep(
    config: SweepConfig, progress: Progress | None = None, into: list[Point] | None = None,
) -> list[Point]:
    """Measure every (dtype, distribution, N, method) point of ``config``.

    Points are appended to ``into`` (a new list by default, returned) as each
    (distribution, N) finishes, so a caller interrupted midway keeps those measured.
    Generation blocks are measured in parallel worker threads (one per torch thread;
    drawing random numbers and the kernels release the interpreter lock) and added to
    the point's sums in block order, so the figures do not depend on the threads.
    """
    points: list[Point] = [] if into is None else into
    total = len(config.distributions) * len(config.dp_sizes)
    done = 0
    for distribution in config.distributions:
        for dp in config.dp_sizes:
            accs = {(d, m): _Accumulator() for d in config.dtypes for m in config.methods}
            blocks = _generation_blocks(config, dp)
            workers = min(len(blocks), torch.get_num_threads())
            # One block alone (small N) splits its columns over the threads instead.
            threads = None if workers == 1 else 1
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="accumulation")
            try:
                measured_blocks = pool.map(
                    functools.partial(_measure_block, config, distribution, dp, threads=threads),
                    blocks)
                for number, measured in enumerate(measured_blocks, start=1):
                    for dtype, (results, exact64, rounded) in measured.items():
                        for method, (result, fp32_acc) in results.items():
                            accs[(dtype, method)].add(result, exact64, rounded, fp32_acc)
                    if progress is not None and number < len(blocks):
                        progress(done + number / len(blocks), total,
                                 f"{distribution} N={dp}: block {number}/{len(blocks)}", False)
            finally:
                # Ctrl-C (or an error): the blocks not started are dropped, not run.
                pool.shutdown(wait=True, cancel_futures=True)
            for (dtype, method), acc in accs.items():
                points.append(_finish(acc, dtype, distribution, dp, method))
            done += 1
            if progress is not None:
                progress(done, total, f"{distribution} N={dp}", True)
    return points


def growth_exponent(dps: Sequence[int], errors: Sequence[float]) -> float | None:
    """Least-squares slope of log(error) against log(N); None with < 2 usable points."""
    pairs = [(math.log(n), math.log(e)) for n, e in zip(dps, errors) if e > 0 and math.isfinite(e)]
    if len(pairs) < 2:
        return None
    mean_x = sum(x for x, _ in pairs) / len(pairs)
    mean_y = sum(y for _, y in pairs) / len(pairs)
    sxx = sum((x - mean_x) ** 2 for x, _ in pairs)
    if sxx == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in pairs) / sxx


def growth_table(points: Sequence[Point]) -> list[dict[str, Any]]:
    """Per (dtype, distribution, method): fitted exponent of rel. error and of the max ULP."""
    rows = []
    keys = sorted({(p.dtype, p.distribution, p.method) for p in points},
                  key=lambda k: (k[0], DISTRIBUTIONS.index(k[1]), METHODS.index(k[2])))
    for dtype, distribution, method in keys:
        series = sorted(
            (p for p in points if (p.dtype, p.distribution, p.method) == (dtype, distribution, method)),
            key=lambda p: p.dp,
        )
        dps = [p.dp for p in series]
        rows.append({
            "dtype": dtype,
            "distribution": distribution,
            "method": method,
            "dp_range": f"{dps[0]}-{dps[-1]}",
            "slope_rel_error": growth_exponent(dps, [p.rel_error for p in series]),
            "slope_max_ulp": growth_exponent(dps, [float(p.max_ulp) for p in series]),
            "theory_typical_slope": 0.5,
            "theory_worst_slope": 1.0,
        })
    return rows


def published_claims_table(points: Sequence[Point]) -> list[dict[str, Any]]:
    """Megatron-Core's published error figures beside our fp16 measurements at the same N."""
    rows = []
    for method, claims in PUBLISHED_CLAIMS.items():
        for dp, claimed in claims.items():
            for p in points:
                if (p.dtype, p.method, p.dp) == ("float16", method, dp):
                    rows.append({
                        "published_claim": f"{'FP16' if method == 'ring' else 'FP32'} accumulation",
                        "dp": dp,
                        "claimed": claimed,
                        "distribution": p.distribution,
                        "measured_rel_error": p.rel_error,
                        "measured_fp32_accumulator_rel_error": p.rel_error_fp32_accumulator,
                    })
    return rows

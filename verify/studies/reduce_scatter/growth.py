"""``verify accumulation``: how reduction error grows with the data-parallel size N.

For every DP size N, wire dtype (fp16, bf16) and input distribution, N per-rank
gradient tensors are reduced three ways, the way real collectives do it:

* ``ring``: NCCL's ring reduce-scatter; the chunk ending on rank c is summed
  from rank c+1 around to rank c, rounding to the wire dtype after every hop;
* ``tree``: pairwise summation in the wire dtype (rounding after every add);
* ``fp32``: production's all-to-all + fp32 accumulation in rank order, one
  rounding to the wire dtype at the end.

Each result is compared with the correctly rounded exact sum (``verify.oracle``):
normwise relative error against the exact sum, max and median ULP distance,
and the fraction of elements correctly rounded. Per method the growth exponent
(the log-log slope of the error against N) is fitted and printed beside the
theory (``sqrt(N)·u`` typical, ``(N-1)·u`` worst case) and beside the seed's
claimed numbers, which are printed, never tuned to.

The vectorised models here are bitwise equal to ``refgrad.reduce_scatter`` (tested);
torch's elementwise fp16/bf16 addition is correctly rounded because it computes
in fp32 and 24 >= 2·p + 2 makes that double rounding innocuous.

``--backend dist`` (under torchrun) measures the process group's real
reduce-scatter and all-reduce instead, and reports which model they match.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from refgrad.formats import tensor_bit_patterns

METHODS: tuple[str, ...] = ("ring", "tree", "fp32")
METHOD_LABELS = {
    "ring": "ring (wire)",
    "tree": "tree (wire)",
    "fp32": "fp32-accumulate",
    "rank": "rank order (wire)",
    "ring_reverse": "reverse ring (wire)",
}
DISTRIBUTIONS: tuple[str, ...] = ("normal", "gradient", "same_sign")
DISTRIBUTION_HELP = {
    "normal": "iid N(0, 1) on every rank",
    "gradient": (
        "gradient-like: per-element scale 2^U(-16,0), a shared mean plus per-rank "
        "heavy-tailed (log-normal scale-mixture) noise"
    ),
    "same_sign": "|N(0, 1)|: every addend positive, no cancellation",
}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"fp16": "float16", "float16": "float16", "half": "float16",
                 "bf16": "bfloat16", "bfloat16": "bfloat16"}
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
DEFAULT_DP: tuple[int, ...] = tuple(2**k for k in range(1, 11))
DEFAULT_NUMEL = 98 * 1024  # 100352: >= 10^5 elements per point, divisible by every default N
# Elements of one block of [N, columns] processed at once: bounds memory at large N.
BLOCK_ELEMENTS = 2**23

# The seed's claimed "gradient error" (no metric or distribution given), printed
# beside our measurements of fp16 data for ring (wire) and fp32 accumulation.
SEED_CLAIMS: dict[str, dict[int, float]] = {
    "ring": {8: 1e-5, 64: 8e-5, 512: 6e-4},
    "fp32": {8: 1e-7, 64: 8e-7, 512: 6e-6},
}

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# ----------------------------------------------------------------------------
# Vectorised reduction models (bitwise equal to refgrad.reduce_scatter)
# ----------------------------------------------------------------------------


def ring_reduce(
    stacked: torch.Tensor, chunk_numel: int, first_chunk: int = 0, *, reverse: bool = False
) -> torch.Tensor:
    """NCCL-ring model over whole chunks: ``stacked`` is ``[W, q * chunk_numel]``, the
    columns of chunks ``first_chunk .. first_chunk + q - 1``; chunk c is summed in the
    wire dtype from rank c+1 around to rank c (``reverse``: from rank c-1 down to rank c,
    the ring run the other way, as gloo does). Returns ``[q * chunk_numel]``.
    """
    world_size, columns = stacked.shape
    if chunk_numel <= 0 or columns % chunk_numel:
        raise ValueError(
            f"stacked has {columns} columns, not a whole number of chunks of {chunk_numel}"
        )
    chunks = columns // chunk_numel
    by_chunk = stacked.view(world_size, chunks, chunk_numel)
    chunk_ids = torch.arange(chunks, device=stacked.device)
    global_chunks = chunk_ids + first_chunk
    sign = -1 if reverse else 1
    acc = by_chunk[(global_chunks + sign) % world_size, chunk_ids].clone()
    for step in range(1, world_size):
        acc.add_(by_chunk[(global_chunks + sign * (1 + step)) % world_size, chunk_ids])
    return acc.view(-1)


def rank_reduce(stacked: torch.Tensor) -> torch.Tensor:
    """Rank order 0..W-1 in the wire dtype (rounding after every addition)."""
    acc = stacked[0].clone()
    for rank in range(1, stacked.shape[0]):
        acc.add_(stacked[rank])
    return acc


def tree_reduce(stacked: torch.Tensor) -> torch.Tensor:
    """Pairwise in the wire dtype: adjacent pairs per level, an odd one out passed up."""
    level = stacked
    while level.shape[0] > 1:
        pairs = level.shape[0] // 2
        summed = level[0 : 2 * pairs : 2] + level[1 : 2 * pairs : 2]
        level = torch.cat([summed, level[-1:]]) if level.shape[0] % 2 else summed
    return level[0].clone()


def fp32_reduce(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank order accumulated in fp32, rounded once: (wire-dtype result, fp32 accumulator)."""
    acc = stacked[0].to(torch.float32, copy=True)  # never alias (and then modify) an fp32 input
    widened = torch.empty_like(acc)
    for rank in range(1, stacked.shape[0]):
        widened.copy_(stacked[rank])  # exact; a mixed-dtype add_ is torch's slow path
        acc.add_(widened)
    return acc.to(stacked.dtype), acc


# ----------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------


def generate(
    distribution: str, world_size: int, columns: int, generator: torch.Generator
) -> torch.Tensor:
    """``[world_size, columns]`` float32 samples of a named distribution."""
    if distribution == "normal":
        return torch.randn(world_size, columns, generator=generator)
    if distribution == "same_sign":
        return torch.randn(world_size, columns, generator=generator).abs_()
    if distribution == "gradient":
        scale = torch.exp2(-16.0 * torch.rand(columns, generator=generator))
        shared = 0.5 * torch.randn(columns, generator=generator)
        noise = torch.randn(world_size, columns, generator=generator)
        noise.mul_(torch.exp(0.75 * torch.randn(world_size, columns, generator=generator)))
        return noise.add_(shared).mul_(scale)
    raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")


# ----------------------------------------------------------------------------
# Metrics against the exact sum
# ----------------------------------------------------------------------------


@dataclass
class _Accumulator:
    """Running sums of one (dtype, distribution, N, method) point over column blocks."""

    sq_error: float = 0.0
    sq_exact: float = 0.0
    sq_error_fp32: float = 0.0
    ulps: list[torch.Tensor] = field(default_factory=list)

    def add(self, result: torch.Tensor, exact64: torch.Tensor, rounded: torch.Tensor,
            fp32_acc: torch.Tensor | None = None) -> None:
        from verify.metrics import ulp_distance

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


def float64_sum_is_exact(stacked: torch.Tensor) -> torch.Tensor:
    """Per column: True where summing the column in float64, in any order, is exact.

    A column whose nonzero elements are integer multiples of a quantum ``q`` and
    below ``M`` in magnitude has every partial sum an integer multiple of ``q``
    below ``W·M``; when ``W·M/q <= 2^53`` each partial sum is a float64 number,
    so every IEEE addition returns it exactly. fp16: ``q >= 2^-24`` and
    ``M <= 2^16``, so every column qualifies for ``W <= 2^13``. bf16: ``q`` and
    ``M`` are read per column from the exponent fields. Other dtypes: no column.
    """
    world_size, columns = stacked.shape
    log2_w = max(0, math.ceil(math.log2(world_size)))
    if stacked.dtype == torch.float16:
        return torch.full((columns,), 40 + log2_w <= 53, dtype=torch.bool, device=stacked.device)
    if stacked.dtype != torch.bfloat16:
        return torch.zeros(columns, dtype=torch.bool, device=stacked.device)
    bits = tensor_bit_patterns(stacked) & 0x7FFF
    exponent = bits >> 7  # biased exponent field; 0 for zeros and subnormals
    # x (nonzero) is a multiple of 2^(max(e,1)-134) and below 2^(e-126); zeros constrain nothing.
    quantum_exp = torch.where(bits == 0, 255, exponent.clamp(min=1)).amin(dim=0)
    top_exp = exponent.amax(dim=0)
    return (top_exp < 255) & (top_exp - quantum_exp + 8 + log2_w <= 53)


def _split_into_three_float32(exact64: torch.Tensor) -> torch.Tensor:
    """``[3, n]`` float32 ``(a, b, c)`` with ``a + b + c == x`` exactly, for finite float64 x
    with |x| < 2^127 holding at most 53 significant bits above 2^-149 (checked)."""
    a = exact64.to(torch.float32)
    rest = exact64 - a.to(torch.float64)  # exact: x and a agree to within half an fp32 ulp of x
    b = rest.to(torch.float32)
    rest = rest - b.to(torch.float64)
    c = rest.to(torch.float32)
    if not torch.equal(rest - c.to(torch.float64), torch.zeros_like(rest)):
        raise ArithmeticError("float64 -> 3 x float32 split was not exact")
    # A -0 sum must stay -0: IEEE gives -0 only when every addend is -0.
    zero = a == 0
    return torch.stack([a, torch.where(zero, a, b), torch.where(zero, a, c)])


def exact_references(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact sum as float64, correctly rounded sum in the wire dtype), per column.

    The correctly rounded value is always exact. Where :func:`float64_sum_is_exact`
    holds, the float64 column sum is the exact sum; it is split into three
    float32 parts with the same exact sum, which ``verify.oracle`` rounds once
    (3 rows instead of W). Other columns go to the oracle with all W rows. The
    float64 value of those columns (used only for the normwise error) has error
    at most (W-1)·2^-53·sum|x|, ~10^10 below the errors measured here.
    """
    from verify.oracle import correctly_rounded_sum

    exact64 = stacked.sum(dim=0, dtype=torch.float64)
    zero = exact64 == 0
    if bool(zero.any()):
        # torch's sum starts from +0, but IEEE makes a sum of only -0 addends -0.
        negative_zero_bits = 1 << (8 * stacked.element_size() - 1)
        all_negative_zero = (tensor_bit_patterns(stacked[:, zero]) == negative_zero_bits).all(dim=0)
        exact64[zero] = torch.where(all_negative_zero, -0.0, 0.0).to(torch.float64)
    fast = float64_sum_is_exact(stacked) & (exact64.abs() < 2.0**127)
    rounded = torch.empty(exact64.shape, dtype=stacked.dtype, device=stacked.device)
    if bool(fast.all()):
        return exact64, correctly_rounded_sum(_split_into_three_float32(exact64), stacked.dtype)
    if bool(fast.any()):
        parts = _split_into_three_float32(exact64[fast])
        rounded[fast] = correctly_rounded_sum(parts, stacked.dtype)
    slow = ~fast
    if bool(slow.any()):
        rounded[slow] = correctly_rounded_sum(stacked[:, slow], stacked.dtype)
    return exact64, rounded


# ----------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepConfig:
    """What to sweep; validated on construction."""

    dp_sizes: tuple[int, ...] = DEFAULT_DP
    dtypes: tuple[str, ...] = tuple(DTYPES)
    distributions: tuple[str, ...] = DISTRIBUTIONS
    methods: tuple[str, ...] = METHODS
    numel: int = DEFAULT_NUMEL
    seed: int = 0
    block_elements: int = BLOCK_ELEMENTS  # memory bound per [N, columns] block (>= 1 chunk)

    def __post_init__(self) -> None:
        if not self.dp_sizes or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in self.dp_sizes
        ):
            raise ValueError(f"dp_sizes must be integers >= 2, got {self.dp_sizes}")
        if any(n > 8192 for n in self.dp_sizes):
            raise ValueError(
                f"dp_sizes must be <= 8192 (the float64 reference is exact for fp16 only "
                f"up to 2^13 terms), got {self.dp_sizes}"
            )
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


def run_sweep(
    config: SweepConfig, progress: Callable[[int, int, str], None] | None = None
) -> list[Point]:
    """Measure every (dtype, distribution, N, method) point of ``config``."""
    points: list[Point] = []
    total = len(config.distributions) * len(config.dp_sizes)
    done = 0
    for distribution in config.distributions:
        for dp in config.dp_sizes:
            numel = config.numel_for(dp)
            chunk_numel = numel // dp
            chunks_per_block = max(1, config.block_elements // (dp * chunk_numel))
            block_columns = chunks_per_block * chunk_numel
            accs = {(d, m): _Accumulator() for d in config.dtypes for m in config.methods}
            for block, start in enumerate(range(0, numel, block_columns)):
                columns = min(block_columns, numel - start)
                gen = torch.Generator().manual_seed(_seed_for(config, distribution, dp, block))
                sample = generate(distribution, dp, columns, gen)
                for dtype in config.dtypes:
                    stacked = sample.to(DTYPES[dtype])
                    exact64, rounded = exact_references(stacked)
                    for method in config.methods:
                        fp32_acc = None
                        if method == "ring":
                            result = ring_reduce(stacked, chunk_numel, start // chunk_numel)
                        elif method == "tree":
                            result = tree_reduce(stacked)
                        else:
                            result, fp32_acc = fp32_reduce(stacked)
                        accs[(dtype, method)].add(result, exact64, rounded, fp32_acc)
            for (dtype, method), acc in accs.items():
                points.append(_finish(acc, dtype, distribution, dp, method))
            done += 1
            if progress is not None:
                progress(done, total, f"{distribution} N={dp}")
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


def seed_claims_table(points: Sequence[Point]) -> list[dict[str, Any]]:
    """The seed's claimed errors beside our fp16 measurements at the same N."""
    rows = []
    for method, claims in SEED_CLAIMS.items():
        for dp, claimed in claims.items():
            for p in points:
                if (p.dtype, p.method, p.dp) == ("float16", method, dp):
                    rows.append({
                        "seed_claim": f"{'FP16' if method == 'ring' else 'FP32'} accumulation",
                        "dp": dp,
                        "claimed": claimed,
                        "distribution": p.distribution,
                        "measured_rel_error": p.rel_error,
                        "measured_fp32_accumulator_rel_error": p.rel_error_fp32_accumulator,
                    })
    return rows


# ----------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}e}"


def _slope(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}"


POINT_COLUMNS = ("N", "method", "rel.err", "max ULP", "median ULP", "correctly rounded",
                 "sqrt(N)*u", "(N-1)*u")


def point_rows(points: Sequence[Point], dtype: str, distribution: str) -> list[list[str]]:
    """Table rows (``POINT_COLUMNS``) of one dtype and distribution, by N then method."""
    rows = []
    for p in sorted((p for p in points if p.dtype == dtype and p.distribution == distribution),
                    key=lambda p: (p.dp, METHODS.index(p.method))):
        rows.append([str(p.dp), METHOD_LABELS[p.method], _fmt(p.rel_error), str(p.max_ulp),
                     f"{p.median_ulp:g}", f"{100 * p.frac_correctly_rounded:.2f}%",
                     _fmt(p.theory_typical), _fmt(p.theory_worst)])
    return rows


def _text_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) if rows else len(str(c))
              for i, c in enumerate(columns)]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _md_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _sections(points: Sequence[Point], config: SweepConfig):
    """(title, columns, rows, notes) for every table of the report."""
    sections = []
    for dtype in config.dtypes:
        for distribution in config.distributions:
            sections.append((
                f"{dtype}, {distribution}: error vs N against the correctly rounded exact sum",
                POINT_COLUMNS,
                point_rows(points, dtype, distribution),
                [f"{distribution}: {DISTRIBUTION_HELP[distribution]}; u = "
                 f"2^{int(math.log2(UNIT_ROUNDOFF[dtype]))}; >= {config.numel} elements per point"],
            ))
    growth = growth_table(points)
    sections.append((
        "Growth exponents: fitted log-log slope of the error against N",
        ("dtype", "distribution", "method", "N range", "slope rel.err", "slope max ULP",
         "theory typical", "theory worst"),
        [[g["dtype"], g["distribution"], METHOD_LABELS[g["method"]], g["dp_range"],
          _slope(g["slope_rel_error"]), _slope(g["slope_max_ulp"]), "+0.50", "+1.00"]
         for g in growth],
        ["theory: sqrt(N)*u typical (Higham & Mary), (N-1)*u worst case for recursive "
         "summation; fp32 accumulation's error is dominated by the single final rounding, "
         "so its expected slope is ~0 until (N-1)*2^-24 approaches u"],
    ))
    claims = seed_claims_table(points)
    if claims:
        sections.append((
            "The seed's claims beside the measured values (fp16 data)",
            ("seed claim", "N", "claimed", "distribution", "measured rel.err",
             "measured fp32 accumulator (before downcast)"),
            [[c["seed_claim"], str(c["dp"]), _fmt(c["claimed"], 0), c["distribution"],
              _fmt(c["measured_rel_error"]), _fmt(c["measured_fp32_accumulator_rel_error"])]
             for c in claims],
            ["the seed names no metric or input distribution; our metric is the normwise "
             "relative error ||s^ - s||_2 / ||s||_2 of the delivered fp16 result. Nothing "
             "here is tuned to match the claims."],
        ))
    return sections


def render_text(points: Sequence[Point], config: SweepConfig) -> str:
    """Every table of the report as plain text."""
    out = []
    for title, columns, rows, notes in _sections(points, config):
        out += [f"== {title}", _text_table(columns, rows)] + [f"   note: {n}" for n in notes] + [""]
    return "\n".join(out)


def render_markdown(points: Sequence[Point], config: SweepConfig) -> str:
    """Every table of the report as Markdown."""
    out = ["# Reduction error vs data-parallel size", ""]
    for title, columns, rows, notes in _sections(points, config):
        out += [f"## {title}", "", _md_table(columns, rows), ""] + [f"*{n}*" for n in notes] + [""]
    return "\n".join(out)


def write_plot(points: Sequence[Point], config: SweepConfig, path: str) -> bool:
    """Error vs N on log-log axes with the theory curves; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(
        len(config.dtypes), len(config.distributions),
        figsize=(4.5 * len(config.distributions), 3.6 * len(config.dtypes)), squeeze=False,
    )
    dps = sorted(config.dp_sizes)
    for i, dtype in enumerate(config.dtypes):
        u = UNIT_ROUNDOFF[dtype]
        for j, distribution in enumerate(config.distributions):
            ax = axes[i][j]
            for method in config.methods:
                series = sorted((p for p in points if (p.dtype, p.distribution, p.method)
                                 == (dtype, distribution, method)), key=lambda p: p.dp)
                ax.loglog([p.dp for p in series], [p.rel_error for p in series], "o-",
                          label=METHOD_LABELS[method])
            ax.loglog(dps, [math.sqrt(n) * u for n in dps], "k--", lw=0.8, label="sqrt(N)·u")
            ax.loglog(dps, [(n - 1) * u for n in dps], "k:", lw=0.8, label="(N-1)·u")
            ax.set_title(f"{dtype}, {distribution}", fontsize=9)
            ax.set_xlabel("data-parallel size N")
            ax.set_ylabel("normwise relative error")
            ax.grid(True, which="both", lw=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

"""Rendering of ``verify accumulation``: text and Markdown tables, and the log-log plot."""

from __future__ import annotations

import math
from collections.abc import Sequence

from verify.studies.reduce_scatter.models import (
    DISTRIBUTION_HELP,
    METHOD_LABELS,
    METHODS,
    UNIT_ROUNDOFF,
)
from verify.studies.reduce_scatter.sweep import (
    Point,
    SweepConfig,
    growth_table,
    published_claims_table,
)


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


def text_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A right-aligned plain-text table."""
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) if rows else len(str(c))
              for i, c in enumerate(columns)]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def md_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
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
    claims = published_claims_table(points)
    if claims:
        sections.append((
            "Megatron-Core's published claims beside the measured values (fp16 data)",
            ("published claim", "N", "claimed", "distribution", "measured rel.err",
             "measured fp32 accumulator (before downcast)"),
            [[c["published_claim"], str(c["dp"]), _fmt(c["claimed"], 0), c["distribution"],
              _fmt(c["measured_rel_error"]), _fmt(c["measured_fp32_accumulator_rel_error"])]
             for c in claims],
            ["the published figures name no metric or input distribution; our metric is the normwise "
             "relative error ||s^ - s||_2 / ||s||_2 of the delivered fp16 result. Nothing "
             "here is tuned to match the claims."],
        ))
    return sections


def render_text(points: Sequence[Point], config: SweepConfig) -> str:
    """Every table of the report as plain text."""
    out = []
    for title, columns, rows, notes in _sections(points, config):
        out += [f"== {title}", text_table(columns, rows)] + [f"   note: {n}" for n in notes] + [""]
    return "\n".join(out)


def render_markdown(points: Sequence[Point], config: SweepConfig) -> str:
    """Every table of the report as Markdown."""
    out = ["# Reduction error vs data-parallel size", ""]
    for title, columns, rows, notes in _sections(points, config):
        out += [f"## {title}", "", md_table(columns, rows), ""] + [f"*{n}*" for n in notes] + [""]
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

"""Figures beside the reports: error growth with the DP size, and pipeline step timelines.

The data come from the tables the checks record (found by their columns, not their
titles) or from the points of ``verify accumulation``. matplotlib is optional for the
library; :func:`require_matplotlib` turns its absence into an error that says how
to install it.
"""

from __future__ import annotations

import importlib.util
import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from refgrad.formats import format_of
from verify.candidates import DEFAULT_CANDIDATE
from verify.check import CheckResult, Table

INSTALL_HINT = "pip install -e '.[plot]' (in the gradverify checkout; or: pip install matplotlib)"
# Unit roundoff of the 16-bit wire dtypes (refgrad's format table), under both spellings the
# tables use.
UNIT_ROUNDOFF = {spelling: float(format_of(name).unit_roundoff)
                 for spelling, name in (("fp16", "float16"), ("float16", "float16"),
                                        ("bf16", "bfloat16"), ("bfloat16", "bfloat16"))}
ERROR_GROWTH_COLUMNS = {"dtype", "distribution", "N", "method", "rel.err"}
TIMELINE_COLUMNS = {"case", "overlap", "step", "exposed sync"}

# (dtype, distribution) -> method -> [(N, relative error)]
GrowthSeries = Mapping[tuple[str, str], Mapping[str, Sequence[tuple[int, float]]]]


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


def matplotlib_available() -> bool:
    """True when matplotlib can be imported."""
    return importlib.util.find_spec("matplotlib") is not None


def require_matplotlib(option: str = "--plot") -> None:
    """Raise PlotUnavailable naming ``option`` when matplotlib is missing."""
    if not matplotlib_available():
        raise PlotUnavailable(f"{option} needs matplotlib, which is not installed: {INSTALL_HINT}")


def _pyplot() -> Any:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _dp_axis(ax: Any, dps: Sequence[int]) -> None:
    """Log2 x axis labelled at the measured N only: minor ticks carry no labels, so no
    unreadable row of overlapping numbers."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ticks = sorted(set(dps))
    if len(ticks) > 8:  # keep about eight labels
        ticks = ticks[:: math.ceil(len(ticks) / 8)]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.set_xticklabels([str(t) for t in ticks], fontsize=7)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_error_growth(series: GrowthSeries, path: str | Path, title: str = "") -> Path:
    """Relative error vs N per method, one panel per (dtype, distribution), with the
    sqrt(N)*u and (N-1)*u bounds; writes ``path`` (PNG) and returns it."""
    plt = _pyplot()
    keys = sorted(series)
    dtypes = sorted({d for d, _ in keys})
    distributions = sorted({s for _, s in keys})
    fig, axes = plt.subplots(len(dtypes), len(distributions), squeeze=False,
                             figsize=(4.6 * len(distributions), 3.6 * len(dtypes)))
    for i, dtype in enumerate(dtypes):
        for j, distribution in enumerate(distributions):
            ax = axes[i][j]
            methods = series.get((dtype, distribution), {})
            dps: list[int] = []
            for method, values in sorted(methods.items()):
                values = sorted(values)
                dps.extend(n for n, _ in values)
                ax.plot([n for n, _ in values], [e for _, e in values], "o-", ms=3, label=method)
            ax.set_yscale("log")
            u = UNIT_ROUNDOFF.get(dtype)
            if u is not None and dps:
                grid = sorted(set(dps))
                ax.plot(grid, [math.sqrt(n) * u for n in grid], "k--", lw=0.8, label="sqrt(N)·u")
                ax.plot(grid, [(n - 1) * u for n in grid], "k:", lw=0.8, label="(N-1)·u bound")
            if dps:
                _dp_axis(ax, dps)
            ax.set_title(f"{dtype}, {distribution}", fontsize=9)
            ax.set_xlabel("data-parallel size N", fontsize=8)
            ax.set_ylabel("normwise relative error", fontsize=8)
            ax.grid(True, which="major", lw=0.3)
    axes[0][0].legend(fontsize=7)
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, 40 * len(distributions))), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def plot_timelines(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Per case and overlap setting: the step split into compute and exposed grad sync
    (horizontal bars), the bubble fraction written beside each bar."""
    plt = _pyplot()
    labels = [f"{r['case']} (overlap {r['overlap']})" for r in rows]
    steps = [float(r["step"]) for r in rows]
    exposed = [float(r["exposed sync"]) for r in rows]
    compute = [s - e for s, e in zip(steps, exposed)]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.4))
    y = list(range(len(rows)))
    ax.barh(y, compute, color="#4c72b0", label="compute (until the last op on any rank)")
    ax.barh(y, exposed, left=compute, color="#dd8452", label="exposed grad sync")
    for yi, r, s in zip(y, rows, steps):
        if "bubble" in r:
            ax.text(s, yi, f"  bubble {float(r['bubble']):.2f}", va="center", fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.25 * max(steps, default=1.0))  # room for the bubble labels
    ax.set_xlabel("step time (ms)", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    if title:
        ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def _float(value: Any) -> float | None:
    try:
        return float(str(value).rstrip("%"))
    except ValueError:
        return None


def growth_series_from_table(table: Table) -> dict[tuple[str, str], dict[str, list[tuple[int, float]]]]:
    """The error-growth series held by a table with ERROR_GROWTH_COLUMNS."""
    index = {c: table.columns.index(c) for c in ERROR_GROWTH_COLUMNS}
    series: dict[tuple[str, str], dict[str, list[tuple[int, float]]]] = {}
    for row in table.rows:
        error = _float(row[index["rel.err"]])
        if error is None:
            continue
        key = (str(row[index["dtype"]]), str(row[index["distribution"]]))
        series.setdefault(key, {}).setdefault(str(row[index["method"]]), []).append(
            (int(row[index["N"]]), error))
    return series


def _rows(table: Table) -> list[dict[str, Any]]:
    return [dict(zip(table.columns, row)) for row in table.rows]


def _slug(text: str) -> str:
    """``text`` as a file-name part: letters, digits and '-' only."""
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


def report_plots(results: Iterable[CheckResult], directory: Path, stem: str) -> list[tuple[str, Path]]:
    """Draw every figure the results' tables support into ``directory``; ``(title, path)``
    per figure. Tables are recognised by their columns (see the module constants)."""
    written: list[tuple[str, Path]] = []
    for result in results:
        for k, table in enumerate(result.tables):
            columns = set(table.columns)
            # The default candidate keeps the short names; another one is named in the file.
            base = result.name if result.candidate in (None, DEFAULT_CANDIDATE) else (
                f"{result.name}-{_slug(result.candidate)}")
            suffix = f"{base}-{k}" if k else base
            if ERROR_GROWTH_COLUMNS <= columns and table.rows:
                path = directory / f"{stem}-error-growth-{suffix}.png"
                title = f"{result.key}: {table.title}"
                written.append((title, plot_error_growth(growth_series_from_table(table), path,
                                                         title)))
            elif TIMELINE_COLUMNS <= columns and table.rows:
                path = directory / f"{stem}-timeline-{suffix}.png"
                title = f"{result.key}: {table.title}"
                written.append((title, plot_timelines(_rows(table), path, title)))
    return written

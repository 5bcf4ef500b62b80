"""Reports: the terminal summary, JSON and Markdown renderings of check results."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verify.check import (
    ERROR,
    FAIL,
    PASS,
    SKIP,
    CheckResult,
    ComparisonRecord,
    DifferenceRecord,
    Table,
)
from verify.console import render_rich

REPORT_SCHEMA_VERSION = 3  # 2: verdict/status/complete, timings apart from results;
# 3: candidates (name, version, redirects) and each result's candidate and documented differences


def _json_safe(value: Any) -> Any:
    """Replace non-finite floats (not valid JSON) by strings, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


VERDICTS = (PASS, FAIL, ERROR, SKIP)


@dataclass
class Report:
    """The outcome of one ``verify run``: the environment, the candidates and every result
    (a technique check's once per candidate, a truth-layer check's once).

    ``complete`` is False when the run stopped early (Ctrl-C): the report then holds
    what finished. ``plots`` are ``(title, path)`` pairs, paths relative to the report.
    """

    env: dict[str, Any]
    checks: list[CheckResult] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    # ``CandidateInfo.to_dict()`` of each implementation the technique checks ran against.
    candidates: list[dict[str, Any]] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)
    complete: bool = True
    plots: list[tuple[str, str]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """How many checks ended in each status."""
        return {s: sum(c.status == s for c in self.checks) for s in VERDICTS}

    @property
    def verdict(self) -> str:
        """ERROR if any check errored or the run is incomplete; else FAIL if any failed (or
        nothing was verified); else PASS."""
        counts = self.counts()
        if counts[ERROR] or not self.complete:
            return ERROR
        if counts[FAIL] or not counts[PASS]:
            return FAIL
        return PASS

    @property
    def passed(self) -> bool:
        """True when the run is complete, at least one check passed and none failed or errored."""
        return self.verdict == PASS

    def to_dict(self) -> dict[str, Any]:
        """The JSON report. ``checks`` holds the results only (same seed, same results); wall
        times live apart in ``timings`` and the moment of the run in ``env``."""
        results = []
        for c in self.checks:
            entry = c.to_dict()
            entry.pop("seconds", None)
            results.append(entry)
        return _json_safe(
            {
                "schema_version": REPORT_SCHEMA_VERSION,
                "verdict": self.verdict,
                "passed": self.passed,
                "complete": self.complete,
                "gradverify": self.provenance,
                "options": self.options,
                "candidates": self.candidates,
                "checks": results,
                "timings": {
                    "total_seconds": sum(c.seconds for c in self.checks),
                    "checks": {c.key: c.seconds for c in self.checks},
                },
                "plots": [path for _, path in self.plots],
                "env": self.env,
            }
        )

    def write_json(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as indented JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def write_markdown(self, path: str | Path) -> None:
        """Write :func:`render_markdown` of this report to ``path``."""
        Path(path).write_text(render_markdown(self))


def _cell(value: Any) -> str:
    if isinstance(value, bool):  # informational yes/no, not a verdict: never "False"
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return str(value)
        if abs(value) >= 1e5 or abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


def render_table_text(table: Table, width: int = 100) -> str:
    """A recorded table as text that fits ``width`` columns (cells wrap when needed)."""
    from rich import box
    from rich.table import Table as RichTable

    rich_table = RichTable(title=table.title, title_justify="left", box=box.SIMPLE_HEAD,
                           pad_edge=False, expand=False)
    for column in table.columns:
        rich_table.add_column(str(column), overflow="fold")
    for row in table.rows:
        rich_table.add_row(*(_cell(v) for v in row))
    lines = [render_rich(rich_table, width)]
    lines.extend(_fit(f"note: {n}", width) for n in table.notes)
    return "\n".join(lines)


def render_table_markdown(table: Table) -> str:
    """One recorded table as a Markdown table with its title and notes."""
    lines = [f"**{table.title}**", ""]
    lines.append("| " + " | ".join(table.columns) + " |")
    lines.append("|" + "---|" * len(table.columns))
    lines.extend("| " + " | ".join(_cell(v) for v in row) + " |" for row in table.rows)
    lines.extend(f"\n_{n}_" for n in table.notes)
    return "\n".join(lines)


def _fit(text: str, width: int, indent: str = "") -> str:
    """One line of at most ``width`` columns (cut with an ellipsis)."""
    line = indent + text.replace("\n", " ")
    return line if len(line) <= width else line[: max(width - 1, 0)] + "…"


def _comparison_line(c: ComparisonRecord) -> str:
    m = c.metrics
    verdict = "ok  " if c.passed else "FAIL"
    bound = "bitwise" if c.max_ulp_allowed == 0 else f"<= {c.max_ulp_allowed} ulp"
    return (
        f"[{verdict}] {c.label}: n={m.get('n')} mismatches={m.get('n_mismatch')} "
        f"max_ulp={m.get('max_ulp')} ({bound})"
    )


def _error_headline(error: str) -> str:
    """The last line of a traceback: the exception and its message."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "error"


def verdict_line(report: Report) -> str:
    """``8 checks: 7 PASS, 1 FAIL -> FAIL`` (and the interruption, if any)."""
    counts = report.counts()
    parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    noun = "check" if len({r.candidate for r in report.checks} - {None}) <= 1 else "result"
    n = len(report.checks)
    line = f"{n} {noun}{'s' if n != 1 else ''}: {parts or 'none ran'} -> {report.verdict}"
    if report.verdict == FAIL and counts[SKIP] and not counts[FAIL] and not counts[PASS]:
        line += " (nothing verified: every check was skipped)"
    if not report.complete:
        line += " (interrupted: report incomplete)"
    return line


def _candidate_names(report: Report) -> list[str]:
    """The candidates' labels in the order they ran (results first, then the listed ones)."""
    names = [r.candidate for r in report.checks if r.candidate is not None]
    names += [c["name"] for c in report.candidates]
    return list(dict.fromkeys(names))


def candidates_line(report: Report) -> str:
    """``candidate: fastgrad 0.1.0`` (``candidates: ...`` for several), with redirects counted."""
    if not report.candidates:
        return ""
    parts = []
    for info in report.candidates:
        part = f"{info['name']} {info['version']}"
        if info.get("redirects"):
            part += f" ({len(info['redirects'])} CUDA assumptions redirected to the CPU)"
        parts.append(part)
    noun = "candidate" if len(parts) == 1 else "candidates"
    return f"{noun}: " + "; ".join(parts)


# Without -v, a failing check lists this many failed comparisons and expectations: a
# candidate with one bug can fail hundreds of cases, and the reports keep every one.
MAX_FAILURES_SHOWN = 12


def _difference_line(d: DifferenceRecord) -> str:
    m = d.metrics
    return (f"[documented] {d.label}: {m.get('n_mismatch')} of {m.get('n')} elements differ from "
            f"refgrad's spec, max_ulp={m.get('max_ulp')}: {d.behaviour} ({d.where})")


def _result_details(result: CheckResult, verbose: bool, width: int) -> list[str]:
    """What went wrong under a failing result; everything with ``verbose``."""
    lines = []
    details = [_comparison_line(c) for c in result.comparisons if verbose or not c.passed]
    details += [
        f"[{'ok  ' if e.passed else 'FAIL'}] {e.label}" + (f": {e.detail}" if e.detail else "")
        for e in result.expectations if verbose or not e.passed
    ]
    if result.status in (FAIL, ERROR) or verbose:
        shown = details if verbose else details[:MAX_FAILURES_SHOWN]
        lines.extend(_fit(d, width, "  ") for d in shown)
        if len(details) > len(shown):
            lines.append(f"  ... and {len(details) - len(shown)} more failing (see -v or the reports)")
    if result.error:
        if verbose:
            lines.append("  error:")
            lines.extend("    " + line for line in result.error.strip().splitlines())
        else:
            lines.append(_fit(f"error: {_error_headline(result.error)}", width, "  "))
    if verbose:
        lines.extend(_fit(_difference_line(d), width, "  ") for d in result.differences)
        lines.extend(_fit(f"skipped: {t}", width, "  ") for t in result.skipped)
        lines.extend(_fit(f"info: {t}", width, "  ") for t in result.notes)
        for table in result.tables:
            lines.append("")
            lines.append(render_table_text(table, width - 2).replace("\n", "\n  "))
    return lines


def _side_by_side_text(report: Report, names: list[str], width: int) -> str:
    """One row per check, one column per candidate: status, seconds, documented differences."""
    from rich import box
    from rich.table import Table as RichTable

    grid = RichTable(box=box.SIMPLE_HEAD, pad_edge=False, expand=False)
    grid.add_column("check")
    for name in names:
        grid.add_column(name, overflow="fold")
    for check in dict.fromkeys(r.name for r in report.checks):
        results = [r for r in report.checks if r.name == check]
        if len(results) == 1 and results[0].candidate is None:
            r = results[0]
            grid.add_row(check, f"{r.status} {r.seconds:.1f}s (truth layer, for all)",
                         *([""] * (len(names) - 1)))
            continue
        cells = []
        for name in names:
            r = next((r for r in results if r.candidate == name), None)
            if r is None:
                cells.append("-")
                continue
            cell = f"{r.status} {r.seconds:.1f}s"
            if r.differences:
                cell += f", {len(r.differences)} documented"
            cells.append(cell)
        grid.add_row(check, *cells)
    return render_rich(grid, width)


def render_text(report: Report, verbose: bool = False, width: int = 100) -> str:
    """The terminal summary, at most ``width`` columns: one line per check (a column per
    candidate when there are several), what went wrong under failing ones; every comparison,
    expectation, documented difference, finding and table with ``verbose``."""
    lines = []
    header = candidates_line(report)
    if header:
        lines.append(_fit(header, width))
    names = _candidate_names(report)
    if len(names) > 1:
        lines.append(_side_by_side_text(report, names, width))
        for result in report.checks:
            details = _result_details(result, verbose, width)
            if details:
                lines.append(_fit(f"{result.status} {result.key}:", width))
                lines.extend(details)
    else:
        name_width = max((len(r.name) for r in report.checks), default=8)
        for result in report.checks:
            lines.append(_fit(
                f"{result.status:<5} {result.name:<{name_width}} {result.seconds:6.1f}s  "
                f"{result.summary}", width))
            lines.extend(_result_details(result, verbose, width))
    lines.append("")
    lines.append(verdict_line(report))
    differences = sum(len(r.differences) for r in report.checks)
    if differences:
        lines.append(_fit(f"{differences} documented difference{'s' if differences != 1 else ''} "
                          "from refgrad's spec (production behaviour, each matching refgrad's "
                          "model of it): see -v or the reports", width))
    hidden = sum(len(r.notes) + len(r.skipped) for r in report.checks)
    if not verbose and hidden:
        lines.append(_fit(f"({hidden} findings and skipped items: see -v or the reports)", width))
    return "\n".join(lines)


MARKDOWN_COMPARISON_ROWS = 25
"""Beyond this many comparisons a check's Markdown lists only the notable ones (JSON has all)."""


def _comparison_rows_markdown(comparisons: Sequence[ComparisonRecord]) -> list[str]:
    """A table of comparisons: all of them when few, else a summary plus failures and ULP-bounded ones."""
    shown = list(comparisons)
    lines = []
    if len(comparisons) > MARKDOWN_COMPARISON_ROWS:
        bitwise = [c for c in comparisons if c.metrics.get("bitwise_equal")]
        worst = max((c.metrics.get("max_ulp") or 0) for c in comparisons)
        failed = sum(not c.passed for c in comparisons)
        lines.append(
            f"{len(comparisons)} comparisons: {len(bitwise)} bitwise equal, {failed} failed, "
            f"largest ULP distance {worst}. Listed below: failures and comparisons held to an "
            "ULP bound (every comparison is in the JSON report)."
        )
        lines.append("")
        shown = [c for c in comparisons if not c.passed or c.max_ulp_allowed > 0]
    if shown:
        lines.append("| comparison | bound | n | mismatches | max ULP | result |")
        lines.append("|---|---|---|---|---|---|")
        for c in shown:
            m = c.metrics
            bound = "bitwise" if c.max_ulp_allowed == 0 else f"<= {c.max_ulp_allowed} ULP"
            lines.append(
                f"| {c.label} | {bound} | {m.get('n')} | {m.get('n_mismatch')} | "
                f"{m.get('max_ulp')} | {'ok' if c.passed else 'FAIL'} |"
            )
    reasons = dict((c.label, c.reason) for c in shown if c.reason)
    lines.extend(f"\n_{label}: {reason}_" for label, reason in reasons.items())
    return lines


def _failures_markdown(report: Report) -> list[str]:
    """What failed or errored, before any detail."""
    lines = []
    for r in report.checks:
        if r.status not in (FAIL, ERROR):
            continue
        lines.extend(["", f"### {r.key}: {r.status}", ""])
        if r.error:
            lines.append(f"Error: `{_error_headline(r.error)}` (traceback under Details)")
        for c in r.comparisons:
            if not c.passed:
                lines.append(f"- comparison {c.label}: {c.metrics.get('n_mismatch')} mismatches, "
                             f"max ULP {c.metrics.get('max_ulp')} (bound {c.max_ulp_allowed})")
        lines.extend(f"- expectation {e.label}: {e.detail}" for e in r.expectations if not e.passed)
        if not (r.error or r.comparisons or r.expectations):
            lines.append("- the check recorded no comparison and no expectation")
    return lines


def render_markdown(report: Report) -> str:
    """The report as Markdown: verdict and summary first, then failures, plots, the
    details of each check, and the environment last."""
    lines = ["# gradverify report", "", f"**Result: {report.verdict}** ({verdict_line(report)})"]
    if not report.complete:
        lines += ["", "**Incomplete:** the run was interrupted (Ctrl-C). Each check that had not "
                      "finished is listed as ERROR, saying whether it was running or had not "
                      "started."]
    prov = report.provenance
    if prov:
        lines += ["", f"gradverify {prov.get('gradverify', 'unknown')}"
                      + (f", commit `{prov['git_commit']}`" if prov.get("git_commit") else "")
                      + (f"; options: `{json.dumps(report.options)}`" if report.options else "")]
    if report.candidates:
        lines += ["", "## Candidates", "", "| candidate | version | what | redirected on this "
                  "machine | cannot run here |", "|---|---|---|---|---|"]
        for info in report.candidates:
            redirects = "; ".join(info.get("redirects", [])) or "nothing"
            unsupported = "; ".join(f"{t}: {r}" for t, r in info.get("unsupported", {}).items())
            lines.append(f"| {info['name']} | {info['version']} | {info['description']} | "
                         f"{redirects} | {unsupported or '-'} |")
    names = _candidate_names(report)
    if len(names) > 1:
        lines += ["", "## Side by side", "", "| check | " + " | ".join(names) + " |",
                  "|---|" + "---|" * len(names)]
        for check in dict.fromkeys(r.name for r in report.checks):
            results = {r.candidate: r for r in report.checks if r.name == check}
            if None in results:
                cells = [f"{results[None].status} (truth layer, for all)"] + [""] * (len(names) - 1)
            else:
                cells = [(f"{results[n].status}"
                          + (f", {len(results[n].differences)} documented" if results[n].differences
                             else "")) if n in results else "-" for n in names]
            lines.append(f"| {check} | " + " | ".join(cells) + " |")
    lines += ["", "## Summary", "", "| check | candidate | result | seconds | comparisons | "
              "expectations | documented differences |", "|---|---|---|---|---|---|---|"]
    for r in report.checks:
        lines.append(f"| {r.name} | {r.candidate or '(truth layer)'} | {r.status} | "
                     f"{r.seconds:.1f} | {len(r.comparisons)} | {len(r.expectations)} | "
                     f"{len(r.differences)} |")
    failures = _failures_markdown(report)
    if failures:
        lines += ["", "## Failures and errors", *failures]
    if report.plots:
        lines += ["", "## Plots"]
        for title, path in report.plots:
            lines += ["", f"![{title}]({path})"]
    lines += ["", "## Details"]
    for r in report.checks:
        lines += ["", f"### {r.key}: {r.status}", "", r.summary]
        if r.error:
            lines.extend(["", "```", r.error.strip(), "```"])
        if r.comparisons:
            lines.extend(["", *_comparison_rows_markdown(r.comparisons)])
        failed = [e for e in r.expectations if not e.passed]
        if r.expectations:
            lines.append("")
            lines.append(f"{len(r.expectations) - len(failed)}/{len(r.expectations)} expectations hold.")
            lines.extend(f"- FAILED: {e.label}: {e.detail}" for e in failed)
        if r.differences:
            lines += ["", "Documented differences from refgrad's spec (each matched refgrad's "
                      "model of the behaviour; the distance is from the spec):", "",
                      "| comparison | behaviour | where | elements differing | max ULP |",
                      "|---|---|---|---|---|"]
            lines.extend(f"| {d.label} | {d.behaviour} | `{d.where}` | "
                         f"{d.metrics.get('n_mismatch')} of {d.metrics.get('n')} | "
                         f"{d.metrics.get('max_ulp')} |" for d in r.differences)
        for table in r.tables:
            lines.extend(["", render_table_markdown(table)])
        if r.notes:
            lines.extend(["", "Findings (informational):"])
            lines.extend(f"- {f}" for f in r.notes)
        if r.skipped:
            lines.extend(["", "Skipped:"])
            lines.extend(f"- {s}" for s in r.skipped)
    lines += ["", "## Environment", "", "```json", json.dumps(_json_safe(report.env), indent=2),
              "```"]
    return "\n".join(lines) + "\n"


def summarize(results: Sequence[CheckResult]) -> tuple[int, int]:
    """(passed, total)."""
    return sum(r.passed for r in results), len(results)

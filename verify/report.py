"""Reports: the terminal summary, JSON and Markdown renderings of check results."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verify.check import CheckResult, ComparisonRecord, Table

REPORT_SCHEMA_VERSION = 1


def _json_safe(value: Any) -> Any:
    """Replace non-finite floats (not valid JSON) by strings, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


@dataclass
class Report:
    """The outcome of one ``verify run``: the environment and every check's result."""

    env: dict[str, Any]
    checks: list[CheckResult] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when at least one check ran and every check passed."""
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """The JSON report: schema version, result, ``env``, options and ``checks``."""
        return _json_safe(
            {
                "schema_version": REPORT_SCHEMA_VERSION,
                "passed": self.passed,
                "env": self.env,
                "options": self.options,
                "checks": [c.to_dict() for c in self.checks],
            }
        )

    def write_json(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as indented JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def write_markdown(self, path: str | Path) -> None:
        """Write :func:`render_markdown` of this report to ``path``."""
        Path(path).write_text(render_markdown(self))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return str(value)
        if abs(value) >= 1e5 or abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


def render_table_text(table: Table) -> str:
    """A fixed-width text table."""
    cells = [[_cell(v) for v in row] for row in table.rows]
    widths = [len(c) for c in table.columns]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    lines = [table.title]
    lines.append("  ".join(c.ljust(w) for c, w in zip(table.columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells)
    lines.extend(f"  note: {n}" for n in table.notes)
    return "\n".join(lines)


def render_table_markdown(table: Table) -> str:
    """One recorded table as a Markdown table with its title and notes."""
    lines = [f"**{table.title}**", ""]
    lines.append("| " + " | ".join(table.columns) + " |")
    lines.append("|" + "---|" * len(table.columns))
    lines.extend("| " + " | ".join(_cell(v) for v in row) + " |" for row in table.rows)
    lines.extend(f"\n_{n}_" for n in table.notes)
    return "\n".join(lines)


def _comparison_line(c: Any) -> str:
    m = c.metrics
    verdict = "ok " if c.passed else "FAIL"
    bound = "bitwise" if c.max_ulp_allowed == 0 else f"<= {c.max_ulp_allowed} ulp"
    return (
        f"  [{verdict}] {c.label}: n={m.get('n')} mismatches={m.get('n_mismatch')} "
        f"max_ulp={m.get('max_ulp')} ({bound})"
    )


def render_text(report: Report, verbose: bool = False) -> str:
    """The terminal summary: one line per check, details for failures (or all with verbose)."""
    lines = []
    for result in report.checks:
        status = "PASS" if result.passed else "FAIL"
        lines.append(
            f"{status}  {result.name:<16} {result.seconds:6.1f}s  "
            f"{len(result.comparisons)} comparisons, {len(result.expectations)} expectations"
            f"  - {result.summary}"
        )
        show = verbose or not result.passed
        if show:
            lines.extend(_comparison_line(c) for c in result.comparisons if verbose or not c.passed)
            lines.extend(
                f"  [{'ok ' if e.passed else 'FAIL'}] {e.label}" + (f": {e.detail}" if e.detail else "")
                for e in result.expectations
                if verbose or not e.passed
            )
        if result.error:
            lines.append("  error:\n    " + result.error.strip().replace("\n", "\n    "))
        for text in result.skipped:
            lines.append(f"  skipped: {text}")
        if verbose:
            for table in result.tables:
                lines.append("")
                lines.append("  " + render_table_text(table).replace("\n", "\n  "))
        for text in result.findings:
            lines.append(f"  finding: {text}")
    passed = sum(r.passed for r in report.checks)
    lines.append("")
    lines.append(f"{passed}/{len(report.checks)} checks passed")
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


def render_markdown(report: Report) -> str:
    """The whole report as Markdown: result, environment, then each check."""
    lines = ["# gradverify report", ""]
    lines.append(f"**Result: {'PASS' if report.passed else 'FAIL'}**")
    lines.append("")
    lines.append("## Environment")
    lines.append("")
    lines.append("```json")
    lines.append(json.dumps(_json_safe(report.env), indent=2))
    lines.append("```")
    lines.append("")
    lines.append("## Summary")
    lines.append("")
    lines.append("| check | result | seconds | comparisons | expectations |")
    lines.append("|---|---|---|---|---|")
    for r in report.checks:
        lines.append(
            f"| {r.name} | {'PASS' if r.passed else 'FAIL'} | {r.seconds:.1f} | "
            f"{len(r.comparisons)} | {len(r.expectations)} |"
        )
    for r in report.checks:
        lines.append("")
        lines.append(f"## {r.name}: {'PASS' if r.passed else 'FAIL'}")
        lines.append("")
        lines.append(r.summary)
        if r.error:
            lines.extend(["", "```", r.error.strip(), "```"])
        if r.comparisons:
            lines.extend(["", *_comparison_rows_markdown(r.comparisons)])
        failed = [e for e in r.expectations if not e.passed]
        if r.expectations:
            lines.append("")
            lines.append(f"{len(r.expectations) - len(failed)}/{len(r.expectations)} expectations hold.")
            lines.extend(f"- FAILED: {e.label}: {e.detail}" for e in failed)
        for table in r.tables:
            lines.extend(["", render_table_markdown(table)])
        if r.findings:
            lines.extend(["", "Findings:"])
            lines.extend(f"- {f}" for f in r.findings)
        if r.skipped:
            lines.extend(["", "Skipped:"])
            lines.extend(f"- {s}" for s in r.skipped)
    return "\n".join(lines) + "\n"


def summarize(results: Sequence[CheckResult]) -> tuple[int, int]:
    """(passed, total)."""
    return sum(r.passed for r in results), len(results)

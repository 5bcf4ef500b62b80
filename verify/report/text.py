"""The terminal summary of a report: the findings first, then the grid of checks, then what
went wrong under each failing check, folded to its cases; everything with ``verbose``."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

from rich import box
from rich.table import Table as RichTable
from rich.text import Text

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
from verify.report.fold import (
    STAND_IN_NOTE,
    TRUTH_LAYER,
    CandidateFindings,
    CaseOutcome,
    FindingHit,
    candidate_info,
    case_outcomes,
    crash_text,
    error_headline,
    has_stand_in,
)
from verify.report.model import Report

# Without -v, a failing check lists this many failing cases and uncased failures: a candidate
# with one bug can fail hundreds of comparisons, and the reports keep every one.
MAX_FAILURES_SHOWN = 12
# Case examples given per check under a finding (as Megatron-LM flags; the reports have all).
EXAMPLES_PER_CHECK = 2


def cell(value: Any) -> str:
    """A table cell: yes/no for booleans, a short float, else the value's text."""
    if isinstance(value, bool):  # informational yes/no, not a verdict: never "False"
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return str(value)
        if abs(value) >= 1e5 or abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


def fit(text: str, width: int, indent: str = "") -> str:
    """One line of at most ``width`` columns (cut with an ellipsis)."""
    line = indent + text.replace("\n", " ")
    return line if len(line) <= width else line[: max(width - 1, 0)] + "…"


def render_table_text(table: Table, width: int = 100) -> str:
    """A recorded table as text that fits ``width`` columns (cells wrap when needed). Cells
    are plain text, never rich markup (a cell may hold a rank's message with brackets)."""
    rich_table = RichTable(title=Text(table.title), title_justify="left", box=box.SIMPLE_HEAD,
                           pad_edge=False, expand=False)
    for column in table.columns:
        rich_table.add_column(Text(str(column)), overflow="fold")
    for row in table.rows:
        rich_table.add_row(*(Text(cell(v)) for v in row))
    lines = [render_rich(rich_table, width)]
    lines.extend(fit(f"note: {n}", width) for n in table.notes)
    return "\n".join(lines)


def verdict_line(report: Report) -> str:
    """``8 checks: 7 PASS, 1 FAIL -> FAIL`` (and the interruption, if any)."""
    counts = report.counts()
    parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    noun = "check" if len({r.candidate for r in report.checks} - {None}) <= 1 else "result"
    n = len(report.checks)
    line = f"{n} {noun}{'s' if n != 1 else ''}: {parts or 'none ran'} -> {report.verdict}"
    if (report.verdict == FAIL and counts[SKIP] and not counts[PASS]
            and not report.found_failure and not counts[FAIL]):
        line += " (nothing verified: every check was skipped)"
    if not report.complete:
        line += " (interrupted: report incomplete)"
    return line


def candidate_names(report: Report) -> list[str]:
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


def finding_tag(finding: Mapping[str, Any]) -> str:
    """``#4 wrong gradient`` / ``#1 hazard, direct API use only (wrong gradient)``."""
    return f"#{finding['number']} {finding['class']}"


def shown_by(hit: FindingHit, examples: int = 0) -> str:
    """Which checks and how many cases showed a finding, with up to ``examples`` distinct
    cases per check spelled as their Megatron-LM flags (in backticks)."""
    parts = []
    for check, cases in hit.checks.items():
        part = f"{check} ({len(cases)} case{'s' if len(cases) != 1 else ''}"
        crashed = sum(bool(c.crashes) for c in cases)
        if crashed:
            part += f", {'all' if crashed == len(cases) else crashed} crashed"
        stand_in = sum(c.stand_in for c in cases)
        if stand_in:
            part += (f", {'all' if stand_in == len(cases) else stand_in} on the CPU stand-in for "
                     "apex's wgrad GEMM")
        reached = hit.reached.get(check, 0)
        if reached > len(cases):
            part += f"; its rule reaches {reached}"
        part += ")"
        named = list(dict.fromkeys(c.named for c in cases))
        if examples:
            part += ", e.g. " + ", ".join(f"`{n}`" for n in named[:examples])
        parts.append(part)
    return "; ".join(parts)


def cases_effect(cases: list[CaseOutcome]) -> str:
    """How cases failed, together: their distinct crashes (as crashes), else their failed
    comparisons (with the largest ULP distance) and expectations counted, the first named."""
    crashes = list(dict.fromkeys(crash_text(c).split(" on rank")[0]
                                 for case in cases for c in case.crashes))
    if crashes:
        return "; ".join(crashes)
    if len(cases) == 1:
        return cases[0].what()
    parts = []
    failed_c = sum(len(c.failed_comparisons) for c in cases)
    if failed_c:
        worst = max((c.worst_ulp or 0) for c in cases)
        parts.append(f"{failed_c} of {sum(c.comparisons for c in cases)} comparisons failed "
                     f"(max {worst} ULP)")
    failed_e = [e for c in cases for e in c.failed_expectations]
    if failed_e:
        parts.append(f"{len(failed_e)} of {sum(c.expectations for c in cases)} expectations "
                     f"failed, first: {failed_e[0].label}")
    return "; ".join(parts)


def finding_effect(hit: FindingHit) -> str:
    """How a finding showed: its distinct crashes, else its cases' failures counted."""
    return cases_effect(hit.cases)


def _findings_text(groups: list[CandidateFindings], width: int) -> list[str]:
    lines = [fit("findings (each root cause once; every case and comparison is in the reports):",
                 width)]
    for group in groups:
        if group.clean and group.candidate == TRUTH_LAYER:
            continue
        lines.append(fit(f"{group.title}: {group.counts()}", width, "  "))
        for case in group.unexplained:
            lines.append(fit(f"[FAIL] {case.check}: {case.named}: {case.what()}", width, "    "))
        for check, headline in group.errors:
            lines.append(fit(f"[ERROR] {check}: {headline}", width, "    "))
        for hit in (*group.findings, *group.hazards):
            lines.append(fit(f"{finding_tag(hit.finding)}: {hit.finding['title']}", width, "    "))
            lines.append(fit(f"shown by {shown_by(hit)}; avoid: {hit.finding['avoid']}", width,
                             "      "))
        if group.stand_in:
            where = ", ".join(f"{check} {n} cases" for check, n in group.stand_in.items())
            lines.append(fit(f"note: {STAND_IN_NOTE} ({where})", width, "    "))
    return lines


def comparison_line(c: ComparisonRecord) -> str:
    m = c.metrics
    verdict = "ok  " if c.passed else "FAIL"
    bound = "bitwise" if c.max_ulp_allowed == 0 else f"<= {c.max_ulp_allowed} ulp"
    return (f"[{verdict}] {c.label}: n={m.get('n')} mismatches={m.get('n_mismatch')} "
            f"max_ulp={m.get('max_ulp')} ({bound})")


def difference_line(d: DifferenceRecord) -> str:
    m = d.metrics
    if "n" not in m:  # a documented fact (layout, count), not a tensor
        detail = f": {m['detail']}" if m.get("detail") else ""
        return f"[documented] {d.label}{detail}: {d.behaviour} ({d.where})"
    return (f"[documented] {d.label}: {m.get('n_mismatch')} of {m.get('n')} elements differ from "
            f"refgrad's spec, max_ulp={m.get('max_ulp')}: {d.behaviour} ({d.where})")


def _failure_lines(result: CheckResult, outcomes: list[CaseOutcome]) -> list[str]:
    """One line per known finding (its cases counted), per case no finding explains, and per
    failure recorded outside any case."""
    lines = []
    by_finding = Counter(o.finding for o in outcomes if o.finding is not None)
    for key, n in by_finding.items():
        lines.append(f"[{finding_tag(result.known_findings[key])}] {n} case{'s' if n != 1 else ''}"
                     f": {result.known_findings[key]['title']}")
    for o in outcomes:
        if o.finding is not None:
            continue
        if o.label is not None:
            lines.append(f"[FAIL] {o.named} (case {o.label}): {o.what()}")
            continue
        lines.extend(f"[FAIL] {c.label}: {crash_text(c)}" for c in o.crashes)
        lines.extend(comparison_line(c) for c in o.failed_comparisons)
        lines.extend(f"[FAIL] {e.label}" + (f": {e.detail}" if e.detail else "")
                     for e in o.failed_expectations)
    return lines


def _result_details(report: Report, result: CheckResult, verbose: bool, width: int) -> list[str]:
    """What went wrong under a failing result, folded to its cases; everything with ``verbose``."""
    lines = []
    info = candidate_info(report.candidates, result.candidate)
    outcomes = case_outcomes(result, has_stand_in(info))
    if result.status in (FAIL, ERROR) or verbose:
        details = _failure_lines(result, outcomes)
        shown = details if verbose else details[:MAX_FAILURES_SHOWN]
        lines.extend(fit(d, width, "  ") for d in shown)
        if len(details) > len(shown):
            lines.append(f"  ... and {len(details) - len(shown)} more failing "
                         "(see -v or the reports)")
    if result.error:
        if verbose:
            lines.append("  error:")
            lines.extend("    " + line for line in result.error.strip().splitlines())
        else:
            lines.append(fit(f"error: {error_headline(result.error)}", width, "  "))
    if verbose:
        lines.extend(fit(comparison_line(c), width, "  ") for c in result.comparisons if c.passed)
        lines.extend(fit(f"[ok  ] {e.label}", width, "  ") for e in result.expectations if e.passed)
        lines.extend(fit(difference_line(d), width, "  ") for d in result.differences)
        lines.extend(fit(f"skipped: {t}", width, "  ") for t in result.skipped)
        lines.extend(fit(f"info: {t}", width, "  ") for t in result.notes)
        for table in result.tables:
            lines.append("")
            lines.append(render_table_text(table, width - 2).replace("\n", "\n  "))
    return lines


def grid_cell(result: CheckResult | None, seconds: bool = True) -> str:
    """A result in the grid: status, seconds, documented differences, hazards."""
    if result is None:
        return "-"
    text = result.status + (f" {result.seconds:.1f}s" if seconds else "")
    if result.differences:
        text += f", {len(result.differences)} documented"
    if result.hazards:
        text += f", {len(result.hazards)} hazard{'s' if len(result.hazards) != 1 else ''}"
    return text


def _side_by_side_text(report: Report, names: list[str], width: int) -> str:
    """One row per check, one column per candidate: status, seconds, documented differences."""
    grid = RichTable(box=box.SIMPLE_HEAD, pad_edge=False, expand=False)
    grid.add_column("check")
    for name in names:
        grid.add_column(Text(name), overflow="fold")
    for check in dict.fromkeys(r.name for r in report.checks):
        results = [r for r in report.checks if r.name == check]
        if len(results) == 1 and results[0].candidate is None:
            grid.add_row(Text(check), Text(f"{grid_cell(results[0])} (truth layer, for all)"),
                         *([""] * (len(names) - 1)))
            continue
        grid.add_row(Text(check), *(Text(grid_cell(next((r for r in results if r.candidate == n),
                                                        None))) for n in names))
    return render_rich(grid, width)


def render_text(report: Report, verbose: bool = False, width: int = 100) -> str:
    """The terminal summary, at most ``width`` columns: the findings per candidate (each
    known finding once, failures no finding explains, hazards), then one line per check (a
    column per candidate when there are several), what went wrong under failing ones; every
    comparison, expectation, documented difference, note and table with ``verbose``."""
    lines = []
    header = candidates_line(report)
    if header:
        lines.append(fit(header, width))
    groups = report.findings()
    if any(not g.clean for g in groups):
        lines.extend(_findings_text(groups, width))
    names = candidate_names(report)
    if len(names) > 1:
        lines.append(_side_by_side_text(report, names, width))
        for result in report.checks:
            details = _result_details(report, result, verbose, width)
            if details:
                lines.append(fit(f"{result.status} {result.key}:", width))
                lines.extend(details)
    else:
        name_width = max((len(r.name) for r in report.checks), default=8)
        for result in report.checks:
            lines.append(fit(f"{result.status:<5} {result.name:<{name_width}} "
                             f"{result.seconds:6.1f}s  {result.summary}", width))
            lines.extend(_result_details(report, result, verbose, width))
    lines.append("")
    lines.append(verdict_line(report))
    differences = sum(len(r.differences) for r in report.checks)
    if differences:
        lines.append(fit(f"{differences} documented difference{'s' if differences != 1 else ''} "
                         "from refgrad's spec (production behaviour, each matching refgrad's "
                         "model of it): see -v or the reports", width))
    hidden = sum(len(r.notes) + len(r.skipped) for r in report.checks)
    if not verbose and hidden:
        lines.append(fit(f"({hidden} notes and skipped items: see -v or the reports)", width))
    return "\n".join(lines)


__all__ = ["MAX_FAILURES_SHOWN", "candidates_line", "render_table_text", "render_text",
           "verdict_line"]

"""The Markdown report: the verdict, then the findings (one screen: per candidate and
version, failures no known finding explains, each known finding once, hazards), the grid of
checks, and each check's details folded to its cases; the environment last. The JSON report
keeps every record; this one keeps what a reader acts on."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from verify.check import CheckResult, ComparisonRecord, DifferenceRecord, Table
from verify.report.fold import (
    STAND_IN_NOTE,
    TRUTH_LAYER,
    CandidateFindings,
    CaseOutcome,
    FindingHit,
    candidate_info,
    case_outcomes,
    crash_text,
    has_stand_in,
)
from verify.report.model import Report, json_safe
from verify.report.text import (
    EXAMPLES_PER_CHECK,
    candidate_names,
    candidates_line,
    cases_effect,
    cell,
    finding_effect,
    finding_tag,
    grid_cell,
    shown_by,
    verdict_line,
)

MARKDOWN_COMPARISON_ROWS = 25
"""Beyond this many comparisons a check's Markdown lists only the notable ones (JSON has all)."""
MARKDOWN_TABLE_ROWS = 24
"""A recorded table longer than this shows its first rows (the JSON report has every row)."""

EXIT_MEANING = {
    "PASS": "exit code 0",
    "FAIL": "exit code 1: a candidate computed a wrong gradient or crashed where a Megatron-LM "
            "launch can reach it (or nothing was verified)",
    "ERROR": "exit code 3: no failure found, but the harness could not finish every check "
             "(a stall, a crash of its own, Ctrl-C): no verdict on those",
}


def _md(text: str) -> str:
    """Text for a Markdown table cell: one line, no column breaks."""
    return str(text).replace("\n", " ").replace("|", "\\|")


def render_table_markdown(table: Table, max_rows: int | None = MARKDOWN_TABLE_ROWS) -> str:
    """One recorded table as a Markdown table with its title and notes (its first
    ``max_rows`` rows; None: all)."""
    rows = table.rows if max_rows is None else table.rows[:max_rows]
    lines = [f"**{table.title}**", ""]
    lines.append("| " + " | ".join(_md(c) for c in table.columns) + " |")
    lines.append("|" + "---|" * len(table.columns))
    lines.extend("| " + " | ".join(_md(cell(v)) for v in row) + " |" for row in rows)
    if not table.rows:
        lines.append("\n_(no rows)_")
    if len(rows) < len(table.rows):
        lines.append(f"\n_… and {len(table.rows) - len(rows)} more rows (the JSON report has "
                     "every row)_")
    lines.extend(f"\n_{n}_" for n in table.notes)
    return "\n".join(lines)


def _finding_markdown(hit: FindingHit) -> list[str]:
    """One known finding, once, as a list item: class, title, the flags that reach it or why
    only direct API use does, where it showed and how, upstream, reproduction, what to change."""
    f = hit.finding
    reached = (f"`{f['launch']}`" if f["reachable"]
               else f"none: direct API use only ({f['api_only']})")
    effect = finding_effect(hit)
    return [f"- **{finding_tag(f)}**: {f['title']}",
            f"  - reached by: {reached}",
            f"  - shown by {shown_by(hit, EXAMPLES_PER_CHECK)}" + (f": {effect}" if effect else ""),
            f"  - upstream: {f['upstream']}; reproduce: `python {f['reproduction']}`",
            f"  - avoid: {f['avoid']}"]


def _case_line(case: CaseOutcome) -> str:
    where = f"`{case.named}` (case {case.label})" if case.label is not None else case.named
    return f"- {case.check}: {where}: {case.what()}"


def _findings_markdown(groups: list[CandidateFindings]) -> list[str]:
    lines = ["## Findings", "",
             "Each root cause once, per candidate and version: failures no known finding "
             "explains first (a new bug or a regression), then the known findings a "
             "Megatron-LM launch reaches, then hazards only direct API use reaches (reported, "
             "never failing the run). Cases are spelled as the Megatron-LM flags they stand "
             "for; every case and comparison is in the JSON report.", ""]
    stand_in = [(g, check, n) for g in groups for check, n in g.stand_in.items()]
    if stand_in:
        where = ", ".join(f"{check} [{g.candidate}] ({n} cases)" for g, check, n in stand_in)
        lines += [f"_Note: {STAND_IN_NOTE}: {where}._", ""]
    for group in groups:
        if group.clean and group.candidate == TRUTH_LAYER:
            continue
        lines += [f"### {group.title}: {group.counts()}", ""]
        if group.unexplained:
            lines += ["**Failures no known finding explains** (a new bug or a regression):"]
            lines += [_case_line(c) for c in group.unexplained[:8]]
            if len(group.unexplained) > 8:
                lines.append(f"- … and {len(group.unexplained) - 8} more (under Details)")
            lines.append("")
        if group.errors:
            lines += ["**Checks the harness could not finish** (no verdict on them):"]
            lines += [f"- {check}: `{headline}`" for check, headline in group.errors]
            lines.append("")
        if group.findings:
            lines += ["Known findings a Megatron-LM launch reaches (each fails the run):", ""]
            lines += [line for hit in group.findings for line in _finding_markdown(hit)] + [""]
        if group.hazards:
            lines += ["Hazards (direct API use only; reported, not failing the run):", ""]
            lines += [line for hit in group.hazards for line in _finding_markdown(hit)] + [""]
    return lines


def _grid_markdown(report: Report) -> list[str]:
    """One row per check, a column per candidate (with its version)."""
    names = candidate_names(report)
    versions = {r.candidate: r.candidate_version for r in report.checks if r.candidate_version}
    headers = []
    for n in names:
        version = versions.get(n) or (candidate_info(report.candidates, n) or {}).get("version")
        headers.append(f"{n} {version}" if version else n)
    lines = ["## Checks", "", "| check | " + " | ".join(headers) + " |",
             "|---|" + "---|" * len(names)]
    for check in dict.fromkeys(r.name for r in report.checks):
        results = {r.candidate: r for r in report.checks if r.name == check}
        if None in results:
            # One run verifies gradverify itself, for every candidate: said in each column.
            cells = [f"{grid_cell(results[None], seconds=False)} (truth layer, for all)"]
            cells += ["the same run"] * (len(names) - 1)
        else:
            cells = [grid_cell(results.get(n), seconds=False) for n in names]
        lines.append(f"| {check} | " + " | ".join(cells) + " |")
    return lines


def _candidates_markdown(report: Report) -> list[str]:
    lines = ["## Candidates", "", "| candidate | version | what | redirected on this machine | "
             "cannot run here |", "|---|---|---|---|---|"]
    for info in report.candidates:
        redirects = "; ".join(info.get("redirects", [])) or "nothing"
        unsupported = "; ".join(f"{t}: {r}" for t, r in info.get("unsupported", {}).items())
        lines.append(f"| {info['name']} | {info['version']} | {_md(info['description'])} | "
                     f"{_md(redirects)} | {_md(unsupported) or '-'} |")
    return lines


def _comparison_row(c: ComparisonRecord) -> str:
    m = c.metrics
    bound = "bitwise" if c.max_ulp_allowed == 0 else f"<= {c.max_ulp_allowed} ULP"
    return (f"| {_md(c.label)} | {bound} | {m.get('n')} | {m.get('n_mismatch')} | "
            f"{m.get('max_ulp')} | {'ok' if c.passed else 'FAIL'} |")


def _comparisons_markdown(comparisons: Sequence[ComparisonRecord], folded: set[str]) -> list[str]:
    """All comparisons when few; else a count, the failures outside the folded cases, and the
    ULP-bounded ones grouped by bound and reason. Every reason is said once."""
    if not comparisons:
        return []
    header = ["| comparison | bound | n | mismatches | max ULP | result |",
              "|---|---|---|---|---|---|"]
    if len(comparisons) <= MARKDOWN_COMPARISON_ROWS:
        # A failing case's comparisons are folded into its row above (a case that crashed is
        # shown as its crash, not as the distances it left).
        shown = [c for c in comparisons if c.passed or c.case not in folded]
        lines = header + [_comparison_row(c) for c in shown] if shown else []
        hidden = len(comparisons) - len(shown)
        if hidden:
            lines += [f"\n_{hidden} failing comparison{'s' if hidden != 1 else ''} of the failing "
                      "cases above are folded into their case (the JSON report has each)._"]
        reasons = dict.fromkeys((c.max_ulp_allowed, c.reason) for c in shown if c.reason)
        lines += [f"\n_<= {bound} ULP: {reason}_" for bound, reason in reasons]
        return lines
    bitwise = sum(bool(c.metrics.get("bitwise_equal")) for c in comparisons)
    failed = [c for c in comparisons if not c.passed]
    worst = max((c.metrics.get("max_ulp") or 0) for c in comparisons)
    lines = [f"{len(comparisons)} comparisons: {bitwise} bitwise equal, {len(failed)} failed, "
             f"largest ULP distance {worst} (every comparison is in the JSON report)."]
    loose = [c for c in failed if c.case not in folded]
    if loose:
        lines += ["", *header, *(_comparison_row(c) for c in loose[:MARKDOWN_COMPARISON_ROWS])]
        if len(loose) > MARKDOWN_COMPARISON_ROWS:
            lines.append(f"\n_… and {len(loose) - MARKDOWN_COMPARISON_ROWS} more failed_")
    bounded: dict[tuple[int, str], list[ComparisonRecord]] = {}
    for c in comparisons:
        if c.max_ulp_allowed > 0:
            bounded.setdefault((c.max_ulp_allowed, c.reason), []).append(c)
    if bounded:
        lines += ["", "| held to | comparisons | failed | largest ULP seen | why that bound |",
                  "|---|---|---|---|---|"]
        for (bound, reason), group in bounded.items():
            largest = max((c.metrics.get("max_ulp") or 0) for c in group)
            lines.append(f"| <= {bound} ULP | {len(group)} | {sum(not c.passed for c in group)} | "
                         f"{largest} | {_md(reason)} |")
    return lines


def _differences_markdown(differences: Sequence[DifferenceRecord]) -> list[str]:
    """Documented differences grouped by behaviour: how many records, how far from the spec."""
    groups: dict[tuple[str, str], list[DifferenceRecord]] = {}
    for d in differences:
        groups.setdefault((d.behaviour, d.where), []).append(d)
    lines = ["Documented differences from refgrad's spec (each matched refgrad's model of the "
             "behaviour; the distance is from the spec):", "",
             "| behaviour | where | results | differing from the spec |", "|---|---|---|---|"]
    for (behaviour, where), group in groups.items():
        tensors = [d.metrics for d in group if "n" in d.metrics]
        facts = [d for d in group if "n" not in d.metrics]
        parts = []
        if tensors:
            parts.append(f"{sum(m.get('n_mismatch') or 0 for m in tensors)} of "
                         f"{sum(m.get('n') or 0 for m in tensors)} elements, max "
                         f"{max(m.get('max_ulp') or 0 for m in tensors)} ULP")
        if facts:
            first = facts[0].metrics.get("detail") or facts[0].label
            parts.append(f"{len(facts)} fact{'s' if len(facts) != 1 else ''}, e.g. {first}")
        lines.append(f"| {_md(behaviour)} | `{_md(where)}` | {len(group)} | "
                     f"{_md('; '.join(parts))} |")
    return lines


def _cases_markdown(result: CheckResult, outcomes: list[CaseOutcome]) -> list[str]:
    """The failing cases folded to their root cause: a row per known finding (its cases
    counted, a few spelled as their Megatron-LM flags) and a row per case no finding explains;
    then the traceback of each crash no finding explains (once per exception and place)."""
    cased = [o for o in outcomes if o.label is not None]
    n = len(result.cases)
    lines = [f"{n} case{'s' if n != 1 else ''}, {len(cased)} failing" + (":" if cased else ".")]
    if cased:
        lines += ["", "| root cause | cases | what went wrong | as Megatron-LM flags |",
                  "|---|---|---|---|"]
        by_finding: dict[str, list[CaseOutcome]] = {}
        for o in cased:
            if o.finding is not None:
                by_finding.setdefault(o.finding, []).append(o)
        for key, cases in by_finding.items():
            named = list(dict.fromkeys(c.named for c in cases))
            examples = ", ".join(f"`{_md(n)}`" for n in named[:EXAMPLES_PER_CHECK])
            if len(named) > EXAMPLES_PER_CHECK:
                examples += f" and {len(named) - EXAMPLES_PER_CHECK} more"
            lines.append(f"| {finding_tag(result.known_findings[key])} | {len(cases)} | "
                         f"{_md(cases_effect(cases))} | {examples} |")
        for o in cased:
            if o.finding is None:
                lines.append(f"| **no known finding** (case {_md(o.label or '')}) | 1 | "
                             f"{_md(o.what())} | `{_md(o.named)}` |")
    shown: set[tuple[str, str]] = set()
    for o in outcomes:
        for crash in o.crashes if o.finding is None else ():
            if (crash.exception, crash.where) in shown or not crash.traceback:
                continue
            shown.add((crash.exception, crash.where))
            lines += ["", f"Traceback of `{_md(crash.label)}` ({crash_text(crash)}):", "",
                      "```", crash.traceback.strip(), "```"]
    return lines


def _details_markdown(report: Report, r: CheckResult) -> list[str]:
    info = candidate_info(report.candidates, r.candidate)
    outcomes = case_outcomes(r, has_stand_in(info))
    lines = ["", f"### {r.key}: {r.status}", "", r.summary]
    version = r.candidate_version or (info or {}).get("version")
    if r.candidate is not None and version:
        lines += ["", f"Ran on {r.candidate} {version}."]
    on_stand_in = sum(o.stand_in for o in outcomes) if r.cases else 0
    resting = (sum(bool(c.settings.get("has_output_layer")) for c in r.cases)
               if has_stand_in(info) else 0)
    if resting:
        lines += ["", f"_{resting} of its {len(r.cases)} cases ran Megatron-Core's output layer "
                      f"on the CPU stand-in for apex's wgrad GEMM (`wgrad_gemm_accum_fp32`/"
                      f"`_fp16`), {on_stand_in} of them failing: their results rest on it._"]
    if r.error:
        lines += ["", "```", r.error.strip(), "```"]
    if r.cases:
        lines += ["", *_cases_markdown(r, outcomes)]
    folded = {o.label for o in outcomes if o.label is not None}
    if r.crashes and any(c.case not in folded for c in r.crashes):
        lines += [""] + [f"- {c.label}: {crash_text(c)}" for c in r.crashes if c.case not in folded]
    if r.comparisons:
        lines += ["", *_comparisons_markdown(r.comparisons, folded)]
    if r.expectations:
        failed = [e for e in r.expectations if not e.passed]
        held = len(r.expectations) - len(failed)
        lines += ["", f"{held}/{len(r.expectations)} expectations hold."]
        lines += [f"- FAILED: {e.label}" + (f": {e.detail}" if e.detail else "")
                  for e in failed if e.case not in folded]
    if r.differences:
        lines += ["", *_differences_markdown(r.differences)]
    for table in r.tables:
        lines += ["", render_table_markdown(table)]
    if r.notes:
        lines += ["", "Notes:", *(f"- {n}" for n in r.notes)]
    if r.skipped:
        lines += ["", "Skipped:", *(f"- {s}" for s in r.skipped)]
    return lines


def render_markdown(report: Report) -> str:
    """The report as Markdown: the verdict and what it means for a CI job, the findings
    (one screen), the grid of checks, the candidates, plots, each check's details folded to
    its cases, and the environment last."""
    verdict = report.verdict
    lines = ["# gradverify report", "",
             f"**Result: {verdict}** ({verdict_line(report)}); {EXIT_MEANING[verdict]}."]
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
        lines += ["", candidates_line(report)]
    groups = report.findings()
    if any(not g.clean for g in groups):
        lines += ["", *_findings_markdown(groups)]
    lines += ["", *_grid_markdown(report)]
    if report.candidates:
        lines += ["", *_candidates_markdown(report)]
    if report.plots:
        lines += ["", "## Plots"]
        for title, path in report.plots:
            lines += ["", f"![{title}]({path})"]
    lines += ["", "## Details"]
    for r in report.checks:
        lines += _details_markdown(report, r)
    lines += ["", "## Environment", "", "```json", json.dumps(json_safe(report.env), indent=2),
              "```"]
    return "\n".join(lines) + "\n"


def write_markdown(report: Report, path: str | Path) -> None:
    """Write :func:`render_markdown` of ``report`` to ``path``."""
    Path(path).write_text(render_markdown(report))


__all__ = ["MARKDOWN_COMPARISON_ROWS", "MARKDOWN_TABLE_ROWS", "render_markdown",
           "render_table_markdown", "write_markdown"]

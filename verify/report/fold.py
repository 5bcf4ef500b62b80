"""A run's results folded into what a reader acts on: each failing case to its root cause.

A check can fail hundreds of comparisons for one bug. Here every failing case (a
:class:`~verify.check.CaseRecord`: one configuration, spelled as the Megatron-LM flags it
stands for) becomes one :class:`CaseOutcome`, a crash or its count of failed comparisons and
expectations, and the cases are grouped per candidate and version under the known finding
the recorder attributed them to (:class:`FindingHit`), as hazards (findings only direct API
use reaches, which never fail a run), or as failures no known finding explains (a new bug or
a regression). The renderings (text, Markdown) and the JSON report's ``findings`` read this;
the records themselves stay in each result.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verify.check import (
    ERROR,
    FAIL,
    CaseRecord,
    CheckResult,
    ComparisonRecord,
    CrashRecord,
    ExpectationRecord,
)

# Megatron-Core's CPU redirects that stand in for apex's fused wgrad GEMMs
# (``verify.candidates.megatron_core.redirect.REDIRECTS``): an output layer's weight gradient
# computed on a CPU rests on them, not on apex's CUDA kernel.
WGRAD_STAND_IN_REDIRECTS = ("wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16")
STAND_IN_NOTE = ("on this CPU, apex's fused wgrad GEMM (fused_weight_gradient_mlp_cuda."
                 "wgrad_gemm_accum_fp32/_fp16) is a stand-in that Megatron-Core's output layer "
                 "calls: results of cases with an output layer rest on it, not on apex's kernel")
TRUTH_LAYER = "gradverify (truth layer)"


_TRACEBACK_PROSE = ("Traceback (most recent call last):",
                    "During handling of the above exception, another exception occurred:",
                    "The above exception was the direct cause of the following exception:")


def error_headline(error: str) -> str:
    """The exception line of a traceback: the last unindented line (a message's own further
    lines, such as a stall's per-rank details, are indented), without a trailing colon."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    heads = [line for line in lines if not line[0].isspace() and line not in _TRACEBACK_PROSE]
    head = heads[-1] if heads else (lines[-1].strip() if lines else "error")
    return head.rstrip(":").rstrip() or "error"


def crash_text(crash: CrashRecord) -> str:
    """A crash as a crash: the exception, its message, where it was raised, on which ranks."""
    message = f": {crash.message}" if crash.message else ""
    where = f" (raised at {crash.where})" if crash.where else ""
    ranks = ", ".join(map(str, crash.ranks))
    plural = "s" if len(crash.ranks) != 1 else ""
    return f"crashed: {crash.exception}{message}{where} on rank{plural} {ranks}"


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"


@dataclass(frozen=True)
class CaseOutcome:
    """One failing case of one result, folded: a crash, or how many of its comparisons and
    expectations failed. ``label`` None gathers the failures a check recorded outside any
    case (``flags`` is then empty)."""

    check: str
    label: str | None
    flags: str
    api_only: str | None
    finding: str | None
    crashes: tuple[CrashRecord, ...]
    failed_comparisons: tuple[ComparisonRecord, ...]
    failed_expectations: tuple[ExpectationRecord, ...]
    comparisons: int  # recorded in the case, passed or not
    expectations: int
    stand_in: bool  # it ran an output layer on the CPU stand-in for apex's wgrad GEMM

    @property
    def named(self) -> str:
        """The case as the Megatron-LM flags it stands for (its label where it stands for none)."""
        if self.label is None:
            return "(outside any case)"
        return self.flags or self.label

    @property
    def worst_ulp(self) -> int | None:
        """The largest ULP distance among its failed comparisons (None: none failed)."""
        ulps = [c.metrics.get("max_ulp") for c in self.failed_comparisons]
        ulps = [u for u in ulps if isinstance(u, int)]
        return max(ulps) if ulps else None

    def what(self) -> str:
        """What went wrong, in one phrase: a crash as a crash, never as a distance."""
        if self.crashes:
            return crash_text(self.crashes[0])
        parts = []
        if self.failed_comparisons:
            worst = self.worst_ulp
            parts.append(f"{len(self.failed_comparisons)} of "
                         f"{_plural(self.comparisons, 'comparison')} failed"
                         + (f" (max {worst} ULP)" if worst is not None else ""))
        if self.failed_expectations:
            first = self.failed_expectations[0]
            fact = (first.label if self.label is None
                    else first.label.removeprefix(f"{self.label}: "))
            parts.append(f"{len(self.failed_expectations)} of "
                         f"{_plural(self.expectations, 'expectation')} failed, first: {fact}"
                         + (f" ({first.detail})" if first.detail else ""))
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for the JSON report's ``findings`` (the records stay in the result)."""
        return {"check": self.check, "case": self.label, "flags": self.flags,
                "api_only": self.api_only, "finding": self.finding, "what": self.what(),
                "crashes": [crash_text(c) for c in self.crashes],
                "failed_comparisons": [c.label for c in self.failed_comparisons],
                "failed_expectations": [e.label for e in self.failed_expectations],
                "wgrad_gemm_stand_in": self.stand_in}


@dataclass
class FindingHit:
    """One known finding a candidate's results hit, once, with every case that showed it.
    ``reached``: per check, how many of its cases the finding's rule reaches (some of them
    may have passed, or failed first with another finding)."""

    finding: dict[str, Any]  # Finding.to_dict()
    cases: list[CaseOutcome] = field(default_factory=list)
    reached: dict[str, int] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.finding["key"]

    @property
    def checks(self) -> dict[str, list[CaseOutcome]]:
        """The cases that showed it, per check, in the order the checks ran."""
        by_check: dict[str, list[CaseOutcome]] = {}
        for case in self.cases:
            by_check.setdefault(case.check, []).append(case)
        return by_check

    def to_dict(self) -> dict[str, Any]:
        return {**self.finding, "reached": self.reached,
                "cases": [c.to_dict() for c in self.cases]}


@dataclass
class CandidateFindings:
    """What one candidate, at one version, showed: the known findings a launch reaches (each
    fails the run), the hazards only direct API use reaches, the failures no known finding
    explains, the checks that ended in a harness error, and per check how many cases rest on
    the CPU stand-in for apex's wgrad GEMM."""

    candidate: str
    version: str
    findings: list[FindingHit] = field(default_factory=list)
    hazards: list[FindingHit] = field(default_factory=list)
    unexplained: list[CaseOutcome] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (check, error headline)
    stand_in: dict[str, int] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return f"{self.candidate} {self.version}".strip()

    @property
    def clean(self) -> bool:
        """Nothing to report: no finding, hazard, unexplained failure or error."""
        return not (self.findings or self.hazards or self.unexplained or self.errors)

    def counts(self) -> str:
        """``2 findings a launch reaches, 1 failure no finding explains, ...`` (non-zero parts)."""
        parts = [(len(self.unexplained), "failure no known finding explains",
                  "failures no known finding explains"),
                 (len(self.findings), "known finding a launch reaches",
                  "known findings a launch reaches"),
                 (len(self.hazards), "hazard (direct API use only)",
                  "hazards (direct API use only)"),
                 (len(self.errors), "check ended in an error", "checks ended in an error")]
        return ", ".join(_plural(n, one, many) for n, one, many in parts if n) or "no failures"

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "version": self.version,
                "unexplained": [c.to_dict() for c in self.unexplained],
                "findings": [f.to_dict() for f in self.findings],
                "hazards": [f.to_dict() for f in self.hazards],
                "errors": [{"check": check, "error": headline} for check, headline in self.errors],
                "wgrad_gemm_stand_in": self.stand_in}


def candidate_info(candidates: Sequence[Mapping[str, Any]], label: str | None
                   ) -> Mapping[str, Any] | None:
    """The ``CandidateInfo.to_dict()`` of the candidate a result names by ``label`` (its
    name, and for a test's deliberately broken candidate the fault it carries:
    ``Candidate.label``)."""
    name = (label or "").split(" (fault: ")[0]
    return next((info for info in candidates if info["name"] == name), None)


def has_stand_in(info: Mapping[str, Any] | None) -> bool:
    """Whether a candidate (``CandidateInfo.to_dict()``) ran with the wgrad GEMM stand-in."""
    redirects = (info or {}).get("redirects", [])
    return any(r.split(":", 1)[0].strip() in WGRAD_STAND_IN_REDIRECTS for r in redirects)


def rests_on_stand_in(case: CaseRecord, stand_in: bool) -> bool:
    """A case of a candidate with the stand-in that runs an output layer (its wgrad GEMM)."""
    return stand_in and bool(case.settings.get("has_output_layer", False))


def case_outcomes(result: CheckResult, stand_in: bool = False) -> list[CaseOutcome]:
    """``result``'s failing cases, each folded to one outcome, in the order they were
    recorded; the failures recorded outside any case last, as one outcome."""
    cases = {c.label: c for c in result.cases}
    crashes: dict[str | None, list[CrashRecord]] = {}
    comparisons: dict[str | None, list[ComparisonRecord]] = {}
    expectations: dict[str | None, list[ExpectationRecord]] = {}
    for crash in result.crashes:
        crashes.setdefault(crash.case if crash.case in cases else None, []).append(crash)
    for comparison in result.comparisons:
        comparisons.setdefault(comparison.case if comparison.case in cases else None,
                               []).append(comparison)
    for expectation in result.expectations:
        expectations.setdefault(expectation.case if expectation.case in cases else None,
                                []).append(expectation)
    outcomes = []
    for label in [*cases, None]:
        failed_c = tuple(c for c in comparisons.get(label, []) if not c.passed)
        failed_e = tuple(e for e in expectations.get(label, []) if not e.passed)
        crashed = tuple(crashes.get(label, []))
        if not (failed_c or failed_e or crashed):
            continue
        case = cases.get(label) if label is not None else None
        outcomes.append(CaseOutcome(
            check=result.name, label=label, flags=case.flags if case else "",
            api_only=case.api_only if case else None, finding=case.finding if case else None,
            crashes=crashed, failed_comparisons=failed_c, failed_expectations=failed_e,
            comparisons=len(comparisons.get(label, [])),
            expectations=len(expectations.get(label, [])),
            stand_in=rests_on_stand_in(case, stand_in) if case else False))
    return outcomes


def fold(results: Iterable[CheckResult], candidates: Sequence[Mapping[str, Any]] = ()
         ) -> list[CandidateFindings]:
    """Every result's failing cases, grouped per candidate and version (in the order the
    results are given): known findings (numbered order), hazards, unexplained failures and
    errors. ``candidates``: ``CandidateInfo.to_dict()`` of each candidate (its version when a
    result does not carry one, and its redirects)."""
    groups: dict[tuple[str, str], CandidateFindings] = {}
    hits: dict[tuple[str, str], dict[str, FindingHit]] = {}
    # per (candidate, version): finding key -> check -> cases its rule reaches
    reached: dict[tuple[str, str], dict[str, dict[str, int]]] = {}
    for result in results:
        name = result.candidate or TRUTH_LAYER
        info = candidate_info(candidates, result.candidate)
        version = result.candidate_version or (info or {}).get("version", "")
        key = (name, version)
        group = groups.setdefault(key, CandidateFindings(name, version))
        group_hits = hits.setdefault(key, {})
        stand_in = has_stand_in(info)
        on_stand_in = sum(rests_on_stand_in(c, stand_in) for c in result.cases)
        if on_stand_in:
            group.stand_in[result.name] = on_stand_in
        if result.status == ERROR and result.error:
            group.errors.append((result.name, error_headline(result.error)))
        group_reached = reached.setdefault(key, {})
        for case in result.cases:
            for finding in case.reaches:
                counts = group_reached.setdefault(finding, {})
                counts[result.name] = counts.get(result.name, 0) + 1
        for outcome in case_outcomes(result, stand_in):
            if outcome.finding is None:
                group.unexplained.append(outcome)
            else:
                finding = result.known_findings[outcome.finding]
                group_hits.setdefault(outcome.finding, FindingHit(finding)).cases.append(outcome)
    for key, group in groups.items():
        for hit in sorted(hits[key].values(), key=lambda h: h.finding["number"]):
            hit.reached = reached[key].get(hit.key, {})
            (group.findings if hit.finding["reachable"] else group.hazards).append(hit)
    return list(groups.values())


def fails_the_run(result: CheckResult) -> bool:
    """A FAIL, or an ERROR that had already recorded a failure a launch can reach (a wrong
    gradient or a crash no hazard excuses): a bug found stands whatever else went wrong."""
    if result.status != ERROR:
        return result.status == FAIL
    excused = {c.label for c in result.hazards}
    return (any(not r.passed and r.case not in excused
                for r in (*result.comparisons, *result.expectations))
            or any(c.case not in excused for c in result.crashes))

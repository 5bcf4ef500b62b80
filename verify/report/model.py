"""The report of one ``verify run``: its results, its verdict and the JSON rendering."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verify.check import ERROR, FAIL, PASS, SKIP, CheckResult
from verify.report.fold import CandidateFindings, fails_the_run, fold

REPORT_SCHEMA_VERSION = 4  # 2: verdict/status/complete, timings apart from results;
# 3: candidates (name, version, redirects) and each result's candidate and documented differences;
# 4: findings (per candidate and version: the known findings hit, each once with the cases that
# showed it, hazards, failures no finding explains, errors, what rests on the CPU stand-in for
# apex's wgrad GEMM) and each result's cases, crashes, known_findings and candidate_version


def json_safe(value: Any) -> Any:
    """Replace non-finite floats (not valid JSON) by strings, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
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
    def found_failure(self) -> bool:
        """A candidate computed a wrong gradient or crashed where a launch can reach it (a
        FAIL, or an ERROR that had recorded such a failure before it ended)."""
        return any(fails_the_run(c) for c in self.checks)

    @property
    def verdict(self) -> str:
        """FAIL if a failure was found (whatever else went wrong: a bug found stands); else
        ERROR if any check errored or the run is incomplete; else FAIL if nothing was
        verified (every check skipped); else PASS."""
        counts = self.counts()
        if self.found_failure or counts[FAIL]:
            return FAIL
        if counts[ERROR] or not self.complete:
            return ERROR
        if not counts[PASS]:
            return FAIL
        return PASS

    @property
    def passed(self) -> bool:
        """True when the run is complete, at least one check passed and none failed or errored."""
        return self.verdict == PASS

    def findings(self) -> list[CandidateFindings]:
        """The results folded per candidate and version (:func:`verify.report.fold.fold`)."""
        return fold(self.checks, self.candidates)

    def to_dict(self) -> dict[str, Any]:
        """The JSON report. ``checks`` holds the results only (same seed, same results); wall
        times live apart in ``timings`` and the moment of the run in ``env``; ``findings`` is
        the folded view the Markdown report opens with."""
        results = []
        for c in self.checks:
            entry = c.to_dict()
            entry.pop("seconds", None)
            results.append(entry)
        return json_safe(
            {
                "schema_version": REPORT_SCHEMA_VERSION,
                "verdict": self.verdict,
                "passed": self.passed,
                "complete": self.complete,
                "gradverify": self.provenance,
                "options": self.options,
                "candidates": self.candidates,
                "findings": [f.to_dict() for f in self.findings()],
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


def summarize(results: list[CheckResult]) -> tuple[int, int]:
    """(passed, total)."""
    return sum(r.passed for r in results), len(results)

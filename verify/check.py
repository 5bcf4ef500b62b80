"""The shape of a verification check and of what it reports.

A check is a named function that receives a :class:`CheckContext`, a
:class:`CheckRecorder` and a *candidate*. For a technique check the candidate is a
:class:`verify.candidates.Candidate`: the implementation under test (fastgrad by
default, Megatron-Core, or a deliberately broken one), reached only through its typed
interface for the check's :class:`verify.candidates.Technique`. The truth-layer checks
(formats, oracle, metrics) test verify's own arithmetic instead; their candidate is a small
frozen dataclass naming that component (``technique=None``), the same for every
implementation under test. Each check records comparisons (reference vs candidate, with an
explicit ULP bound), boolean expectations, tables and findings. The check passes
when every comparison is within its bound and every expectation holds; an
exception inside the check is recorded as a failure, never swallowed silently.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

import torch

from verify.attribution import explaining, launch_flags
from verify.candidates import (
    Candidate,
    DocumentedBehaviour,
    Technique,
    Unsupported,
    default_candidate,
)
from verify.candidates.interfaces import Finding, LaunchSettings
from verify.distributed import RankCrashed, RankLauncher, spawn_each
from verify.metrics import compare as compare_tensors  # CheckRecorder.compare is the method

_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class CheckContext:
    """Inputs shared by every check: where to run, how big, and which seed."""

    device: str = "cpu"
    seed: int = 0
    quick: bool = False
    # Stall timeout of each multi-rank phase a check starts (``verify.distributed.spawn``):
    # a phase none of whose ranks made progress (marker or CPU time) for this long turns
    # into an error naming them instead of a hang; slow ranks that compute are left alone.
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but torch.cuda.is_available() is False")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not self.timeout_s > 0:  # also refuses NaN
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")

    def generator(self, offset: int = 0) -> torch.Generator:
        """A CPU generator seeded from the context seed plus ``offset``."""
        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + offset)
        return g


@dataclass
class Table:
    """A small table for the report: a title, column names, rows and notes."""

    title: str
    columns: list[str]
    rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(
                    f"Table {self.title!r}: row {i} has {len(row)} cells, "
                    f"expected {len(self.columns)} (columns={self.columns})"
                )


@dataclass
class ComparisonRecord:
    """One reference-vs-candidate comparison and the bound it was held to."""

    label: str
    max_ulp_allowed: int
    passed: bool
    metrics: dict[str, Any]
    reason: str = ""
    case: str | None = None  # the case it belongs to (CaseRecord.label), if any


@dataclass
class CaseRecord:
    """One configuration a check ran: the Megatron-LM settings it stands for and, once the
    check has run, whether it passed and which of the candidate's known findings explains
    its failure (``finding``: a key; None: none, or it passed) or its settings reach."""

    label: str
    flags: str
    api_only: str | None
    settings: dict[str, Any]
    passed: bool = True
    finding: str | None = None
    reaches: list[str] = field(default_factory=list)


@dataclass
class CrashRecord:
    """A configuration whose run the candidate ended by raising (or dying) on some ranks:
    a crash with its root cause, never a numerical distance. ``traceback`` once, for every
    rank that raised the same."""

    label: str
    exception: str
    message: str
    where: str
    ranks: list[int]
    traceback: str
    case: str | None = None

    @property
    def function(self) -> str | None:
        """The function the root cause was raised in (the last word of ``where``)."""
        return self.where.rsplit(" ", 1)[-1] if self.where else None

    def summary(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        where = f" (raised at {self.where})" if self.where else ""
        return f"crashed on rank{'s' if len(self.ranks) > 1 else ''} {ranks}: {self.exception}: {self.message}{where}"


@dataclass
class DifferenceRecord:
    """A candidate result that differs from refgrad's spec as the candidate documents it: it
    matched refgrad's model of ``behaviour`` (a passing comparison of its own) and lands
    ``metrics`` (ULP distance and the rest) away from the spec."""

    label: str
    behaviour: str
    where: str
    metrics: dict[str, Any]


@dataclass
class ExpectationRecord:
    """A named boolean fact the check requires."""

    label: str
    passed: bool
    detail: str = ""
    case: str | None = None


PASS, FAIL, ERROR, SKIP = "PASS", "FAIL", "ERROR", "SKIP"
STATUSES = (PASS, FAIL, ERROR, SKIP)
"""A check's outcome: FAIL is a numerical failure (a comparison or expectation); ERROR is
a crash, timeout or interruption (no verdict on the numbers); SKIP recorded only skips."""


@dataclass
class CheckResult:
    """Everything one check reported."""

    name: str
    summary: str
    passed: bool
    seconds: float
    comparisons: list[ComparisonRecord] = field(default_factory=list)
    expectations: list[ExpectationRecord] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    differences: list[DifferenceRecord] = field(default_factory=list)
    error: str | None = None
    status: str = ""  # one of STATUSES; derived from the fields above when left empty
    # The candidate's label (``Candidate.label``) for a technique check; None for a
    # truth-layer check, whose result is the same whichever implementation is verified.
    candidate: str | None = None
    # The candidate's installed version, which every result of a technique check came from.
    candidate_version: str | None = None
    cases: list[CaseRecord] = field(default_factory=list)
    crashes: list[CrashRecord] = field(default_factory=list)
    # The candidate's known findings that a failing case here was attributed to, by key
    # (``Finding.to_dict()``); the cases name which.
    known_findings: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.status:
            if self.error is not None:
                self.status = ERROR
            elif self.passed:
                self.status = PASS
            elif self.skipped and not (self.comparisons or self.expectations or self.crashes):
                self.status = SKIP
            else:
                self.status = FAIL
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        """The result as plain dicts and lists (for the JSON report)."""
        return asdict(self)

    @property
    def key(self) -> str:
        """How reports name this result: the check, and the candidate it ran against."""
        return self.name if self.candidate is None else f"{self.name} [{self.candidate}]"

    def failed_labels(self) -> list[str]:
        """Labels of the crashes, then the comparisons and the expectations, that did not pass."""
        return ([f"{c.label}: {c.summary()}" for c in self.crashes]
                + [c.label for c in self.comparisons if not c.passed]
                + [e.label for e in self.expectations if not e.passed])

    @property
    def hazards(self) -> list[CaseRecord]:
        """Failing cases a known finding reachable only by direct API use explains: reported,
        never a FAIL."""
        return [c for c in self.cases if not c.passed and c.finding is not None
                and not self.known_findings[c.finding]["reachable"]]


class CheckRecorder:
    """Collects what a check observes; :meth:`finish` turns it into a result."""

    def __init__(self, name: str, summary: str = "", candidate: str | None = None) -> None:
        self.name = name
        self.summary = summary
        self.candidate = candidate
        self._comparisons: list[ComparisonRecord] = []
        self._expectations: list[ExpectationRecord] = []
        self._tables: list[Table] = []
        self._notes: list[str] = []
        self._skipped: list[str] = []
        self._differences: list[DifferenceRecord] = []
        self._cases: dict[str, CaseRecord] = {}
        self._settings: dict[str, LaunchSettings] = {}
        self._crashes: list[CrashRecord] = []
        self._case: str | None = None

    @contextmanager
    def case(self, label: str, settings: LaunchSettings) -> Iterator[None]:
        """Record what the block records as the case ``label``, which stands for
        ``settings``: the report spells it as those Megatron-LM flags, and a failure in it is
        attributed to the candidate's known finding whose rule reaches them, if any. A label
        entered again adds to the same case (its settings must not change)."""
        if not isinstance(settings, LaunchSettings):
            raise TypeError(f"case {label!r}: settings must be a LaunchSettings, "
                            f"got {type(settings).__name__}")
        known = self._settings.get(label)
        if known is not None and known != settings:
            raise ValueError(f"case {label!r} was recorded before with other settings")
        if known is None:
            self._settings[label] = settings
            self._cases[label] = CaseRecord(label, launch_flags(settings), settings.api_only,
                                            _plain_settings(settings))
        outer, self._case = self._case, label
        try:
            yield
        finally:
            self._case = outer

    def crash(self, label: str, crash: RankCrashed, candidate: Candidate) -> None:
        """A configuration ``candidate`` crashed in: recorded with its root cause (the ranks
        that raised it, the exception, where), a failure of the current case; the numbers
        such a run left are never compared. A crash whose root cause lies outside the
        candidate's code (:attr:`Candidate.own_modules`) is the harness's own: it is raised,
        and the check ends in ERROR naming it."""
        first = crash.first
        if not first.raised_in(candidate.own_modules):
            raise crash
        self._crashes.append(CrashRecord(
            label, first.exception, first.message, first.root.short() if first.root else "",
            sorted(r for r, f in crash.failures.items() if f.summary() == first.summary()),
            first.traceback, self._case))

    def compare(
        self,
        label: str,
        reference: torch.Tensor,
        candidate: torch.Tensor,
        *,
        max_ulp: int = 0,
        reason: str = "",
    ) -> bool:
        """Compare two tensors; passes when bitwise equal (max_ulp=0) or within max_ulp.

        ``reason`` must justify any ``max_ulp > 0``.
        """
        if max_ulp < 0:
            raise ValueError(f"max_ulp must be >= 0, got {max_ulp}")
        if max_ulp > 0 and not reason:
            raise ValueError(f"comparison {label!r}: a max_ulp > 0 bound needs a reason")
        result = compare_tensors(reference, candidate)
        if max_ulp == 0:
            ok = result.bitwise_equal
        else:
            ok = result.nan_mismatch == 0 and result.inf_mismatch == 0 and result.max_ulp <= max_ulp
        self._comparisons.append(
            ComparisonRecord(label, max_ulp, bool(ok), result.to_dict(), reason, self._case)
        )
        return bool(ok)

    def compare_documented(
        self,
        label: str,
        spec_reference: torch.Tensor,
        candidate: torch.Tensor,
        *,
        documented: DocumentedBehaviour | None,
        documented_reference: torch.Tensor | None = None,
        max_ulp: int = 0,
        reason: str = "",
    ) -> bool:
        """Compare ``candidate`` with refgrad, classifying a difference the candidate documents.

        Without ``documented`` this is :meth:`compare` against ``spec_reference``. With it,
        the candidate is held (within ``max_ulp``) to ``documented_reference``, refgrad's model
        of the documented behaviour: a mismatch there is a FAIL (a bug, or a behaviour that
        changed). Where the candidate then differs from the spec, the distance is recorded
        as a documented difference naming the behaviour and where it lives.
        """
        if documented is None:
            return self.compare(label, spec_reference, candidate, max_ulp=max_ulp, reason=reason)
        if documented_reference is None:
            raise ValueError(f"comparison {label!r}: a documented behaviour needs refgrad's "
                             f"model of it (documented_reference)")
        ok = self.compare(f"{label} (documented: {documented.summary})", documented_reference,
                          candidate, max_ulp=max_ulp, reason=reason)
        from_spec = compare_tensors(spec_reference, candidate)
        if not from_spec.bitwise_equal:
            self._differences.append(DifferenceRecord(label, documented.summary, documented.where,
                                                      from_spec.to_dict()))
        return ok

    def expect_documented(
        self,
        label: str,
        spec_holds: bool,
        *,
        documented: DocumentedBehaviour | None,
        documented_holds: bool | None = None,
        detail: str = "",
    ) -> bool:
        """:meth:`compare_documented` for facts that are not tensors (layouts, counts, addresses).

        Without ``documented`` this is :meth:`expect` of ``spec_holds``. With it, the
        candidate is held to refgrad's model of the documented behaviour
        (``documented_holds``; False is a FAIL); where the spec does not hold, a documented
        difference naming the behaviour and where it lives is recorded with ``detail``.
        """
        if documented is None:
            return self.expect(label, spec_holds, detail)
        if documented_holds is None:
            raise ValueError(f"expectation {label!r}: a documented behaviour needs refgrad's "
                             f"model of it (documented_holds)")
        ok = self.expect(f"{label} (documented: {documented.summary})", documented_holds, detail)
        if not spec_holds:
            self._differences.append(DifferenceRecord(label, documented.summary, documented.where,
                                                      {"detail": detail}))
        return ok

    def expect(self, label: str, condition: bool, detail: str = "") -> bool:
        """Record a boolean fact; the check fails if it is False."""
        self._expectations.append(ExpectationRecord(label, bool(condition), detail, self._case))
        return bool(condition)

    def table(
        self,
        title: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        notes: Sequence[str] = (),
    ) -> None:
        """A table for the report (rows of plain values; notes printed beneath it)."""
        self._tables.append(Table(title, list(columns), [list(r) for r in rows], list(notes)))

    def note(self, text: str) -> None:
        """A noteworthy fact that is not a failure (e.g. a peer disagreeing with the spec)."""
        self._notes.append(text)

    def skip(self, text: str) -> None:
        """Something the check could not run here, and why (each text once)."""
        if text not in self._skipped:
            self._skipped.append(text)

    @contextmanager
    def skip_if_unsupported(self) -> Iterator[None]:
        """Run one independent part of a check: an :class:`Unsupported` the candidate raises
        in it ends that part as a skip naming the reason, and the check goes on."""
        try:
            yield
        except Unsupported as unsupported:
            self.skip(str(unsupported))

    def absorb(self, part: CheckRecorder) -> None:
        """Append everything ``part`` recorded: a part of this check run elsewhere (in a
        process of its own), kept in the order it was recorded there."""
        self._comparisons.extend(part._comparisons)
        self._expectations.extend(part._expectations)
        self._tables.extend(part._tables)
        self._notes.extend(part._notes)
        self._skipped.extend(part._skipped)
        self._differences.extend(part._differences)
        self._crashes.extend(part._crashes)
        for label, settings in part._settings.items():
            if label not in self._settings:
                self._settings[label] = settings
                self._cases[label] = part._cases[label]

    def finish(self, seconds: float, error: str | None = None,
               findings: tuple[Finding, ...] = (), candidate_version: str | None = None
               ) -> CheckResult:
        """Close the check. Each case's failures are attributed to the first of ``findings``
        (the candidate's known root causes) that explains them; failures of a finding only
        direct API use reaches are reported as hazards and do not fail the check. It passes
        only with no error, at least one comparison, expectation or crash recorded, and every
        other failure absent."""
        failing: dict[str | None, list[bool]] = {}
        for record in (*self._comparisons, *self._expectations):
            if not record.passed:
                failing.setdefault(record.case, []).append(True)
        crashes_by_case: dict[str | None, list[CrashRecord]] = {}
        for crash in self._crashes:
            crashes_by_case.setdefault(crash.case, []).append(crash)
        known: dict[str, dict[str, Any]] = {}
        excused: set[str] = set()
        for label, case in self._cases.items():
            settings = self._settings[label]
            case.reaches = [f.key for f in findings if f.reaches(settings)]
            crashes = crashes_by_case.get(label, [])
            case.passed = label not in failing and not crashes
            if case.passed:
                continue
            signature = (crashes[0].exception, crashes[0].function) if crashes else None
            finding = explaining(findings, settings, signature)
            if finding is None:
                continue
            case.finding = finding.key
            known[finding.key] = finding.to_dict()
            if not finding.reachable:
                excused.add(label)
        counted = [r for r in (*self._comparisons, *self._expectations) if r.case not in excused]
        passed = (
            error is None
            and all(r.passed for r in counted)
            and not any(c.case not in excused for c in self._crashes)
            and bool(self._comparisons or self._expectations or self._crashes)
        )
        return CheckResult(
            name=self.name,
            summary=self.summary,
            passed=bool(passed),
            seconds=seconds,
            comparisons=self._comparisons,
            expectations=self._expectations,
            tables=self._tables,
            notes=self._notes,
            skipped=self._skipped,
            differences=self._differences,
            error=error,
            candidate=self.candidate,
            candidate_version=candidate_version,
            cases=list(self._cases.values()),
            crashes=self._crashes,
            known_findings=known,
        )


def launcher_for(candidate: Candidate) -> RankLauncher:
    """The rank launcher a check against ``candidate`` starts every process with: its fork
    server preloads the candidate's modules, whichever of the check's spawns starts it first
    (a server already running keeps its preload: ``verify run`` starts it with every
    candidate's)."""
    return RankLauncher().preloading(*candidate.preload_modules)


def run_part(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate,
             part: Callable[..., Any], *args: Any) -> Any:
    """``part(ctx, rec, candidate, *args)``: the part of a check that uses ``candidate`` in a
    single process. A candidate that keeps no process-wide state runs it here; any other
    (Megatron-Core: its CUDA redirects, a default process group, module globals) in a process
    of its own (a 1-rank world), so nothing it sets up reaches this process, where other
    checks run in threads. What the part recorded is absorbed into ``rec``; its return value
    (picklable) is returned; an :class:`Unsupported` it raises is raised here; a crash is the
    part's crash (``part.__name__``)."""
    if not candidate.isolates_configurations:
        return part(ctx, rec, candidate, *args)
    (outcome,) = spawn_each(_part_process, 1, [part], ctx, candidate, args, isolate=True,
                            timeout_s=ctx.timeout_s, launcher=launcher_for(candidate))
    if outcome.crash is not None:
        label = part.__name__.strip("_").replace("_", " ")
        rec.crash(label, outcome.crash, candidate)
        return None
    recorded, value, unsupported = outcome.results[0]
    rec.absorb(recorded)
    if unsupported is not None:
        raise Unsupported(*unsupported)
    return value


def _part_process(rank: int, world: int, part: Callable[..., Any], ctx: CheckContext,
                  candidate: Candidate, args: tuple[Any, ...]
                  ) -> tuple[CheckRecorder, Any, tuple[Technique, str] | None]:
    """:func:`run_part`'s process: what the part recorded, returned, or why it cannot run."""
    del rank, world
    recorded = CheckRecorder("part")
    try:
        return recorded, part(ctx, recorded, candidate, *args), None
    except Unsupported as unsupported:
        return recorded, None, (unsupported.technique, unsupported.reason)


def _plain_settings(settings: LaunchSettings) -> dict[str, Any]:
    """``settings`` as plain values for the JSON report (the grid's sizes spelled out)."""
    plain = {f.name: getattr(settings, f.name) for f in dataclass_fields(settings) if f.name != "dims"}
    d = settings.dims
    plain.update(tp=d.tp_size, pp=d.pp_size, vpp=d.vpp_size, dp=d.dp_size, cp=d.cp_size,
                 sequence_parallel=d.sequence_parallel)
    return plain


CheckFunction = Callable[[CheckContext, CheckRecorder, Any], None]
"""``run(ctx, rec, candidate) -> None``: the one entry signature of every check."""


@dataclass(frozen=True)
class Check:
    """A registered check: a name, a one-line summary, its run function and what it tests.

    ``technique`` is the technique whose implementation the check holds to its references,
    reached through the candidate it is given (default: fastgrad); ``None`` marks a
    truth-layer check, whose ``default_candidate`` is verify's own component under test
    (the same whichever implementation is verified).
    ``spawns_ranks`` says the check starts torch.distributed processes, so the
    runner can start the rank launcher early (and tests can mark it ``dist``).
    """

    name: str
    summary: str
    run: CheckFunction
    default_candidate: Any = None
    spawns_ranks: bool = False
    technique: Technique | None = None

    def __post_init__(self) -> None:
        if not callable(self.run):
            raise TypeError(f"Check {self.name!r}: run must be callable, got {type(self.run).__name__}")
        if self.technique is not None and not isinstance(self.technique, Technique):
            raise TypeError(f"Check {self.name!r}: technique must be a Technique or None, "
                            f"got {self.technique!r}")
        if self.technique is None and self.default_candidate is None:
            raise ValueError(f"Check {self.name!r}: a truth-layer check (technique=None) needs "
                             f"its default_candidate")
        if self.technique is not None and self.default_candidate is not None:
            raise ValueError(f"Check {self.name!r}: a technique check's candidate is a "
                             f"verify.candidates.Candidate given to execute(), not a default")

    def execute(self, context: CheckContext, candidate: Any = None) -> CheckResult:
        """Run the check against ``candidate`` (default: fastgrad, or the truth-layer
        check's own ``default_candidate``).

        An exception inside the check becomes a failed result carrying the traceback; an
        :class:`Unsupported` that escapes it is a SKIP naming the reason. A candidate of the
        wrong type is refused with a TypeError.
        """
        if self.technique is None:
            chosen = self.default_candidate if candidate is None else candidate
            expected: type = type(self.default_candidate)
        else:
            chosen = default_candidate() if candidate is None else candidate
            expected = Candidate
        if not isinstance(chosen, expected):
            raise TypeError(
                f"check {self.name!r}: candidate must be a {expected.__name__}, "
                f"got {type(chosen).__name__}"
            )
        recorder = CheckRecorder(self.name, self.summary,
                                 None if self.technique is None else chosen.label)
        findings: tuple[Finding, ...] = () if self.technique is None else chosen.findings()
        version = None if self.technique is None else chosen.info().version
        start = time.perf_counter()
        try:
            self.run(context, recorder, chosen)
        except Unsupported as unsupported:
            recorder.skip(str(unsupported))
        except Exception:  # noqa: BLE001 - reported, never hidden
            return recorder.finish(time.perf_counter() - start, error=traceback.format_exc(),
                                   findings=findings, candidate_version=version)
        return recorder.finish(time.perf_counter() - start, findings=findings,
                               candidate_version=version)

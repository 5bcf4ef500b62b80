"""``verify run``'s check runner: ``jobs`` checks at a time in worker threads.

The main thread only starts checks and collects their results, so a Ctrl-C never
lands in the middle of a check's own code or of the runner's bookkeeping: the
command's :class:`verify.interrupt.Interrupts` (deferred) sets an event and kills the
running checks' ranks, and the runner stops at its next look at the event. The
results that arrived before it are kept; every other check is reported as
interrupted (running or not yet started), in registry order. Worker threads of
interrupted checks are abandoned (daemon threads): a check busy in its own Python
code cannot be stopped from outside, and the report must not wait for it. The
console entry point (``verify.cli.console_main``) then ends the process without
the interpreter's shutdown, which would tear torch's C++ objects down under those
threads (measured: "terminate called without an active exception", SIGABRT).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from verify.candidates import Candidate
from verify.check import ERROR, Check, CheckContext, CheckResult
from verify.console import StepProgress

INTERRUPTED_ERROR = "KeyboardInterrupt: interrupted (Ctrl-C) before the check finished"
NOT_STARTED_ERROR = "KeyboardInterrupt: interrupted (Ctrl-C) before the check started"
_POLL_S = 0.2
CHECK_THREAD_PREFIX = "verify-check-"


def abandoned_check_threads() -> list[threading.Thread]:
    """Worker threads of interrupted checks that are still running."""
    return [t for t in threading.enumerate()
            if t.name.startswith(CHECK_THREAD_PREFIX) and t.is_alive()]


@dataclass(frozen=True)
class RunItem:
    """One check against one candidate (``None``: a truth-layer check, run once)."""

    check: Check
    candidate: Candidate | None = None

    @property
    def key(self) -> str:
        """The check's name, and the candidate's label when it has one."""
        return self.check.name if self.candidate is None else (
            f"{self.check.name} [{self.candidate.label}]")

    def execute(self, context: CheckContext) -> CheckResult:
        return self.check.execute(context, self.candidate)


@dataclass
class RunOutcome:
    """Every check's result in registry order, and whether the run was interrupted."""

    results: list[CheckResult] = field(default_factory=list)
    interrupted: bool = False

    @property
    def stopped(self) -> list[str]:
        """The checks (and candidates) that were running when the run was interrupted."""
        return [r.key for r in self.results if r.error == INTERRUPTED_ERROR]

    @property
    def not_started(self) -> list[str]:
        """The checks (and candidates) the interruption kept from starting."""
        return [r.key for r in self.results if r.error == NOT_STARTED_ERROR]


def interrupted_result(item: RunItem, seconds: float, started: bool = True) -> CheckResult:
    """The ERROR result of a check the user interrupted (Ctrl-C)."""
    return CheckResult(name=item.check.name, summary=item.check.summary, passed=False,
                       seconds=seconds, error=INTERRUPTED_ERROR if started else NOT_STARTED_ERROR,
                       status=ERROR,
                       candidate=None if item.candidate is None else item.candidate.label)


def run_checks(checks: Sequence[RunItem], weights: Sequence[float], context: CheckContext,
               progress: StepProgress, jobs: int, interrupted: threading.Event) -> RunOutcome:
    """Run ``checks`` (each a check against a candidate; ``jobs`` at a time, longest first
    when ``jobs > 1``) until done or until ``interrupted`` is set (a check raising
    KeyboardInterrupt sets it too)."""
    done: queue.Queue[tuple[int, CheckResult | BaseException]] = queue.Queue()
    jobs = max(1, min(jobs, len(checks)))  # no more at a time than there are checks
    order = list(range(len(checks)))
    if jobs > 1:
        # Longest first, so that no long check starts last and runs alone.
        order.sort(key=lambda i: -weights[i])
        progress.step(f"{len(checks)} checks, {jobs} at a time ...", expected=sum(weights))
    waiting = list(reversed(order))  # pop() takes the next
    started: dict[int, float] = {}
    results: dict[int, CheckResult] = {}

    def work(index: int) -> None:
        try:
            outcome: CheckResult | BaseException = checks[index].execute(context)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            outcome = exc
        done.put((index, outcome))

    def collect(index: int, outcome: CheckResult | BaseException) -> None:
        if isinstance(outcome, KeyboardInterrupt):
            interrupted.set()
            return
        if isinstance(outcome, BaseException):
            raise outcome
        results[index] = outcome
        progress.advance(weights[index], f"{outcome.status} {checks[index].key}")

    while not interrupted.is_set() and (waiting or len(results) < len(started)):
        while waiting and len(started) - len(results) < jobs and not interrupted.is_set():
            index = waiting.pop()
            if jobs == 1:
                progress.step(f"{checks[index].key} ({index + 1}/{len(checks)}) ...",
                              expected=weights[index])
            started[index] = time.perf_counter()
            threading.Thread(target=work, args=(index,), name=f"{CHECK_THREAD_PREFIX}{checks[index].key}",
                             daemon=True).start()
        try:
            collect(*done.get(timeout=_POLL_S))
        except queue.Empty:
            continue
    if interrupted.is_set():
        # Results that arrived before the interruption was seen still count, unless
        # the interruption itself (its killed ranks) made them errors.
        while True:
            try:
                index, outcome = done.get_nowait()
            except queue.Empty:
                break
            if isinstance(outcome, CheckResult) and outcome.status != ERROR:
                results[index] = outcome
    outcome = RunOutcome(interrupted=interrupted.is_set())
    for index, check in enumerate(checks):
        if index in results:
            outcome.results.append(results[index])
        elif index in started:
            outcome.results.append(interrupted_result(check, time.perf_counter() - started[index]))
        else:
            outcome.results.append(interrupted_result(check, 0.0, started=False))
    return outcome

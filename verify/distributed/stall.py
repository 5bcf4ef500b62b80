"""When a multi-rank run is stalled: no rank could run and made progress for the stall timeout.

A slow machine must never turn a correct run into an error, so the harness does
not give a run a deadline. It reads each unfinished rank every poll and counts
three signs of progress since a given earlier reading:

* its progress marker (``RankProgress.mark``; the slot's sequence counter moved);
* its CPU time (user + system, all threads, from ``/proc/<pid>/stat``): the rank
  *computed* when it used at least ``CPU_SHARE`` of a core (and ``MIN_CPU_S`` in
  all);
* its threads' context switches (``/proc/<pid>/task/<tid>/status``): the rank
  *wanted a CPU* when one of its threads was preempted by the kernel (a
  non-voluntary switch) at least once and at least as often as it gave the CPU
  up (a voluntary switch: it slept, blocked or was stopped), or was runnable
  (state ``R``) at both readings without switching at all.

A rank is *idle* for the time since its last sign of progress; the run is
**stalled** when every unfinished rank has been idle for ``timeout_s``.

Why the third sign (issue 31: a test ended after 1.7 s of its 5 s ceiling at load
~30 on 2 cores). On a starved machine a computing rank gets less than any fixed
share of a core: beside 20 spinning processes on the shared 2-core machine, a
rank in an endless Python loop got 1.2-1.7% of a core, and its CPU time showed
progress in no window of 0.5-8 s in one run, 12 of 146 in another
(``bench/results/stall_signals_busy20*_cpu.json``). What it could have had is
every moment it was runnable, and a computing thread is runnable all the time:
when it leaves the CPU, the kernel preempted it (4-20 times a second in those
measurements; it gave the CPU up 0-1.7 times). A blocked rank gives the CPU up:
gloo's transport thread wakes every 10 ms, runs ~20 us and sleeps again, so under
load it is often runnable, waiting for a CPU after a wake-up, yet it gives the
CPU up 37-57 times a second and is preempted 0-0.3 times. So a rank that could
run and did not is judged on markers and CPU time, and a starved one is not
stalled, at any load. A computing thread gives the CPU up when another Python
thread takes the GIL (the harness's parent watcher waits on a pidfd for that
reason, see ``_child``) or when a page is read from disk; a tie counts as
wanting the CPU. The counters are per thread (``/proc/<pid>/status`` holds the
main thread's only) and every Linux kernel has them. States count as follows:

* ``R`` (running, or waiting for a CPU) through a window without a switch:
  starved. When its whole session gets no CPU for a while, a blocked rank's
  transport thread is such a thread too, which delays a stall verdict by a poll
  or two (25 of 213 windows of 0.5-4 s beside 8 spinners, none of 8 s);
* ``S`` (sleeping: blocked in a collective, ``time.sleep``) and ``D``
  (uninterruptible: disk, swap): the thread gave the CPU up; the rank is judged
  on markers and CPU time, so a rank hung in ``D`` for the timeout is reported
  (and one thrashing in swap with no CPU could be taken for stalled);
* ``T`` (stopped: SIGSTOP or a debugger): it gave the CPU up and does not run
  until continued; a frozen rank makes no progress and the run stalls.

Why not ``/proc/<pid>/schedstat`` (time on a CPU and time waiting on a runqueue,
the kernel's ``Documentation/scheduler/sched-stats.rst``)? Its runqueue wait does
not tell a blocked rank from a starved one: a thread's wait is credited when it
reaches a CPU, in lumps of up to seconds under load, and the transport thread of
a blocked rank waits 0.43-0.63 s per second, about half what a starved computing
thread waits (0.95-0.98 s). Context switches say *why* a thread left the CPU,
which is the question.

A rank that computes forever (an endless loop) while its peers wait would never
stall by this rule, so a run is also ended when it is still running after the
**ceiling**, ``CEILING_FACTOR`` times the stall timeout (20 minutes for the
default 60 s): wall time from the start of the run, far beyond any legitimate
phase, yet a bound on every run. Starvation cannot end a run before its ceiling.

Where the per-thread counters are missing (no ``/proc/<pid>/task``: not Linux),
the rule falls back to markers and CPU time (from ``psutil`` when installed;
without it only the markers count), and a rank starved below ``CPU_SHARE`` is
then taken for stalled, as before this rule.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

# A rank computes while it uses at least this share of one core: a gloo rank blocked in a
# collective uses about 0.3% (its transport thread's wake-ups every 10 ms).
CPU_SHARE = 0.02
# ... and at least this much CPU in all: /proc counts in clock ticks (10 ms), so a single
# tick of a waiting rank's transport thread must not read as 2% of a short interval.
MIN_CPU_S = 0.05
# A run still running after CEILING_FACTOR x the stall timeout is ended (endless loops).
CEILING_FACTOR = 20.0
# Thread states (proc(5)): R running or runnable; S sleeping; D uninterruptible wait;
# T stopped; t stopped by a tracer; Z zombie; X dead; I idle kernel thread.
RUNNABLE = "R"

try:
    _CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
except (AttributeError, ValueError, OSError):
    _CLOCK_TICKS = 100


def _proc_cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # "pid (comm) state ...": comm may hold spaces and parentheses; utime and
            # stime are fields 14 and 15, i.e. 12 and 13 after the closing parenthesis.
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return None


def _psutil_cpu_seconds(pid: int) -> float | None:
    try:
        import psutil  # noqa: PLC0415 - optional, only where /proc is missing
    except ImportError:
        return None
    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return times.user + times.system


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads); None if unknown."""
    if pid is None:
        return None
    seconds = _proc_cpu_seconds(pid)
    if seconds is None and not os.path.isdir("/proc/self"):
        seconds = _psutil_cpu_seconds(pid)
    return seconds


@dataclass(frozen=True)
class ThreadReading:
    """One thread's scheduler facts: its state and why it left the CPU, counted since it started."""

    tid: int
    # One letter of proc(5): "R" running or runnable, "S" sleeping, "D", "T", ...
    state: str
    # voluntary_ctxt_switches: it gave the CPU up (slept, blocked, was stopped).
    gave_up: int
    # nonvoluntary_ctxt_switches: the kernel took the CPU from it while it could run.
    preempted: int


def _status_fields(text: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields[name] = value.strip()
    return fields


def thread_readings(pid: int | None) -> tuple[ThreadReading, ...] | None:
    """Every thread of process ``pid`` as :class:`ThreadReading`; None where the kernel
    does not tell (no ``/proc/<pid>/task``, no context-switch counters) or the process
    has gone."""
    if pid is None:
        return None
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    readings = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as status:
                fields = _status_fields(status.read())
        except OSError:  # the thread ended since the listing
            continue
        try:
            readings.append(ThreadReading(int(tid), fields["State"][:1],
                                          int(fields["voluntary_ctxt_switches"]),
                                          int(fields["nonvoluntary_ctxt_switches"])))
        except (KeyError, ValueError):
            return None
    return tuple(readings) or None


@dataclass(frozen=True)
class Sample:
    """One reading of a rank: when, its marker's sequence number, its CPU seconds and
    its threads' scheduler facts (None where unknown)."""

    at: float
    sequence: int
    cpu_s: float | None
    threads: tuple[ThreadReading, ...] | None = None


@dataclass
class _RankHistory:
    samples: deque[Sample] = field(default_factory=deque)


class StallWatch:
    """The parent's view of a run's progress, fed one :class:`Sample` per rank per poll."""

    def __init__(self, timeout_s: float, ceiling_s: float, started_at: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not ceiling_s >= timeout_s:
            raise ValueError(f"ceiling_s must be >= timeout_s ({timeout_s}), got {ceiling_s}")
        self.timeout_s = timeout_s
        self.ceiling_s = ceiling_s
        self.started_at = started_at
        self._ranks: dict[int, _RankHistory] = {}

    def observe(self, rank: int, sample: Sample) -> None:
        """Record ``rank``'s reading; readings older than the timeout (but one) are dropped."""
        history = self._ranks.setdefault(rank, _RankHistory()).samples
        history.append(sample)
        # Keep the newest sample that is at least timeout_s old: it decides "idle that long".
        while len(history) > 1 and sample.at - history[1].at >= self.timeout_s:
            history.popleft()

    def idle_s(self, rank: int, now: float) -> float:
        """Seconds since ``rank``'s last sign of progress, as far back as the samples go
        (0 before its first sample)."""
        history = self._ranks.get(rank)
        if not history or not history.samples:
            return 0.0
        latest = history.samples[-1]
        idle_since = latest.at
        for earlier in list(history.samples)[-2::-1]:
            if progressed(earlier, latest):
                break
            idle_since = earlier.at
        return now - idle_since

    def recent_cpu_s(self, rank: int) -> float | None:
        """CPU seconds ``rank`` used over the samples kept (about the last timeout_s)."""
        window = self._window(rank)
        if window is None:
            return None
        first, last = window[0].cpu_s, window[1].cpu_s
        return None if first is None or last is None else max(0.0, last - first)

    def starved(self, rank: int) -> bool | None:
        """Whether ``rank`` wanted a CPU over the samples kept (:func:`wanted_cpu`); None
        where its threads could not be read."""
        window = self._window(rank)
        if window is None or window[0].threads is None or window[1].threads is None:
            return None
        return wanted_cpu(*window)

    def window_s(self, rank: int) -> float | None:
        """Seconds between ``rank``'s oldest and newest kept samples (the span of recent_cpu_s)."""
        window = self._window(rank)
        return None if window is None else window[1].at - window[0].at

    def stalled(self, ranks: Iterable[int], now: float) -> bool:
        """True when every rank of ``ranks`` (the unfinished ones) was idle for timeout_s."""
        ranks = list(ranks)
        return bool(ranks) and all(self.idle_s(r, now) >= self.timeout_s for r in ranks)

    def over_ceiling(self, now: float) -> bool:
        """True once the run has lasted ``ceiling_s``."""
        return now - self.started_at >= self.ceiling_s

    def _window(self, rank: int) -> tuple[Sample, Sample] | None:
        history = self._ranks.get(rank)
        if not history or len(history.samples) < 2:
            return None
        return history.samples[0], history.samples[-1]


def progressed(earlier: Sample, latest: Sample) -> bool:
    """Did the rank show a sign of progress between the two samples: a marker, CPU
    time (:func:`computed`) or a thread that wanted a CPU (:func:`wanted_cpu`)?"""
    return (earlier.sequence != latest.sequence or computed(earlier, latest)
            or wanted_cpu(earlier, latest))


def computed(earlier: Sample, latest: Sample) -> bool:
    """Did the rank compute between the two samples (CPU_SHARE of a core, MIN_CPU_S in all)?"""
    if earlier.cpu_s is None or latest.cpu_s is None:
        return False
    used = latest.cpu_s - earlier.cpu_s
    return used >= max(MIN_CPU_S, CPU_SHARE * (latest.at - earlier.at))


def wanted_cpu(earlier: Sample, latest: Sample) -> bool:
    """Could the rank run between the two samples, and wait for a CPU instead?

    True when one of its threads, since ``earlier``, was preempted at least once and
    at least as often as it gave the CPU up (a computing thread gives it up now and
    then: another Python thread takes the GIL, a page is read from disk), or was
    runnable at both samples without switching at all (it waited for a CPU
    throughout, or held one). Its state at ``latest`` alone does not count: a
    computing thread may be waiting for the GIL just then. False without thread
    readings (the fallback).
    """
    if earlier.threads is None or latest.threads is None or not latest.at > earlier.at:
        return False
    before = {thread.tid: thread for thread in earlier.threads}
    for thread in latest.threads:
        # A thread started since `earlier` counts its switches from zero.
        prior = before.get(thread.tid, ThreadReading(thread.tid, "", 0, 0))
        preempted = thread.preempted - prior.preempted
        gave_up = thread.gave_up - prior.gave_up
        if preempted >= max(1, gave_up):
            return True
        if preempted == gave_up == 0 and prior.state == thread.state == RUNNABLE:
            return True
    return False

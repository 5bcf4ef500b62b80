"""When a multi-rank run is stalled: no rank has made progress for the stall timeout.

A slow machine must never turn a correct run into an error, so the harness does
not give a run a deadline. It watches two signs of progress per rank, sampled
every poll by the parent:

* its progress marker (``RankProgress.mark``; the slot's sequence counter moved);
* its CPU time (user + system, all threads, from ``/proc/<pid>/stat``): a rank
  computes when it used at least ``CPU_SHARE`` of a core (and at least
  ``MIN_CPU_S`` in all) since a given moment.

A rank is *idle* for the time since its last sign of progress. The run is
**stalled** when every unfinished rank has been idle for ``timeout_s``: a rank
frozen with SIGSTOP, sleeping, or blocked in a collective that a stalled peer
never joins. A rank waiting in a collective for a peer that computes is not
stalled on its own: the peer's progress is the run's.

Measured (``tests/verify/test_distributed.py`` pins the rule, ``docs/performance.md``
the figures): a gloo rank blocked in a collective does not busy-poll; its
transport thread wakes every 10 ms and costs about 0.3% of a core, so
``CPU_SHARE`` (2%) keeps a waiting rank idle, while a rank computing on a
2-core machine shared by 16 busy processes still gets about 12% of a core.

A rank that computes forever (an endless loop) while its peers wait would never
stall by this rule, so a run is also ended when it is still running after the
**ceiling**, ``CEILING_FACTOR`` times the stall timeout (20 minutes for the
default 60 s): far beyond any legitimate phase, even on a loaded machine, yet a
bound on every run.

CPU time comes from ``/proc`` (Linux), else from ``psutil`` when installed;
without either, only the progress markers count (and a rank computing without
marking progress for ``timeout_s`` is taken for stalled, as a plain deadline would).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

# A rank computes while it uses at least this share of one core (see the module docstring).
CPU_SHARE = 0.02
# ... and at least this much CPU in all: /proc counts in clock ticks (10 ms), so a single
# tick of a waiting rank's transport thread must not read as 2% of a short interval.
MIN_CPU_S = 0.05
# A run still running after CEILING_FACTOR x the stall timeout is ended (endless loops).
CEILING_FACTOR = 20.0

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
class Sample:
    """One reading of a rank: when, its marker's sequence number and its CPU seconds."""

    at: float
    sequence: int
    cpu_s: float | None


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
        for earlier in reversed(history.samples):
            if earlier.sequence != latest.sequence or _computed(earlier, latest):
                break
            idle_since = earlier.at
        return now - idle_since

    def recent_cpu_s(self, rank: int) -> float | None:
        """CPU seconds ``rank`` used over the samples kept (about the last timeout_s)."""
        history = self._ranks.get(rank)
        if not history or len(history.samples) < 2:
            return None
        first, last = history.samples[0].cpu_s, history.samples[-1].cpu_s
        return None if first is None or last is None else max(0.0, last - first)

    def window_s(self, rank: int) -> float | None:
        """Seconds between ``rank``'s oldest and newest kept samples (the span of recent_cpu_s)."""
        history = self._ranks.get(rank)
        if not history or len(history.samples) < 2:
            return None
        return history.samples[-1].at - history.samples[0].at

    def stalled(self, ranks: Iterable[int], now: float) -> bool:
        """True when every rank of ``ranks`` (the unfinished ones) was idle for timeout_s."""
        ranks = list(ranks)
        return bool(ranks) and all(self.idle_s(r, now) >= self.timeout_s for r in ranks)

    def over_ceiling(self, now: float) -> bool:
        """True once the run has lasted ``ceiling_s``."""
        return now - self.started_at >= self.ceiling_s


def _computed(earlier: Sample, latest: Sample) -> bool:
    """Did the rank compute between the two samples (CPU_SHARE of a core, MIN_CPU_S in all)?"""
    if earlier.cpu_s is None or latest.cpu_s is None:
        return False
    used = latest.cpu_s - earlier.cpu_s
    return used >= max(MIN_CPU_S, CPU_SHARE * (latest.at - earlier.at))

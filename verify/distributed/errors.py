"""Why a multi-rank run did not return: typed, so callers can tell it from a numerical failure.

:class:`DistributedRunError` is the base; :class:`RankCrashed` means a rank raised
or died, :class:`RankTimeout` means the run stalled (no rank made progress for the
stall timeout) or outlasted its ceiling.
Both carry a :class:`RankState` for every rank that had not finished, with its
last progress marker and, where the harness could get one, its Python stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from verify.distributed.stall import CPU_SHARE


@dataclass(frozen=True)
class RankState:
    """What the harness knew about one unfinished rank when it gave up on the run."""

    rank: int
    pid: int | None
    # e.g. "running", "stopped (SIGSTOP or a debugger)", "exited with code 3".
    process: str
    # The last label the rank reported (see verify.distributed.progress) and its age.
    marker: str | None = None
    marker_age_s: float | None = None
    # One line from the rank's Python stack, e.g. "in torch.distributed.all_reduce,
    # called from fastgrad/pipeline.py:340 (finalize_grads)"; None when not dumped.
    location: str | None = None
    # The innermost frames of that stack, most recent call first.
    stack: tuple[str, ...] = ()
    # CPU seconds the process used over the last ``window_s`` seconds (None: unknown).
    recent_cpu_s: float | None = None
    window_s: float | None = None
    # Whether, over that window, a thread of it could run and waited for a CPU instead
    # (verify.distributed.stall.wanted_cpu); None where its threads could not be read.
    starved: bool | None = None

    def describe(self) -> str:
        """Several lines for an error message."""
        marker = "never reached the harness's entry point (still starting?)"
        if self.marker is not None:
            age = f", {self.marker_age_s:.1f} s ago" if self.marker_age_s is not None else ""
            marker = f"last marker {self.marker!r}{age}"
        cpu = ""
        if self.recent_cpu_s is not None and self.window_s:
            cpu = f"; {self.recent_cpu_s:.2f} s of CPU in the last {self.window_s:.0f} s"
        if self.starved:
            cpu += " (starved: preempted, waiting for a CPU)"
        lines = [f"  rank {self.rank} (pid {self.pid}): {self.process}; {marker}{cpu}"]
        if self.location:
            lines.append(f"    {self.location}")
        lines.extend(f"      {frame}" for frame in self.stack)
        return "\n".join(lines)


class DistributedRunError(RuntimeError):
    """A multi-rank run failed for a reason other than the numbers it computed."""


class RankCrashed(DistributedRunError):
    """One or more ranks raised or died; ``failures`` maps rank -> traceback or exit status."""

    def __init__(self, failures: dict[int, str], others: dict[int, RankState]) -> None:
        self.failures = dict(sorted(failures.items()))
        self.others = dict(sorted(others.items()))
        text = "".join(f"\n--- rank {r} failed ---\n{tb}" for r, tb in self.failures.items())
        if self.others:
            text += "\n--- ranks stopped because of that failure ---\n"
            text += "\n".join(state.describe() for state in self.others.values())
        super().__init__(text)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that failed, ascending."""
        return tuple(self.failures)


class RankTimeout(DistributedRunError):
    """The run stalled, or outlasted its ceiling; ``states`` describes each unfinished rank.

    ``ceiling_s`` is None for a stall (no unfinished rank made progress for
    ``timeout_s``: see :mod:`verify.distributed.stall`), else the ceiling the run
    reached while some rank still computed.
    """

    def __init__(self, timeout_s: float, world_size: int, states: dict[int, RankState],
                 ceiling_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.ceiling_s = ceiling_s
        self.world_size = world_size
        self.states = dict(sorted(states.items()))
        unfinished = ", ".join(str(r) for r in self.states)
        if ceiling_s is None:
            why = (f"made no progress for {timeout_s:g} s (no progress marker, under "
                   f"{CPU_SHARE:.0%} of a core of CPU time, and no thread waiting for a CPU)")
        else:
            why = (f"were still running after {ceiling_s:g} s, the ceiling of a run "
                   f"({ceiling_s / timeout_s:g} x the {timeout_s:g} s stall timeout)")
        text = f"ranks {unfinished} of {world_size} {why} (every rank was killed):\n"
        super().__init__(text + "\n".join(s.describe() for s in self.states.values()))

    @property
    def stalled(self) -> bool:
        """True for a stall, False for a run that reached its ceiling."""
        return self.ceiling_s is None

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that had not finished, ascending."""
        return tuple(self.states)

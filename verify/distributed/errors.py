"""Why a multi-rank run did not return: typed, so callers can tell it from a numerical failure.

:class:`DistributedRunError` is the base; :class:`RankCrashed` means a rank raised
or died, :class:`RankTimeout` means the deadline passed with ranks still running.
Both carry a :class:`RankState` for every rank that had not finished, with its
last progress marker and, where the harness could get one, its Python stack.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def describe(self) -> str:
        """Several lines for an error message."""
        marker = "never reached the harness's entry point (still starting?)"
        if self.marker is not None:
            age = f", {self.marker_age_s:.1f} s ago" if self.marker_age_s is not None else ""
            marker = f"last marker {self.marker!r}{age}"
        lines = [f"  rank {self.rank} (pid {self.pid}): {self.process}; {marker}"]
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
    """The deadline passed; ``states`` describes each rank that had not finished."""

    def __init__(self, timeout_s: float, world_size: int, states: dict[int, RankState]) -> None:
        self.timeout_s = timeout_s
        self.world_size = world_size
        self.states = dict(sorted(states.items()))
        stalled = ", ".join(str(r) for r in self.states)
        text = (
            f"ranks {stalled} of {world_size} had not finished after {timeout_s:g} s "
            "(every rank was killed):\n"
        )
        super().__init__(text + "\n".join(s.describe() for s in self.states.values()))

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that had not finished, ascending."""
        return tuple(self.states)

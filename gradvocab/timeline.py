"""The timeline record of a pipelined step, and what it says about the bubble.

Pure data and arithmetic on it, shared by whoever records (fastgrad's ``Timeline``, another
candidate around its own schedule's work) and whoever analyses (the pipeline check, the
benchmarks). Every rank records the start and end (``time.perf_counter``, a system-wide
monotonic clock on Linux, so ranks on one host share a time base) of its
forwards, backwards and communication. :func:`summarize_step` turns the events
of all ranks into a :class:`StepReport`:

- step time: latest event end minus earliest event start, over all ranks;
- bubble: per rank, the fraction of the step in which it computes nothing
  (neither forward nor backward), averaged over ranks;
- exposed grad-sync time: how far the grad sync pushes the end of the step past
  the end of the last compute on any rank, ``max(0, step_end - compute_end)``.
  A sync hidden in the cooldown bubble of non-first stages ends before the
  first stage's last backward and so exposes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

COMPUTE_KINDS = ("forward", "backward", "wgrad_drain")
COMMUNICATION_KINDS = ("send", "recv", "send_recv", "grad_sync_launch", "grad_sync_wait", "embedding_sync")
EVENT_KINDS = COMPUTE_KINDS + COMMUNICATION_KINDS


@dataclass(frozen=True)
class TimelineEvent:
    """One interval on one rank; ``microbatch`` is -1 for step-level events."""

    rank: int
    kind: str
    microbatch: int
    start: float
    end: float

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"TimelineEvent.kind must be one of {EVENT_KINDS}, got {self.kind!r}")
        if self.end < self.start:
            raise ValueError(f"TimelineEvent.end ({self.end}) must be >= start ({self.start})")

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start


@dataclass(frozen=True)
class StepReport:
    """What one step's timelines show (seconds, fractions in [0, 1])."""

    step_time: float
    compute_end: float
    bubble_fraction: float
    per_rank_busy: tuple[float, ...]
    exposed_grad_sync: float
    grad_sync_wait: float
    mean_forward: float
    mean_backward: float

    def to_dict(self) -> dict[str, object]:
        """The headline numbers, JSON-ready, in seconds and fractions."""
        return {
            "step_time_s": self.step_time,
            "bubble_fraction": self.bubble_fraction,
            "exposed_grad_sync_s": self.exposed_grad_sync,
            "grad_sync_wait_s": self.grad_sync_wait,
            "mean_forward_s": self.mean_forward,
            "mean_backward_s": self.mean_backward,
        }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize_step(events: Sequence[TimelineEvent]) -> StepReport:
    """Summarise the events of every rank for one step (see the module doc)."""
    if not events:
        raise ValueError("events must not be empty")
    step_start = min(e.start for e in events)
    step_end = max(e.end for e in events)
    compute = [e for e in events if e.kind in COMPUTE_KINDS]
    compute_end = max((e.end for e in compute), default=step_start)
    step_time = step_end - step_start
    ranks = sorted({e.rank for e in events})
    busy = tuple(sum(e.duration for e in compute if e.rank == r) for r in ranks)
    bubble = _mean([1.0 - b / step_time for b in busy]) if step_time > 0 else 0.0
    waits = [e.duration for e in events if e.kind == "grad_sync_wait"]
    return StepReport(
        step_time=step_time,
        compute_end=compute_end - step_start,
        bubble_fraction=bubble,
        per_rank_busy=busy,
        exposed_grad_sync=max(0.0, step_end - compute_end),
        grad_sync_wait=max(waits, default=0.0),
        mean_forward=_mean([e.duration for e in compute if e.kind == "forward"]),
        mean_backward=_mean([e.duration for e in compute if e.kind == "backward"]),
    )


__all__ = ["COMMUNICATION_KINDS", "COMPUTE_KINDS", "EVENT_KINDS", "StepReport", "TimelineEvent",
           "summarize_step"]

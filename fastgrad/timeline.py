"""A rank's timeline recorder: the start and end of its forwards, backwards and communication.

The records (:class:`gradvocab.TimelineEvent`) and their analysis (:func:`gradvocab.summarize_step`)
are vocabulary every package shares; this module only times fastgrad's schedules into them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from gradvocab import TimelineEvent


@dataclass
class Timeline:
    """The events one rank recorded; ``enabled=False`` makes recording a no-op.

    ``listener``, if given, is called with ``(kind, microbatch, "start" | "end")``
    around every event, recorded or not, e.g. to tell a test harness which step a
    rank is in (``verify.distributed.RankProgress.timeline_listener``).
    """

    rank: int
    enabled: bool = True
    events: list[TimelineEvent] = field(default_factory=list)
    listener: Callable[[str, int, str], None] | None = None

    @contextmanager
    def record(self, kind: str, microbatch: int = -1) -> Iterator[None]:
        """Time the body of the ``with`` block as one event of ``kind``."""
        listener = self.listener
        if listener is not None:
            listener(kind, microbatch, "start")
        if not self.enabled:
            yield
            if listener is not None:
                listener(kind, microbatch, "end")
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.events.append(TimelineEvent(self.rank, kind, microbatch, start, time.perf_counter()))
        if listener is not None:
            listener(kind, microbatch, "end")

    def clear(self) -> None:
        """Forget the recorded events (start of a new step)."""
        self.events.clear()


__all__ = ["Timeline"]

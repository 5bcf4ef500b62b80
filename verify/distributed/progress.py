"""Where each rank last said it was: one shared-memory slot per rank, read by the parent.

A rank writes ``(label, time)`` into its slot with :meth:`RankProgress.mark`; the
parent reads every slot when a run stalls, so the stall report can say
"rank 1: 'backward microbatch 3 start', 8.2 s ago" even for a rank that was
frozen with SIGSTOP and can no longer answer anything.

The slot is lock-free (a rank stopped while holding a lock would block the
parent's read); a sequence counter (even = stable) lets the reader retry a torn
read. The marker is a diagnosis aid, so a read that stays torn is returned as is.
The counter itself is also the parent's sign that the rank progresses
(:mod:`verify.distributed.stall`).

The harness hands a :class:`RankProgress` to a rank function that declares a
keyword-only ``progress`` parameter; nothing is stored in module state.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct("<QdH")  # sequence, monotonic time, label length
SLOT_BYTES = 256
MAX_LABEL_BYTES = SLOT_BYTES - _HEADER.size
_READ_ATTEMPTS = 20


class ProgressBoard:
    """The parent's side: one slot per rank in a shared ``RawArray``."""

    def __init__(self, context: Any, world_size: int) -> None:
        self.world_size = world_size
        # RawArray, not Array: its lock could be held by a rank frozen mid-write.
        self._shared = context.RawArray("B", world_size * SLOT_BYTES)

    def for_rank(self, rank: int) -> RankProgress:
        """The writer a rank gets (picklable only while starting processes)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return RankProgress(self._shared, rank)

    def sequence(self, rank: int) -> int:
        """A counter that moves whenever ``rank`` marks progress (0 before its first marker)."""
        view = memoryview(self._shared).cast("B")
        return struct.unpack_from("<Q", view, rank * SLOT_BYTES)[0]

    def read(self, rank: int) -> tuple[str, float] | None:
        """``(label, seconds since it was written)``, or None if the rank never marked."""
        view = memoryview(self._shared).cast("B")
        offset = rank * SLOT_BYTES
        for _ in range(_READ_ATTEMPTS):
            seq, stamp, length = _HEADER.unpack_from(view, offset)
            label = bytes(view[offset + _HEADER.size: offset + _HEADER.size + length])
            if seq % 2 == 0 and _HEADER.unpack_from(view, offset)[0] == seq:
                break
            time.sleep(0.001)
        if seq == 0:
            return None
        return label.decode("utf-8", errors="replace"), time.monotonic() - stamp


class RankProgress:
    """A rank's side: :meth:`mark` records what it is doing now (cheap: no syscall)."""

    def __init__(self, shared: Any, rank: int) -> None:
        self.rank = rank
        self._shared = shared
        self._offset = rank * SLOT_BYTES

    def mark(self, label: str) -> None:
        """Record ``label`` (truncated to the slot) as this rank's current step."""
        data = label.encode("utf-8")[:MAX_LABEL_BYTES]
        view = memoryview(self._shared).cast("B")
        seq = _HEADER.unpack_from(view, self._offset)[0]
        struct.pack_into("<Q", view, self._offset, seq + 1)  # odd: being written
        view[self._offset + _HEADER.size: self._offset + _HEADER.size + len(data)] = data
        _HEADER.pack_into(view, self._offset, seq + 1, time.monotonic(), len(data))
        struct.pack_into("<Q", view, self._offset, seq + 2)

    def timeline_listener(self, prefix: str = "") -> Callable[[str, int, str], None]:
        """A ``fastgrad.timeline.Timeline`` listener marking each event's start and end."""

        def listen(kind: str, microbatch: int, edge: str) -> None:
            where = f" microbatch {microbatch}" if microbatch >= 0 else ""
            self.mark(f"{prefix}{kind}{where} {edge}")

        return listen

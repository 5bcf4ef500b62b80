"""Wall-clock timing helpers shared by the bench scripts (imported as ``_timing``).

Benchmarks print ratios against a baseline timed in the same run, so these
only measure; they never judge.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def _no_sync() -> None:
    return None


def median_time(
    fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = _no_sync
) -> float:
    """Median wall time of ``repeats`` calls after one warm-up call, in seconds.

    The warm-up keeps first-call allocations and lazy initialisation out of the
    timing; ``sync`` (e.g. ``torch.cuda.synchronize``) runs around every call.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def best_time(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = _no_sync) -> float:
    """Best wall time of ``repeats`` calls (no warm-up), in seconds; ``sync`` as above."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best

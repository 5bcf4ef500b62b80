"""Timing helpers shared by the bench scripts (imported as ``_timing``).

Benchmarks print ratios against a baseline timed in the same run, so these
only measure; they never judge. Candidates are always timed *interleaved*:
round ``r`` calls every candidate once (the starting candidate rotates), so
load drift on a shared machine hits every candidate alike and cancels in the
ratios. On a CUDA device each call is timed with CUDA events recorded on the
current stream (GPU time of the call, without host-launch jitter between calls);
on the CPU by ``time.perf_counter``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any


def _time_call_cpu(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _time_call_cuda(fn: Callable[[], Any]) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3  # milliseconds -> seconds


def interleaved_times(
    candidates: Mapping[str, Callable[[], Any]],
    repeats: int,
    *,
    device: str = "cpu",
    warmup: bool = True,
) -> dict[str, list[float]]:
    """``repeats`` timings (seconds) of one call of every candidate, taken round-robin.

    ``device``: ``"cpu"`` (wall clock) or ``"cuda"`` (CUDA events). ``warmup``: one
    untimed call of each candidate first (first-call allocations, lazy init, compiles).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not candidates:
        raise ValueError("candidates must name at least one function to time")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    timer = _time_call_cuda if device == "cuda" else _time_call_cpu
    names = list(candidates)
    if warmup:
        for name in names:
            candidates[name]()
        if device == "cuda":
            import torch

            torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timer(candidates[name]))
    return times


def interleaved_medians(
    candidates: Mapping[str, Callable[[], Any]], repeats: int, *, device: str = "cpu"
) -> dict[str, float]:
    """Median of :func:`interleaved_times` per candidate (after one warm-up call each)."""
    times = interleaved_times(candidates, repeats, device=device)
    return {name: statistics.median(values) for name, values in times.items()}


def interleaved_best(
    candidates: Mapping[str, Callable[[], Any]], repeats: int, *, device: str = "cpu"
) -> dict[str, float]:
    """Best of :func:`interleaved_times` per candidate (after one warm-up call each)."""
    times = interleaved_times(candidates, repeats, device=device)
    return {name: min(values) for name, values in times.items()}

"""Run a function on W real ``torch.distributed`` processes (gloo on CPU) and collect results.

Used by checks and tests that need real collectives on a laptop or CI machine.
Each rank initialises its own process group (rendezvous on a store the parent
hosts), runs ``fn(rank, world_size, *args)``, and sends back the (picklable)
return value by value. Ranks are forked from a fork server that has already
imported torch (see :mod:`verify.distributed.launcher`).

Nothing hangs, and slow is not stuck: a rank that raises or dies ends the run
with :class:`RankCrashed` (its traceback or exit status); a run whose unfinished
ranks all made no progress (no progress marker, no CPU time, no thread waiting
for a CPU on a starved machine) for ``timeout_s`` is stalled, and one still
running after ``ceiling_s`` (default 20 x ``timeout_s``) is ended: both end with
:class:`RankTimeout`, every rank killed at once, naming the ranks that had not
finished with their last progress marker, their recent CPU time and, where they
could answer, the torch.distributed call they were blocked in
(:mod:`verify.distributed.stall` has the rule). A rank function that declares a
keyword-only ``progress`` parameter receives a :class:`RankProgress` to mark its
steps with (``progress.mark("stage 1: backward microbatch 3")``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

from verify.distributed.errors import (
    DistributedRunError,
    Frame,
    RankCrashed,
    RankFailure,
    RankState,
    RankTimeout,
)
from verify.distributed.launcher import DEFAULT_TIMEOUT_S, ItemOutcome, RankLauncher
from verify.distributed.progress import RankProgress
from verify.distributed.stall import CEILING_FACTOR

__all__ = [
    "CEILING_FACTOR",
    "DEFAULT_TIMEOUT_S",
    "DistributedRunError",
    "Frame",
    "ItemOutcome",
    "RankCrashed",
    "RankFailure",
    "RankLauncher",
    "RankProgress",
    "RankState",
    "RankTimeout",
    "free_port",
    "spawn",
    "spawn_each",
]


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (for tools that need a fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ceiling_s: float | None = None,
    launcher: RankLauncher | None = None,
    on_started: Callable[[], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; results by rank.

    ``fn`` must be a module-level function (it is pickled into the ranks). Return
    values may hold tensors; they are copied back by value. ``timeout_s``: the stall
    timeout; ``ceiling_s``: the most a run may last (default ``CEILING_FACTOR`` x
    ``timeout_s``). ``launcher`` picks the start method (default: a fork server
    preloading torch). ``on_started`` is called once every rank has started, e.g. to
    show progress: the fork server ignores Ctrl-C while it starts, and from then on a
    Ctrl-C reaches the caller. Raises :class:`RankCrashed` or :class:`RankTimeout`
    (both :class:`DistributedRunError`).
    """
    return (launcher or RankLauncher()).spawn(fn, world_size, *args, backend=backend,
                                              timeout_s=timeout_s, ceiling_s=ceiling_s,
                                              on_started=on_started)


def spawn_each(
    fn: Callable[..., Any],
    world_size: int,
    items: Sequence[Any],
    *args: Any,
    isolate: bool,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ceiling_s: float | None = None,
    launcher: RankLauncher | None = None,
    on_started: Callable[[], None] | None = None,
) -> list[ItemOutcome]:
    """Run ``fn(rank, world_size, item, *args)`` for each of ``items`` on ``world_size`` fresh
    processes; one :class:`ItemOutcome` per item, in order.

    A rank that raises (or dies) while running an item ends its world within
    ``FAILURE_GRACE_S``: its peers, which may be waiting for it in a collective, are stopped,
    and that item's outcome is the :class:`RankCrashed` naming every failed rank's root cause.
    The items after it run in a fresh world. With ``isolate=True`` every item runs in a world
    of its own (fresh processes forked from the launcher's warm server), so no process-wide
    state one item leaves reaches the next; with ``isolate=False`` items share a world until
    one crashes. A stall still raises :class:`RankTimeout` (no verdict on any item), and a
    failure in the harness's own start or teardown raises :class:`RankCrashed`.
    """
    return (launcher or RankLauncher()).spawn_each(
        fn, world_size, items, *args, isolate=isolate, backend=backend, timeout_s=timeout_s,
        ceiling_s=ceiling_s, on_started=on_started)

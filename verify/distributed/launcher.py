"""Start W rank processes, wait for them until they finish or stall, and explain what went wrong.

Start-up: importing torch costs a fresh process about 1.5 s, which used to be
~43% of a ``verify run``. With the ``forkserver`` start method, one server
process imports torch (and the light first-party packages) once and every rank
is forked from it: each ``spawn`` still gets brand-new processes, so checks
cannot see each other's state, but no rank pays the import.

The fork server is CPython's, one per interpreter (``multiprocessing.forkserver``),
started on first use with the preload list of the first launcher that starts it.
:class:`RankLauncher` only names how to start ranks; it holds no processes, so a
default one is built per call instead of being kept in a module global.

Concurrency: every ``spawn`` has its own pipes, shared-memory progress slots,
stack-dump folder and rendezvous store, whose port the OS assigns while the
store is bound (no free-port race). Two threads may call it at once.
"""

from __future__ import annotations

import inspect
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing import forkserver
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from verify.distributed._child import (
    ITEM_DONE,
    ITEM_FAILED,
    RANK_DONE,
    RANK_FAILED,
    RankJob,
    rank_main,
)
from verify.distributed.diagnosis import diagnose, process_state, request_stack_dumps
from verify.distributed.errors import RankCrashed, RankFailure, RankTimeout
from verify.distributed.progress import ProgressBoard
from verify.distributed.stall import (
    CEILING_FACTOR,
    Sample,
    StallWatch,
    cpu_seconds,
    thread_readings,
)

# Stall timeout of one spawn when the caller gives none (checks pass CheckContext.timeout_s):
# a run whose unfinished ranks all made no progress (no marker, no CPU, no thread waiting
# for a CPU) for this long is stalled (verify.distributed.stall). Slow is not stalled, so
# the figure need not cover a loaded machine: a hung run on a laptop still reports within
# about a minute.
DEFAULT_TIMEOUT_S = 60.0
# Modules the fork server imports once; ImportErrors among them are ignored by CPython.
# torch imports torch.fx.experimental.symbolic_shapes (and with it sympy) lazily, on a
# rank's first backward or collective: ~0.5 s per rank on an idle core, paid by every
# rank of every check when not preloaded.
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.multiprocessing",
                   "torch.fx.experimental.symbolic_shapes",
                   "verify.distributed", "gradvocab", "refgrad", "fastgrad")
START_METHODS = ("forkserver", "spawn")
# Overrides the default start method, e.g. VERIFY_RANK_START_METHOD=spawn for the old
# behaviour (bench/bench_verify_run.py times both), or where forkserver misbehaves.
START_METHOD_VARIABLE = "VERIFY_RANK_START_METHOD"
# The ranks' own waits (rendezvous store, collectives) end after this many ceilings: with
# exactly the ceiling, a rank waiting for a peer that loops forever raised its own timeout
# before the parent, polling late on a starved machine, ended the run at its ceiling (seen
# at load ~25 with 8 spinners: RankCrashed instead of RankTimeout).
RANK_WAIT_FACTOR = 2.0
# After the first rank fails, how long its peers get to report their own errors.
FAILURE_GRACE_S = 1.0
# Between SIGTERM to every rank and SIGKILL to every rank still alive.
TERMINATE_GRACE_S = 1.0
_POLL_S = 0.5


@contextmanager
def sigint_ignored_in_children() -> Iterator[None]:
    """Start the fork server with Ctrl-C ignored (the disposition survives fork and exec).

    A terminal sends SIGINT to the whole process group: the fork server (while it
    imports torch) must not print a KeyboardInterrupt traceback; the parent handles
    Ctrl-C and kills the ranks, which ignore it themselves (``rank_main``). Only
    around the server's start, which returns at once: a signal arriving in that
    window is lost. Handlers can be changed only on the main thread; a server first
    started from another thread keeps Ctrl-C (its ranks still ignore it).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass(frozen=True)
class RankLauncher:
    """How rank processes are started: ``forkserver`` (fast, default) or ``spawn`` (baseline)."""

    start_method: str = field(default_factory=lambda: os.environ.get(START_METHOD_VARIABLE, "forkserver"))
    preload: tuple[str, ...] = DEFAULT_PRELOAD

    def __post_init__(self) -> None:
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method (or ${START_METHOD_VARIABLE}) must be one of "
                             f"{START_METHODS}, got {self.start_method!r}")
        if self.start_method not in mp.get_all_start_methods():
            raise ValueError(f"start_method {self.start_method!r} is not available on this platform")
        if not all(isinstance(m, str) and m for m in self.preload):
            raise TypeError(f"preload must be a tuple of module names, got {self.preload!r}")

    def preloading(self, *modules: str) -> RankLauncher:
        """This launcher with ``modules`` added to its fork server's preload (a candidate's
        ``preload_modules``). A fork server already running keeps its own preload: the
        first launcher to start it decides (``verify run`` starts it with every candidate's)."""
        return replace(self, preload=tuple(dict.fromkeys((*self.preload, *modules))))

    def context(self) -> Any:
        """The multiprocessing context every rank is started from (the test guard patches this)."""
        context = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # Takes effect when the server starts; a running server keeps its preload.
            context.set_forkserver_preload(list(self.preload))
            # Start it here (a no-op when running) so that it starts ignoring Ctrl-C.
            with sigint_ignored_in_children():
                forkserver.ensure_running()
        return context

    def warm_up(self, wait_s: float = 0.0) -> None:
        """Start the fork server now; it imports ``preload`` in the background.

        With ``wait_s > 0``, wait up to that long for the imports to finish (a no-op
        process is forked once they have), e.g. before timing or short stall timeouts.
        """
        if self.start_method != "forkserver":
            return
        context = self.context()
        if wait_s > 0:
            probe = context.Process(target=int)
            probe.start()
            probe.join(timeout=wait_s)
            if probe.exitcode is None:
                probe.kill()
                probe.join(timeout=TERMINATE_GRACE_S)

    def spawn(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        backend: str = "gloo",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        ceiling_s: float | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> list[Any]:
        """See :func:`verify.distributed.spawn`."""
        ceiling_s = CEILING_FACTOR * timeout_s if ceiling_s is None else ceiling_s
        _validate(fn, world_size, timeout_s, ceiling_s)
        world = _Run(self.context(), fn, world_size, args, backend, timeout_s, ceiling_s,
                     None, 0).wait(on_started)
        if world.crash is not None:
            raise world.crash
        return [world.results[r][0] for r in range(world_size)]

    def spawn_each(
        self,
        fn: Callable[..., Any],
        world_size: int,
        items: Sequence[Any],
        *args: Any,
        isolate: bool,
        backend: str = "gloo",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        ceiling_s: float | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> list[ItemOutcome]:
        """See :func:`verify.distributed.spawn_each`."""
        ceiling_s = CEILING_FACTOR * timeout_s if ceiling_s is None else ceiling_s
        _validate(fn, world_size, timeout_s, ceiling_s)
        items = list(items)
        outcomes: list[ItemOutcome] = []
        while len(outcomes) < len(items):
            start = len(outcomes)
            batch = items[start:start + 1] if isolate else items[start:]
            world = _Run(self.context(), fn, world_size, args, backend, timeout_s, ceiling_s,
                         tuple(batch), start).wait(on_started)
            for index in range(start, start + len(batch)):
                if index in world.item_crashes:  # every rank got past it: the world went on
                    outcomes.append(ItemOutcome(None, world.item_crashes[index]))
                    continue
                if all(index in world.results[r] for r in range(world_size)):
                    outcomes.append(ItemOutcome([world.results[r][index] for r in range(world_size)]))
                    continue
                if world.crash is None:  # cannot happen: a world ends complete or crashed
                    raise RuntimeError(f"spawn_each: item {index} has no result and no failure")
                if world.crash_item != index:
                    # The failure was in the harness's own start or teardown, not an item.
                    raise world.crash
                outcomes.append(ItemOutcome(None, world.crash))
                break
        return outcomes


@dataclass(frozen=True)
class ItemOutcome:
    """One item of :func:`verify.distributed.spawn_each`: every rank's result (by rank), or
    the :class:`RankCrashed` that ended its world while it ran."""

    results: list[Any] | None
    crash: RankCrashed | None = None

    def __post_init__(self) -> None:
        if (self.results is None) == (self.crash is None):
            raise ValueError("ItemOutcome holds either results or a crash")


@dataclass
class _WorldOutcome:
    """What one world returned: results by rank and item index, the crash that ended it
    early (None: every rank finished) with the item the first failure happened in, and the
    crashes of items every rank got past (the world went on after them)."""

    results: dict[int, dict[int, Any]]
    crash: RankCrashed | None
    crash_item: int | None
    item_crashes: dict[int, RankCrashed] = field(default_factory=dict)


def _validate(fn: Callable[..., Any], world_size: int, timeout_s: float,
              ceiling_s: float) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not timeout_s > 0:  # also refuses NaN
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if not ceiling_s >= timeout_s:
        raise ValueError(f"ceiling_s must be >= timeout_s ({timeout_s}), got {ceiling_s}")


def _wants_progress(fn: Callable[..., Any]) -> bool:
    try:
        parameter = inspect.signature(fn).parameters.get("progress")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY


class _Run:
    """One world: its processes, their result pipes and everything needed to diagnose them."""

    def __init__(self, context: Any, fn: Callable[..., Any], world_size: int,
                 args: tuple[Any, ...], backend: str, timeout_s: float, ceiling_s: float,
                 items: tuple[Any, ...] | None, first_item: int) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.ceiling_s = ceiling_s
        self.watch = StallWatch(timeout_s, ceiling_s, started_at=time.monotonic())
        self.board = ProgressBoard(context, world_size)
        self.stack_dir = Path(tempfile.mkdtemp(prefix="verify-ranks-"))
        self.stack_files = {r: self.stack_dir / f"rank{r}.stack" for r in range(world_size)}
        # The parent hosts the rendezvous store on a port the OS picks and holds. Its waits
        # (and the ranks', see RankJob) are bounded beyond the ceiling: the parent decides
        # stalls and ceilings, even when its polls come late on a starved machine.
        rank_wait_s = RANK_WAIT_FACTOR * ceiling_s
        self.store = dist.TCPStore("127.0.0.1", 0, None, is_master=True,
                                   timeout=timedelta(seconds=rank_wait_s), wait_for_workers=False)
        self.results: dict[int, dict[int, Any]] = {r: {} for r in range(world_size)}
        self.items_count = None if items is None else len(items)
        self.first_item = first_item
        self.done: set[int] = set()
        self.failures: dict[int, RankFailure] = {}
        self.arrivals: list[tuple[int, RankFailure]] = []  # failures in the order they came
        self.failures_seen_at = float("inf")
        # Items some rank raised in while the others may still be inside them (a shared
        # world): its failures in arrival order, and since when it waits to be got past.
        self.item_failures: dict[int, list[tuple[int, RankFailure]]] = {}
        self.unsettled_since: dict[int, float] = {}
        self.readers: dict[Any, int] = {}
        self.procs: list[Any] = []
        wants_progress = _wants_progress(fn)
        environment = dict(os.environ)
        try:
            for rank in range(world_size):
                reader, writer = context.Pipe(duplex=False)
                job = RankJob(rank, world_size, self.store.port, backend, fn, args, wants_progress,
                              self.board.for_rank(rank), str(self.stack_files[rank]), environment,
                              rank_wait_s, os.getpid(), items, first_item)
                proc = context.Process(target=rank_main, args=(job, writer))
                proc.start()
                # Only the child may hold the write end, so its death reads as EOF here.
                writer.close()
                self.readers[reader] = rank
                self.procs.append(proc)
        except BaseException:
            self._stop_all()
            raise

    def wait(self, on_started: Callable[[], None] | None = None) -> _WorldOutcome:
        """Collect every rank's results until all are done or one fails (its peers get
        ``FAILURE_GRACE_S`` to report theirs, then every rank is stopped); an item of a
        shared world that some rank raised in ends the world the same way unless every rank
        gets past it within the grace (then the world goes on). Raise RankTimeout instead of
        hanging. ``on_started`` runs first (its error, Ctrl-C included, still stops the
        ranks)."""
        try:
            if on_started is not None:
                on_started()
            stalled = over_ceiling = False
            while len(self.done) < self.world_size:
                now = time.monotonic()
                if self.failures and not self._unfinished():
                    break  # every rank has finished or failed: nothing left to wait for
                if now >= self._grace_ends():
                    break
                self._sample(now)
                stalled = self.watch.stalled(self._unfinished(), now)
                over_ceiling = self.watch.over_ceiling(now)
                if stalled or over_ceiling:
                    break
                stop_at = min(now + _POLL_S, self._grace_ends())
                pending = [c for c, r in self.readers.items()
                           if r not in self.done and r not in self.failures]
                ready = wait(pending, timeout=max(0.0, stop_at - time.monotonic()))
                for conn in ready:
                    self._receive(conn)
            settled = {k: RankCrashed.from_arrivals(arrivals, {})
                       for k, arrivals in self.item_failures.items() if k not in self.unsettled_since}
            if len(self.done) == self.world_size:
                return _WorldOutcome(self.results, None, None, settled)
            unfinished = self._unfinished()
            if self.failures or self.unsettled_since:
                states = self._diagnose(unfinished, with_stacks=False)
                self._stop_all()
                stuck = min(self.unsettled_since, default=None)
                arrivals = [*(self.item_failures[stuck] if stuck is not None else []),
                            *self.arrivals]
                crash = RankCrashed.from_arrivals(arrivals, states)
                first = min(crash.failures.values(), key=lambda f: (f.item is None, f.item or 0))
                return _WorldOutcome(self.results, crash, first.item, settled)
            states = self._diagnose(unfinished, with_stacks=True)
            self._stop_all()
            raise RankTimeout(self.timeout_s, self.world_size, states,
                              ceiling_s=None if stalled else self.ceiling_s)
        finally:
            self._stop_all()
            for conn in self.readers:
                conn.close()
            shutil.rmtree(self.stack_dir, ignore_errors=True)
            self.store = None  # closes the rendezvous port now, not at garbage collection

    def _grace_ends(self) -> float:
        """When the world must end unless something more arrives: the failure grace after
        the first rank's fatal failure, or after the oldest item failure not yet got past."""
        oldest = min((self.failures_seen_at, *self.unsettled_since.values()))
        return oldest + FAILURE_GRACE_S

    def _settle(self, index: int) -> None:
        """Stop waiting on item ``index`` once every rank has returned from or raised in it."""
        if index not in self.unsettled_since:
            return
        raised = {rank for rank, _ in self.item_failures[index]}
        if all(index in self.results[r] or r in raised for r in range(self.world_size)):
            del self.unsettled_since[index]

    def _unfinished(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.done and r not in self.failures]

    def _sample(self, now: float) -> None:
        """One reading of every unfinished rank's progress for the stall watch."""
        for rank in self._unfinished():
            pid = self.procs[rank].pid
            self.watch.observe(rank, Sample(now, self.board.sequence(rank), cpu_seconds(pid),
                                            thread_readings(pid)))

    def _receive(self, conn: Any) -> None:
        rank = self.readers[conn]
        try:
            kind, index, payload = conn.recv()
        except (EOFError, OSError):
            # The write end closed without a message: the process died before reporting.
            proc = self.procs[rank]
            proc.join(timeout=1.0)
            kind, index, payload = RANK_FAILED, None, RankFailure.died(
                process_state(proc.pid, proc.exitcode), self._item_running(rank))
        if kind == ITEM_DONE:
            self.results[rank][index] = pickle.loads(payload)
            self._settle(index)
        elif kind == ITEM_FAILED:
            self.item_failures.setdefault(index, []).append((rank, payload))
            self.unsettled_since.setdefault(index, time.monotonic())
            self._settle(index)
        elif kind == RANK_DONE:
            self.done.add(rank)
        else:
            self.failures_seen_at = min(self.failures_seen_at, time.monotonic())
            self.failures[rank] = payload
            self.arrivals.append((rank, payload))

    def _item_running(self, rank: int) -> int | None:
        """The item a rank that died without a word was running: the first it had not
        reported (None when it had reported them all: it died in the teardown)."""
        reported = self.results[rank]
        if self.items_count is None:
            return 0 if not reported else None
        for index in range(self.first_item, self.first_item + self.items_count):
            if index not in reported:
                return index
        return None

    def _diagnose(self, ranks: list[int], with_stacks: bool) -> dict:
        pids = {r: self.procs[r].pid for r in ranks}
        dumps = {}
        if with_stacks:
            running = {r: pid for r, pid in pids.items()
                       if self.board.read(r) is not None and _state(self.procs[r]) == "running"}
            dumps = request_stack_dumps(running, self.stack_files)
        exitcodes = {r: self.procs[r].exitcode for r in ranks}
        states = diagnose(ranks, pids, exitcodes, self.board, dumps)
        return {r: replace(state, recent_cpu_s=self.watch.recent_cpu_s(r),
                           window_s=self.watch.window_s(r), starved=self.watch.starved(r))
                for r, state in states.items()}

    def _stop_all(self) -> None:
        """SIGTERM every live rank at once, SIGKILL the rest after a grace, join with a deadline."""
        alive = [p for p in self.procs if p.exitcode is None]
        for proc in alive:
            # A frozen process acts on SIGTERM only once continued: no grace for it.
            _signal(proc.kill if _state(proc).startswith("stopped") else proc.terminate)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for proc in alive:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        # SIGKILL also ends a process frozen with SIGSTOP, which never sees SIGTERM.
        for proc in alive:
            if proc.exitcode is None:
                _signal(proc.kill)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for proc in alive:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))


def _state(proc: Any) -> str:
    return process_state(proc.pid, proc.exitcode)


def _signal(send: Callable[[], None]) -> None:
    try:
        send()
    except OSError:  # already gone
        pass

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing import forkserver
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from verify.distributed._child import RankJob, rank_main
from verify.distributed.diagnosis import diagnose, process_state, request_stack_dumps
from verify.distributed.errors import RankCrashed, RankTimeout
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
                   "verify.distributed", "refgrad", "fastgrad")
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
        run = _Run(self.context(), fn, world_size, args, backend, timeout_s, ceiling_s)
        return run.wait(on_started)


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
    """One spawn: its processes, their result pipes and everything needed to diagnose them."""

    def __init__(self, context: Any, fn: Callable[..., Any], world_size: int,
                 args: tuple[Any, ...], backend: str, timeout_s: float, ceiling_s: float) -> None:
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
        self.results: dict[int, Any] = {}
        self.failures: dict[int, str] = {}
        self.failures_seen_at = float("inf")
        self.readers: dict[Any, int] = {}
        self.procs: list[Any] = []
        wants_progress = _wants_progress(fn)
        environment = dict(os.environ)
        try:
            for rank in range(world_size):
                reader, writer = context.Pipe(duplex=False)
                job = RankJob(rank, world_size, self.store.port, backend, fn, args, wants_progress,
                              self.board.for_rank(rank), str(self.stack_files[rank]), environment,
                              rank_wait_s, os.getpid())
                proc = context.Process(target=rank_main, args=(job, writer))
                proc.start()
                # Only the child may hold the write end, so its death reads as EOF here.
                writer.close()
                self.readers[reader] = rank
                self.procs.append(proc)
        except BaseException:
            self._stop_all()
            raise

    def wait(self, on_started: Callable[[], None] | None = None) -> list[Any]:
        """Collect every rank's result; raise RankCrashed or RankTimeout instead of hanging.
        ``on_started`` runs first (its error, Ctrl-C included, still stops the ranks)."""
        try:
            if on_started is not None:
                on_started()
            stalled = over_ceiling = False
            while len(self.results) < self.world_size:
                now = time.monotonic()
                if now >= self.failures_seen_at + FAILURE_GRACE_S:
                    break
                self._sample(now)
                stalled = self.watch.stalled(self._unfinished(), now)
                over_ceiling = self.watch.over_ceiling(now)
                if stalled or over_ceiling:
                    break
                stop_at = min(now + _POLL_S, self.failures_seen_at + FAILURE_GRACE_S)
                pending = [c for c, r in self.readers.items()
                           if r not in self.results and r not in self.failures]
                ready = wait(pending, timeout=max(0.0, stop_at - time.monotonic()))
                for conn in ready:
                    self._receive(conn)
            if len(self.results) == self.world_size:
                return [self.results[r] for r in range(self.world_size)]
            unfinished = self._unfinished()
            if self.failures:
                states = self._diagnose(unfinished, with_stacks=False)
                self._stop_all()
                raise RankCrashed(self.failures, states)
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

    def _unfinished(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.results and r not in self.failures]

    def _sample(self, now: float) -> None:
        """One reading of every unfinished rank's progress for the stall watch."""
        for rank in self._unfinished():
            pid = self.procs[rank].pid
            self.watch.observe(rank, Sample(now, self.board.sequence(rank), cpu_seconds(pid),
                                            thread_readings(pid)))

    def _receive(self, conn: Any) -> None:
        rank = self.readers[conn]
        try:
            ok, payload = conn.recv()
        except (EOFError, OSError):
            # The write end closed without a message: the process died before reporting.
            proc = self.procs[rank]
            proc.join(timeout=1.0)
            ok, payload = False, f"process {process_state(proc.pid, proc.exitcode)} before reporting"
        if ok:
            self.results[rank] = pickle.loads(payload)
            return
        self.failures_seen_at = min(self.failures_seen_at, time.monotonic())
        self.failures[rank] = payload

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

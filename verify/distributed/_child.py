"""The entry point of every rank process (kept tiny: it is what forkserver children run)."""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pickle
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from verify.distributed.errors import RankFailure
from verify.distributed.progress import RankProgress

# What a rank sends its parent, one message per event, in order:
#   (ITEM_DONE, index, pickled result)   an item (a plain spawn's one call: index 0) returned
#   (ITEM_FAILED, index, RankFailure)    an item of a shared world raised; the rank goes on
#                                        only if every rank gets past that item (below)
#   (RANK_DONE, None, None)              every item returned and the final barrier passed
#   (RANK_FAILED, index or None, RankFailure)  it raised and stops (in that item; None:
#                                        start or teardown)
ITEM_DONE, ITEM_FAILED, RANK_DONE, RANK_FAILED = "item", "item failed", "done", "failed"


@dataclass(frozen=True)
class RankJob:
    """Everything one rank needs, sent to it when it starts."""

    rank: int
    world_size: int
    store_port: int
    backend: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    pass_progress: bool
    progress: RankProgress
    stack_path: str
    environment: dict[str, str]
    # Bound on every wait inside the rank (rendezvous store, collectives): beyond the run's
    # ceiling (launcher.RANK_WAIT_FACTOR); stalls and the ceiling are decided by the parent
    # (verify.distributed.stall).
    ceiling_s: float
    # The process that called spawn; the rank exits when it is gone (see _exit_with_parent).
    parent_pid: int
    # spawn_each: ``fn(rank, world_size, item, *args)`` for each item in turn, each result
    # sent as it is ready; None: one call ``fn(rank, world_size, *args)`` (spawn).
    items: tuple[Any, ...] | None = None
    # Index of ``items[0]`` in the caller's whole list (a world restarted after a crash
    # runs the rest of the list).
    first_item: int = 0


_PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _exit_with_parent(parent_pid: int) -> None:
    """End this rank soon after the process that launched it has gone.

    Forkserver ranks are children of the fork server, not of the caller, so a caller
    that dies (or is interrupted while ranks are still starting) would otherwise leave
    them waiting on its store for minutes, holding the terminal's output open.
    """

    def watch() -> None:
        try:
            # Readable once the parent has exited. select() waits without waking and
            # without the GIL: a poll every 0.5 s took the GIL from a computing rank,
            # which then gave the CPU up as often as a starved one is preempted, and the
            # stall rule reads those context switches (verify.distributed.stall).
            parent = os.pidfd_open(parent_pid)
        except (AttributeError, OSError):  # not Linux >= 5.3, or the parent has gone
            parent = None
        if parent is not None:
            select.select([parent], [], [])
            os._exit(1)
        while True:
            time.sleep(_PARENT_POLL_S)
            if not _parent_alive(parent_pid):  # gone (or its pid reused by another user)
                os._exit(1)

    # A rank blocked in a C++ call that holds the GIL (connecting to a vanished store)
    # never runs the watcher; on Linux the kernel also kills it when its own parent
    # (the fork server, which exits with the caller) goes.
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


_CONNECT_ATTEMPT_S = 2.0


def _parent_alive(parent_pid: int) -> bool:
    """True while the launching process runs (a zombie, exited but not yet reaped, is gone)."""
    try:
        os.kill(parent_pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{parent_pid}/stat") as stat:
            # "pid (comm) state ...": comm may contain spaces and parentheses.
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)


def _connect_store(job: RankJob) -> Any:
    """Connect to the parent's rendezvous store in short attempts while the parent lives.

    One long connect blocks in C++ with the GIL held, so a rank whose parent was
    interrupted or died would wait out the whole ceiling (and keep the terminal's
    output open); short attempts let it notice and exit.
    """
    deadline = time.monotonic() + job.ceiling_s
    while True:
        attempt = min(_CONNECT_ATTEMPT_S, max(0.1, deadline - time.monotonic()))
        try:
            store = dist.TCPStore("127.0.0.1", job.store_port, job.world_size, is_master=False,
                                  timeout=timedelta(seconds=attempt))
        except (RuntimeError, TimeoutError):  # DistNetworkError/DistStoreError are RuntimeErrors
            if not _parent_alive(job.parent_pid):
                os._exit(1)
            if time.monotonic() >= deadline:
                raise
            continue
        store.set_timeout(timedelta(seconds=job.ceiling_s))
        return store


def _past_item(job: RankJob, store: Any, item: int, failed: bool, progress: RankProgress) -> None:
    """Meet every rank after ``item``, on the rendezvous store (not a collective): no rank
    starts the next item before every rank has returned from or raised in this one, so after
    a failure none is left inside this item's collectives. Where any rank raised, every rank
    then makes its default process group anew (a collective a raising rank left half done
    must not pair with the next item's). A rank left waiting in a collective for a peer that
    raised never arrives: the parent ends the world (``FAILURE_GRACE_S``) and the items after
    this one run in a new one."""
    progress.mark(f"item {item}: waiting for every rank to get past it")
    prefix = f"verify/after-item/{item}"
    failures = store.add(f"{prefix}/failed", 1 if failed else 0)
    if store.add(f"{prefix}/arrived", 1) == job.world_size:
        store.set(f"{prefix}/all", "1")
    store.wait([f"{prefix}/all"])
    if int(store.get(f"{prefix}/failed")) or failures:
        dist.destroy_process_group()
        dist.init_process_group(job.backend, store=dist.PrefixStore(f"{prefix}/group", store),
                                rank=job.rank, world_size=job.world_size,
                                timeout=timedelta(seconds=job.ceiling_s))


def rank_main(job: RankJob, result_conn: Any) -> None:
    """Run ``job.fn`` in a process group; send what it returned, or why it failed (above).

    The name is what :mod:`verify.distributed.diagnosis` looks for in stack dumps.
    """
    # Ctrl-C reaches every process of the terminal's group: the parent handles it and
    # kills the ranks, so a rank must not die printing its own KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(job.parent_pid)
    progress = job.progress
    # Forkserver children inherit the server's environment, taken when it started;
    # a rank must see the caller's, as a freshly spawned process would.
    os.environ.clear()
    os.environ.update(job.environment)
    # Kept open for the life of the process: faulthandler writes the stack here on SIGUSR1.
    stack_file = open(job.stack_path, "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    # The first marker also tells the parent that SIGUSR1 is now safe to send.
    progress.mark("starting")
    # One intra-op thread per rank: W ranks share 2 cores in CI.
    torch.set_num_threads(1)
    item: int | None = None
    try:
        progress.mark("init_process_group")
        store = _connect_store(job)
        dist.init_process_group(job.backend, store=store, rank=job.rank, world_size=job.world_size,
                                timeout=timedelta(seconds=job.ceiling_s))
        progress.mark("running the rank function")
        kwargs = {"progress": progress} if job.pass_progress else {}
        if job.items is None:
            item = 0
            result = job.fn(job.rank, job.world_size, *job.args, **kwargs)
            # A plain spawn's result travels after the final barrier: a rank that returned
            # while a peer raised must not count as done.
            pending = [(0, result)]
        else:
            pending = []
            for offset, value in enumerate(job.items):
                item = job.first_item + offset
                progress.mark(f"item {item}")
                failed = False
                try:
                    result = job.fn(job.rank, job.world_size, value, *job.args, **kwargs)
                except Exception as error:  # noqa: BLE001 - the item's failure, forwarded
                    if len(job.items) == 1:
                        raise  # a world of one item: it simply ends
                    failed = True
                    result_conn.send((ITEM_FAILED, item, RankFailure.from_exception(error, item)))
                else:
                    # Plain pickle copies tensor data by value; the connection's own pickler
                    # would send shared-memory handles that vanish when this process exits.
                    result_conn.send((ITEM_DONE, item, pickle.dumps(result)))
                if len(job.items) > 1:
                    _past_item(job, store, item, failed, progress)
        item = None
        progress.mark("returned; in the harness's final barrier")
        dist.barrier()
        dist.destroy_process_group()
        progress.mark("sending the result")
        for index, result in pending:
            result_conn.send((ITEM_DONE, index, pickle.dumps(result)))
        result_conn.send((RANK_DONE, None, None))
    except BaseException as error:  # noqa: BLE001 - forwarded to the parent
        # Report at once and skip the barrier: peers may be blocked in a collective
        # waiting for this rank, and the parent stops them once it sees this failure.
        result_conn.send((RANK_FAILED, item, RankFailure.from_exception(error, item)))

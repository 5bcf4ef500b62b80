"""The entry point of every rank process (kept tiny: it is what forkserver children run)."""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from verify.distributed.progress import RankProgress


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
    timeout_s: float


def rank_main(job: RankJob, result_conn: Any) -> None:
    """Run ``job.fn`` in a process group; send ``(True, pickled result)`` or ``(False, traceback)``.

    The name is what :mod:`verify.distributed.diagnosis` looks for in stack dumps.
    """
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
    try:
        progress.mark("init_process_group")
        store = dist.TCPStore("127.0.0.1", job.store_port, job.world_size, is_master=False,
                              timeout=timedelta(seconds=job.timeout_s))
        dist.init_process_group(job.backend, store=store, rank=job.rank, world_size=job.world_size)
        progress.mark("running the rank function")
        kwargs = {"progress": progress} if job.pass_progress else {}
        result = job.fn(job.rank, job.world_size, *job.args, **kwargs)
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        # Report at once and skip the barrier: peers may be blocked in a collective
        # waiting for this rank, and the parent kills them once it sees this failure.
        result_conn.send((False, traceback.format_exc()))
        return
    try:
        progress.mark("returned; in the harness's final barrier")
        dist.barrier()
        dist.destroy_process_group()
        progress.mark("sending the result")
        # Plain pickle copies tensor data by value; the connection's own pickler would
        # send shared-memory handles that vanish when this process exits.
        result_conn.send((True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        result_conn.send((False, traceback.format_exc()))

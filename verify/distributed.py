"""Run a function on W real ``torch.distributed`` processes (gloo on CPU) and collect results.

Used by checks and tests that need real collectives on a laptop or CI machine.
Each child process initialises its own process group on a fresh localhost port,
runs ``fn(rank, world_size, *args)``, and sends back the (picklable) return value.
An exception in any rank is re-raised in the parent with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240.0
_POLL_S = 0.5


class DistributedRunError(RuntimeError):
    """A rank failed or timed out; the message carries every rank's traceback."""


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # One intra-op thread per rank: W ranks share 2 cores in CI.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        # Report at once and skip the barrier: peers may be blocked in a collective
        # waiting for this rank, and the parent kills them once it sees this failure.
        queue.put((rank, False, traceback.format_exc()))
        return
    try:
        dist.barrier()
        dist.destroy_process_group()
        # Plain pickle copies tensor data by value; the queue's own pickler would send
        # shared-memory handles that vanish when this process exits.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        queue.put((rank, False, traceback.format_exc()))


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``fn`` must be a module-level function (it is pickled into spawned processes).
    Return values may hold tensors; they are copied back by value.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not timeout_s > 0:  # also refuses NaN
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, backend, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size and not failures:
            try:
                rank, ok, payload = queue.get(timeout=_POLL_S)
            except queue_module.Empty:
                # A child that died before reporting (e.g. killed, or failed to unpickle
                # fn) will never report: fail now instead of waiting out the timeout.
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    failures.update(
                        {r: f"process exited with code {procs[r].exitcode} before reporting"
                         for r in dead if r not in results}
                    )
                elif time.monotonic() > deadline:
                    raise DistributedRunError(
                        f"timed out after {timeout_s}s waiting for ranks; got {sorted(results)}"
                    ) from None
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if failures else 30)
        # A rank that died without reporting is usually the root cause of the others'
        # failures (their collectives see a reset connection): name it too.
        for r, p in enumerate(procs):
            if r not in results and r not in failures and p.exitcode not in (None, 0):
                failures[r] = f"process exited with code {p.exitcode} before reporting"
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise DistributedRunError(
            "".join(f"\n--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures.items()))
        )
    return [results[r] for r in range(world_size)]

"""Megatron-Core bug: ``reduce_scatter_with_fp32_accumulation`` with ``average_in_collective``
is accepted, then the first grad sync fails a bare assert.

``DistributedDataParallelConfig(reduce_scatter_with_fp32_accumulation=True,
average_in_collective=True)`` is accepted (no validation); ``DistributedDataParallel`` then
reduces with ``ReduceOp.AVG`` and
``megatron/core/distributed/reduce_scatter_with_fp32_accumulation.py`` fails
``assert op == torch.distributed.ReduceOp.SUM`` with no message. Expected: a configuration
error naming the two options (or an fp32-accumulated average).

Here, on 2 ranks: one DDP with both options (distributed optimizer), one backward, then
``finish_grad_sync``.

Needs only megatron-core and torch; 2 gloo processes (torch.multiprocessing). On a machine
without CUDA, Megatron's CUDA assumptions are redirected to the CPU by
``verify.candidates.megatron_core.redirect.cpu_redirects`` (gradverify); on a GPU node it is
not needed and not used (NCCL there).

    python examples/megatron_core/repro_fp32_rs_with_avg.py   # exit 1: bug, 0: fixed
"""

import contextlib
import os
import socket
import sys
from importlib.metadata import version

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, NUMEL = 2, 1024
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MEGATRON_CORE = f"megatron-core {version('megatron-core')}"  # the release this run shows


def on_this_device():
    """Nothing on a GPU node; on a CPU, gradverify's redirects of Megatron's CUDA calls."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from verify.candidates.megatron_core.redirect import cpu_redirects

    return cpu_redirects()


def rank_grad(rank: int, iteration: int) -> torch.Tensor:
    """Even integers: their mean over 2 ranks is exact in bf16."""
    g = torch.Generator().manual_seed(100 * iteration + rank)
    return (2 * torch.randint(-8, 9, (NUMEL,), generator=g)).to(torch.bfloat16).to(DEVICE)


class Weights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(NUMEL, dtype=torch.bfloat16, device=DEVICE))

    def forward(self, coefficients):
        return (self.weight * coefficients).sum()  # weight.grad == coefficients


def run(rank: int) -> bool:
    """True when the configuration is refused with a message or averages right."""
    import traceback

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel()
    try:
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=False,
            reduce_scatter_with_fp32_accumulation=True, average_in_collective=True)
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                   use_cpu_initialization=True)
        model = DistributedDataParallel(config, ddp_config, Weights())
    except (ValueError, AssertionError) as refusal:
        print(f"rank {rank}: the configuration was refused: {refusal!r}")
        return bool(str(refusal))
    model(rank_grad(rank, 0)).backward()
    try:
        model.finish_grad_sync()
    except AssertionError as error:
        where = traceback.extract_tb(error.__traceback__)[-1]
        if rank == 0:
            print("expected: a configuration error naming both options, or the average")
            print(f"got:      the config was accepted; the first grad sync raised "
                  f"AssertionError({str(error)!r}) at "
                  f"{where.filename.split('site-packages/')[-1]}:{where.lineno}: {where.line}")
        return False
    (buffer,) = model.buffers
    shard = buffer.grad_data.numel() // WORLD
    lo, hi = rank * shard, min((rank + 1) * shard, NUMEL)
    mean = (rank_grad(0, 0).float() + rank_grad(1, 0).float()) / 2
    same = torch.equal(buffer.grad_data[lo:hi].float(), mean[lo:hi])
    print(f"rank {rank}: the grad sync ran; its shard {'is' if same else 'is NOT'} the mean")
    return same


def rank_main(rank: int, results) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", os.environ["REPRO_PORT"]
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            rank=rank, world_size=WORLD)
    try:
        with on_this_device():
            ok = run(rank)
        results.put((rank, ok))
        # Every rank's collectives finish before any tears its group down: a gloo peer that
        # is torn down under a collective still in flight aborts the other (SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(MEGATRON_CORE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["REPRO_PORT"] = str(s.getsockname()[1])
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(results,), nprocs=WORLD)
    ok = all(results.get()[1] for _ in range(WORLD))
    print(f"fixed in {MEGATRON_CORE}: the two options are refused with a message, or the grad "
          "sync averages right" if ok else "BUG: reduce_scatter_with_fp32_accumulation + "
          "average_in_collective is accepted, then a bare assert at the first grad sync")
    sys.exit(0 if ok else 1)

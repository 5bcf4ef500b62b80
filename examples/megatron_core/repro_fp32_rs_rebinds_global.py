"""Megatron-Core bug: ``reduce_scatter_with_fp32_accumulation`` rebinds a module global for
the whole process, and a plain DDP built after it reduces nothing.

``megatron/core/distributed/param_and_grad_buffer.py`` ``_ParamAndGradBucketGroup.__init__``
does ``global dist_reduce_scatter_func; dist_reduce_scatter_func =
reduce_scatter_with_fp32_accumulation`` when its config asks for fp32 accumulation. Every
bucket group built later in the process, whatever its config, then reduce-scatters through
that function; with ``overlap_grad_reduce`` its ``start_grad_sync`` keeps the coalescing
manager's handle (its own flag is False), so the fp32 function's handle, whose ``wait()``
sums and writes the shard, is never waited on. Any process that builds two DDP models
(teacher/student, actor/critic, tests) is hit, silently.

Here, on 2 ranks: a DDP with ``reduce_scatter_with_fp32_accumulation=True`` is built (never
even run), then a plain DDP (distributed optimizer, ``overlap_grad_reduce``) reduces
rank-specific gradients (small integers: the mean is exact in bf16) for two iterations.

Needs only megatron-core and torch; 2 gloo processes (torch.multiprocessing). On a machine
without CUDA, Megatron's CUDA assumptions are redirected to the CPU by
``verify.candidates.megatron_core.redirect.cpu_redirects`` (gradverify); on a GPU node it is
not needed and not used (NCCL there).

    python examples/megatron_core/repro_fp32_rs_rebinds_global.py   # exit 1: bug, 0: fixed
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


def ddp(fp32_accumulation: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               use_cpu_initialization=True)
    return DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True,
        reduce_scatter_with_fp32_accumulation=fp32_accumulation), Weights())


def run(rank: int) -> bool:
    from megatron.core import parallel_state
    from megatron.core.distributed import param_and_grad_buffer

    parallel_state.initialize_model_parallel()

    def function() -> str:
        return param_and_grad_buffer.dist_reduce_scatter_func.__name__

    before = function()
    ddp(fp32_accumulation=True)  # built, never used
    plain = ddp(fp32_accumulation=False)
    if rank == 0:
        print(f"param_and_grad_buffer.dist_reduce_scatter_func: {before} before the fp32 DDP, "
              f"{function()} after it")
    (buffer,) = plain.buffers
    shard = buffer.grad_data.numel() // WORLD
    ok = True
    for iteration in range(2):
        plain.zero_grad_buffer()
        plain(rank_grad(rank, iteration)).backward()
        plain.finish_grad_sync()
        # The parameter sits at the start of the buffer (one param, one bucket).
        mean = (rank_grad(0, iteration).float() + rank_grad(1, iteration).float()) / 2
        lo, hi = rank * shard, min((rank + 1) * shard, NUMEL)
        assert lo < hi, "each rank's shard must hold part of the parameter"
        got = buffer.grad_data[lo:hi].float()
        same = torch.equal(got, mean[lo:hi])
        own = torch.equal(got, rank_grad(rank, iteration)[lo:hi].float() / 2)
        print(f"rank {rank} iteration {iteration}: expected its shard = the mean over ranks; "
              f"got {'the mean' if same else 'its OWN pre-scaled grads' if own else 'other values'}")
        ok = ok and same
    return ok


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
    print(f"fixed in {MEGATRON_CORE}: a DDP built after an fp32-accumulating one reduces its "
          "shard to the mean" if ok else "BUG: a DDP built after an fp32-accumulating one in "
          "the same process does not reduce (dist_reduce_scatter_func was rebound)")
    sys.exit(0 if ok else 1)

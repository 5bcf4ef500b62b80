"""torch DDP: with ``gradient_as_bucket_view=True`` and grads zeroed in place, the same grads
average to other bits from the second iteration on.

``Reducer::mark_variable_ready_dense`` (torch/csrc/distributed/c10d/reducer.cpp) averages a
grad that is not yet its bucket's view by multiplying it by ``1/W`` as it copies it into the
bucket (``at::mul_out`` with the wrapped double ``1 / div_factor_``: fp32(1/W) for fp32
grads), and a grad that already *is* the bucket view by dividing in place
(``bucket_view.div_(div_factor_)``). With ``gradient_as_bucket_view=True`` the grads become
bucket views after the first backward, so with ``zero_grad(set_to_none=False)`` every later
iteration takes the division; ``set_to_none=True`` (or ``gradient_as_bucket_view=False``)
keeps the multiplication. ``x * fp32(1/3)`` and ``x / 3`` round differently for many ``x``:
a memory option changes the numbers. Expected: the same grads, the same averaged bits.

Here, on 3 gloo ranks: one fp32 parameter, the same rank-specific grads in two iterations.

Needs only torch; 3 gloo processes (torch.multiprocessing).

    python examples/torch/repro_ddp_bucket_view_average.py   # exit 1: bug, 0: fixed
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

WORLD, NUMEL = 3, 96


class Weights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(NUMEL))

    def forward(self, coefficients):
        return (self.weight * coefficients).sum()  # weight.grad == coefficients


def averaged(rank: int, bucket_view: bool) -> list[torch.Tensor]:
    """The averaged grad of two iterations with the same rank-specific grads."""
    ddp = DistributedDataParallel(Weights(), gradient_as_bucket_view=bucket_view)
    grads = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    out = []
    for _ in range(2):
        ddp.zero_grad(set_to_none=False)
        ddp(grads).backward()
        out.append(ddp.module.weight.grad.clone())
    return out


def rank_main(rank: int, results) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", os.environ["REPRO_PORT"]
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        first, second = averaged(rank, bucket_view=True)
        control = averaged(rank, bucket_view=False)
        if rank == 0:
            differ = int((first != second).sum())
            print("expected: the same grads average to the same bits in both iterations")
            print(f"got (gradient_as_bucket_view=True, zero_grad(set_to_none=False), W={WORLD}): "
                  f"{differ} of {NUMEL} elements differ between iteration 1 and 2")
            print(f"control (gradient_as_bucket_view=False): "
                  f"{int((control[0] != control[1]).sum())} differ")
            print(f"iteration 1 equals iteration 1 without bucket views: {torch.equal(first, control[0])}")
            results.put(differ == 0)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["REPRO_PORT"] = str(s.getsockname()[1])
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(results,), nprocs=WORLD)
    ok = results.get()
    print("fixed" if ok else "BUG: with gradient_as_bucket_view and grads zeroed in place, DDP "
          "divides by W from the second iteration on instead of multiplying by fp32(1/W)")
    sys.exit(0 if ok else 1)

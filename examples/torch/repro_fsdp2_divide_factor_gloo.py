"""torch FSDP2: ``set_gradient_divide_factor`` on a gloo process group fails at the first backward.

``_get_gradient_divide_factors`` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)
turns a divide factor other than the world size, for an fp32 or bf16 reduce dtype, into
``ReduceOp.PREMUL_SUM(1 / factor)`` for the reduce-scatter; it forces a plain SUM (dividing
outside the collective) only for MTIA devices or when ``set_force_sum_reduction_for_comms(True)``
is set. gloo has no PREMUL_SUM: ``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo``.
``set_gradient_divide_factor(1.0)`` is FSDP2's way to sum the grads over the data-parallel
ranks instead of averaging them. Expected: the summed grads (as with the forced SUM), or a
refusal when the factor is set.

Here, on 2 gloo ranks: a Linear under ``fully_shard``, fp32, the factor 1.0, one backward.

Needs only torch; 2 gloo processes (torch.multiprocessing).

    python examples/torch/repro_fsdp2_divide_factor_gloo.py   # exit 1: bug, 0: fixed
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

WORLD = 2


def summed_grad(rank: int, force_sum: bool):
    """The local shard of the weight's grad summed over ranks, or the error the backward raised."""
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 6, bias=False), mesh=init_device_mesh("cpu", (WORLD,)))
    model.set_gradient_divide_factor(1.0)
    if force_sum:
        model.set_force_sum_reduction_for_comms(True)
    x = torch.full((1, 4), float(rank + 1))
    try:
        model(x).sum().backward()
    except RuntimeError as error:
        return error
    return model.weight.grad.to_local()


def rank_main(rank: int, results) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", os.environ["REPRO_PORT"]
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        got = summed_grad(rank, force_sum=False)
        control = summed_grad(rank, force_sum=True)
        want = torch.full((6 // WORLD, 4), 1.0 + 2.0)  # d/dW of sum(W x) is x; summed: 1 + 2
        if rank == 0:
            print("expected: the grads summed over the 2 ranks (every element 3.0)")
            print(f"got:      {got!r}" if isinstance(got, Exception) else f"got:      {got.tolist()}")
            print(f"control (set_force_sum_reduction_for_comms(True)): "
                  f"{'the sum' if torch.equal(control, want) else control}")
        results.put(not isinstance(got, Exception) and torch.equal(got, want))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["REPRO_PORT"] = str(s.getsockname()[1])
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(results,), nprocs=WORLD)
    ok = all(results.get() for _ in range(WORLD))
    print("fixed" if ok else "BUG: FSDP2's set_gradient_divide_factor makes its reduce-scatter use "
          "ReduceOp.PREMUL_SUM, which gloo does not have")
    sys.exit(0 if ok else 1)

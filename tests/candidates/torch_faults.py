"""Deliberately broken copies of the torch candidates, to prove their checks can fail.

Test-only: torch itself is never modified. Each plant goes through torch's own extension
points inside the rank: FSDP2's ``FSDPModule.set_custom_reduce_scatter`` (a reduce-scatter
that applies the divide factor a second time) and DDP's ``register_comm_hook`` (a copy of
torch's ``_compress_hook`` that skips the division by the world size). Module-level, so the
spawned ranks can unpickle them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from verify.candidates.torch_ddp.candidate import TorchDDPCandidate
from verify.candidates.torch_ddp.grad_reduction import TorchDDPGradReduction
from verify.candidates.torch_fsdp2.candidate import TorchFSDP2Candidate
from verify.candidates.torch_fsdp2.grad_reduction import FSDP2Step, TorchFSDP2GradReduction


class DividesTwice(DefaultReduceScatter):
    """FSDP2's default reduce-scatter, then its output divided by the world size once more:
    the divide factor applied twice."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        if work is not None and async_op:
            work.wait()
        output_tensor.div_(group.size())
        return None if async_op else work


class DividingTwiceStep(FSDP2Step):
    """FSDP2's sharded module with :class:`DividesTwice` as its reduce-scatter."""

    def _module(self, group):
        fresh = id(group) not in self._built
        module = super()._module(group)
        if fresh:
            module.set_custom_reduce_scatter(DividesTwice())
        return module


class DividingTwiceReduction(TorchFSDP2GradReduction):
    step_class = DividingTwiceStep


@dataclass(frozen=True)
class FSDP2DividingTwice(TorchFSDP2Candidate):
    """torch-fsdp2 whose reduce-scatter applies its divide factor twice."""

    def grad_reduction(self) -> TorchFSDP2GradReduction:
        return DividingTwiceReduction()


def _compress_hook_without_division(dtype, process_group, bucket):
    """torch's ``default_hooks._compress_hook`` with ``.div_(world_size)`` left out."""
    group_to_use = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket[0] if isinstance(bucket, tuple) else bucket.buffer()
    compressed_tensor = buffer.to(dtype)

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(compressed_tensor, group=group_to_use, async_op=True).get_future().then(decompress)


def fp16_hook_without_division(process_group, bucket):
    return _compress_hook_without_division(torch.float16, process_group, bucket)


def bf16_hook_without_division(process_group, bucket):
    return _compress_hook_without_division(torch.bfloat16, process_group, bucket)


class UndividedHooks(TorchDDPGradReduction):
    hooks = {torch.float16: fp16_hook_without_division, torch.bfloat16: bf16_hook_without_division}


@dataclass(frozen=True)
class DDPHookWithoutDivision(TorchDDPCandidate):
    """torch-ddp whose compress hooks skip the division by the world size."""

    def grad_reduction(self) -> TorchDDPGradReduction:
        return UndividedHooks()

"""fastgrad's DP gradient reduction behind :mod:`verify.candidates.interfaces`.

The collectives are ``fastgrad.reduce_scatter.reduce_scatter_with_fp32_accumulation`` (every
op, with or without a caller's scratch) and its local step ``reduce_shards_fp32``; a bucket is
reduced by ``fastgrad.buffer.ParamAndGradBuffer``'s own bucket (``fastgrad.bucket.Bucket``:
the averaging plan of ``fastgrad.averaging.grad_averaging``, then its reduce strategy).
fastgrad averages as production does by default (a ``1/W`` pre-scale in the grad dtype, which
it folds into the fp32-accumulating reduce-scatter with the same bits), and its plain
collectives are torch.distributed's: both are documented in :meth:`FastgradGradReduction.behaviour`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fastgrad.buffer import ParamAndGradBuffer
from fastgrad.reduce_scatter import reduce_scatter_with_fp32_accumulation, reduce_shards_fp32
from gradvocab import Averaging, DDPConfig
from verify.candidates.interfaces import (
    SUM,
    BucketReduction,
    Completion,
    GradReduction,
    LocalReduction,
    ReduceScatter,
    ReductionConfig,
    ScratchReduceScatter,
)


@dataclass(frozen=True)
class FastgradReduceScatter(ReduceScatter):
    """``reduce_scatter_with_fp32_accumulation`` (SUM and AVG: fp32 sum / W, one rounding)."""

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *,  # noqa: A002
                 group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType,
                 async_op: bool = False) -> Completion | None:
        return reduce_scatter_with_fp32_accumulation(output, input, group=group, op=op,
                                                     async_op=async_op)


@dataclass(frozen=True)
class FastgradScratchReduceScatter(ScratchReduceScatter):
    """``reduce_scatter_with_fp32_accumulation`` with its ``scratch=`` argument."""

    def __call__(self, output: torch.Tensor, input: torch.Tensor, scratch: torch.Tensor, *,  # noqa: A002
                 group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType,
                 async_op: bool = False) -> Completion | None:
        return reduce_scatter_with_fp32_accumulation(output, input, group=group, op=op,
                                                     async_op=async_op, scratch=scratch)


@dataclass(frozen=True)
class FastgradLocalReduction(LocalReduction):
    """``reduce_shards_fp32``: a rank-order fp32 loop on the CPU, the Triton kernel on CUDA."""

    def __call__(self, shards: torch.Tensor, output: torch.Tensor, *,
                 op: dist.ReduceOp.RedOpType) -> None:
        reduce_shards_fp32(shards, output, op=Averaging.from_reduce_op(op))


@dataclass(frozen=True)
class FastgradBucketReduction(BucketReduction):
    """A ``ParamAndGradBuffer`` over one parameter of the bucket's size, per (group, dtype,
    size), and its bucket's ``start_grad_sync`` / ``finish_grad_sync``."""

    config: ReductionConfig
    _buffers: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _buffer(self, grads: torch.Tensor, group: dist.ProcessGroup | None) -> ParamAndGradBuffer:
        key = (id(group), grads.dtype, grads.numel())
        if key not in self._buffers:
            param = torch.nn.Parameter(torch.zeros(grads.numel(), dtype=grads.dtype))
            config = DDPConfig(
                use_distributed_optimizer=self.config.use_distributed_optimizer,
                overlap_grad_reduce=self.config.overlap_grad_reduce,
                reduce_scatter_with_fp32_accumulation=self.config.reduce_scatter_with_fp32_accumulation,
                average_in_collective=self.config.megatron_flags().average_in_collective)
            self._buffers[key] = (param, ParamAndGradBuffer([param], config=config, dp_group=group,
                                                            averaging=self.config.averaging))
        return self._buffers[key][1]

    def __call__(self, grads: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
        buffer = self._buffer(grads, group)
        (bucket,) = buffer.buckets
        if bucket.numel != grads.numel():
            raise ValueError(f"fastgrad padded the bucket to {bucket.numel} elements "
                             f"(grads: {grads.numel()}); sizes must be multiples of 128 * W")
        bucket.grad_data.copy_(grads)
        bucket.start_grad_sync()
        bucket.finish_grad_sync()
        held = bucket.local_grad_shard if self.config.use_distributed_optimizer else bucket.grad_data
        return held.clone()


@dataclass(frozen=True)
class FastgradGradReduction(GradReduction):
    """fastgrad's reduction (its ``with`` scope is empty); every op, every form."""

    def reduce_scatter(self, op: dist.ReduceOp.RedOpType = SUM) -> ReduceScatter:
        Averaging.from_reduce_op(op)  # refuses an op other than SUM and AVG
        return FastgradReduceScatter()

    def scratch_reduce_scatter(self, op: dist.ReduceOp.RedOpType = SUM) -> ScratchReduceScatter:
        Averaging.from_reduce_op(op)  # refuses an op other than SUM and AVG
        return FastgradScratchReduceScatter()

    def local_reduction(self, op: dist.ReduceOp.RedOpType = SUM) -> LocalReduction:
        Averaging.from_reduce_op(op)  # refuses an op other than SUM and AVG
        return FastgradLocalReduction()

    def bucket_reduction(self, config: ReductionConfig) -> BucketReduction:
        return FastgradBucketReduction(config)



__all__ = ["FastgradBucketReduction", "FastgradGradReduction",
           "FastgradLocalReduction", "FastgradReduceScatter", "FastgradScratchReduceScatter"]

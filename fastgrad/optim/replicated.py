"""The optimizer without the distributed optimizer: every rank steps every param.

Without ``--use-distributed-optimizer`` Megatron-Core all-reduces the grads
(every DP rank holds the whole reduced buffer) and its optimizer
(``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer``) keeps fp32 master
copies of *all* params on every rank; the grad norm and the found-inf flag
are summed over the model-parallel group only (the DP ranks hold the same
grads), and the updated masters are copied into the model params (no
all-gather). :class:`ReplicatedOptimizer` is that optimizer: the same step as
:class:`~fastgrad.optim.DistributedOptimizer` (same ``refgrad.optim`` order,
same exact norm, clipping and loss scaling), over whole buckets.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fastgrad.bucket import ShardPiece
from fastgrad.buffer import Bucket
from fastgrad.mxfp8_sharing import MXFP8ParamGradBuffer
from fastgrad.optim.distributed import DistributedOptimizer


class ReplicatedOptimizer(DistributedOptimizer):
    """AdamW or SGD over every param of an all-reduce DDP (``use_distributed_optimizer=False``).

    Arguments as :class:`DistributedOptimizer`; ``ddp`` is a DDP wrapper or
    ``ModelChunks`` whose config has ``use_distributed_optimizer=False``. The
    norm is every rank's own (identical) full-grad norm, summed over
    ``model_parallel_group`` only.
    """

    supports_mxfp8 = False  # MXFP8 params need the distributed optimizer's param all-gather

    def _check_buffer_kind(self, ddp: Any) -> None:
        if isinstance(ddp, MXFP8ParamGradBuffer):
            raise TypeError("ReplicatedOptimizer takes a DistributedDataParallel or ModelChunks; "
                            "MXFP8 params need DistributedOptimizer's param all-gather")
        if ddp.config.use_distributed_optimizer:
            raise ValueError("ReplicatedOptimizer needs DDPConfig.use_distributed_optimizer=False "
                             "(all-reduced grads); use DistributedOptimizer for reduce-scattered shards")

    def _owned_pieces(self, bucket: Bucket) -> list[ShardPiece]:
        """Every param element of the bucket: this rank updates them all."""
        pieces = []
        for p in bucket.params:
            lo, hi = bucket.group.param_range(p)
            pieces.append(ShardPiece(param=p, registration_index=bucket._registration_index[p],
                                     param_offset=(0, hi - lo), buffer_range=(lo, hi)))
        pieces.sort(key=lambda piece: piece.buffer_range)
        return pieces

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        # The DP ranks hold identical all-reduced grads: sum over the model-parallel group only.
        if self.model_parallel_group is not None:
            dist.all_reduce(tensor, group=self.model_parallel_group)

    def _publish_bucket(self, shard: Any, cast: bool = True) -> None:
        """Round each master into its model param (the param's dtype); nothing to gather.
        ``cast=False``: the fused update already wrote them (the params are views of the
        bucket's param buffer)."""
        if not cast:
            return
        with torch.no_grad():
            for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
                param = piece.param
                param.view(-1).copy_(shard.master[lo:hi].to(param.dtype))

    def _gather_full(self, shard: Any, compact: torch.Tensor) -> torch.Tensor:
        """The bucket-sized fp32 tensor of ``compact`` (every rank holds all of it)."""
        bucket = shard.bucket
        full = torch.zeros(bucket.numel, dtype=torch.float32, device=compact.device)
        for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
            a, b = piece.buffer_range
            full[a - bucket.start : b - bucket.start] = compact[lo:hi]
        return full

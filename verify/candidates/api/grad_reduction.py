"""The data-parallel gradient reduction a candidate performs, as typed collectives.

As FSDP2's ``_fsdp_api`` (``AllGather``, ``ReduceScatter``), each collective is a small class
with one typed ``__call__``, not a callable with flags: a candidate hands the check the
reduce-scatter it runs on a bucket, and the check drives it on real gloo ranks with
rank-specific inputs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist


class ReduceScatter(ABC):
    """``output`` (this rank's shard) = the reduction over the group of ``input`` (the full
    bucket), shard ``rank`` of it. ``op`` is ``dist.ReduceOp.SUM`` or ``dist.ReduceOp.AVG``."""

    @abstractmethod
    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup,
                 op: dist.ReduceOp.RedOpType, async_op: bool = False) -> dist.Work | None:
        """Launch (``async_op``) or run the reduce-scatter."""


@runtime_checkable
class GradReduction(Protocol):
    """The candidate's DP gradient reduction: the reduce-scatter its buckets run (with fp32
    accumulation where the candidate has it) and the local fp32 reduction it is built on."""

    def reduce_scatter(self) -> ReduceScatter:
        """The reduce-scatter the candidate's buckets run under the distributed optimizer."""
        ...

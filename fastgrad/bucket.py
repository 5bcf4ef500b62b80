"""One bucket of a :class:`fastgrad.buffer.ParamAndGradBuffer` and how it is reduced.

``Bucket``
    ``.bucket_id`` (within its group), ``.group``, ``.params`` (layout order =
    reverse registration), ``.param_to_index`` ({param: (start, end)} relative
    to the bucket start, keyed by the parameter object, as production),
    ``.start``/``.end`` (in the group buffer), ``.numel``, ``.numel_unpadded``,
    ``.grad_data``, ``.param_data``, ``.parallel_dims``
    (:class:`gradvocab.ParallelDims`) with ``.dp_size``/``.dp_rank``/``.dp_group``,
    ``.averaging`` (:class:`fastgrad.averaging.GradAveraging`), ``.shard_numel``,
    ``.shard_range(rank)``, ``.local_shard_range``, ``.grad_shard(rank)``,
    ``.param_shard(rank)``, ``.local_grad_shard``, ``.local_param_shard``,
    ``.shard_pieces(rank)``, ``.start_grad_sync()``, ``.finish_grad_sync()``,
    ``.reduce_in_flight`` (the one record of "this bucket's reduce was
    launched"), ``.strategy``.
``select_reduce_strategy(config, *, distributed)`` -> ``GradReduceStrategy``
    ``LocalOnlyStrategy`` (dp_size 1 without torch.distributed: nothing to
    send), ``AllReduceStrategy`` (no distributed optimizer: every rank gets the
    whole reduced bucket), ``ReduceScatterStrategy`` (distributed optimizer:
    rank r gets its reduced shard r written in place into ``grad_data``; the
    rest of the bucket keeps the local, unreduced grads, as in production).
    The reduce-scatter is parameterised by its collective:
    ``fastgrad.comm.reduce_scatter_into`` (wire dtype = grad dtype) or, with
    ``reduce_scatter_with_fp32_accumulation``,
    ``fastgrad.reduce_scatter.reduce_scatter_with_fp32_accumulation`` (16-bit
    all-to-all + fp32 local sum).

Averaging is the bucket's :class:`fastgrad.averaging.GradAveraging` plan, decided once by
``fastgrad.averaging.grad_averaging``: the collective's op (SUM or AVG) and where the
``1/dp`` pre-scale, if any, is applied (here in ``grad_data`` before the launch, or inside
the fp32-accumulating reduce-scatter).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fastgrad.averaging import GradAveraging, PrescaleSite
from fastgrad.comm import reduce_scatter_into
from fastgrad.data_parallel_view import DataParallelView
from fastgrad.reduce_scatter import reduce_scatter_with_fp32_accumulation
from gradvocab import DDPConfig, LifecycleError, ParallelDims


class BucketOwner(Protocol):
    """What a bucket reads from the buffer group it is a slice of
    (``fastgrad.buffer_group.BufferGroup``)."""

    key: tuple[torch.dtype, torch.dtype]
    grad_data: torch.Tensor
    param_data: torch.Tensor | None

    def param_range(self, param: Any) -> tuple[int, int]: ...


# --------------------------------------------------------------------------- strategies


class GradReduceStrategy(abc.ABC):
    """How one bucket's gradients are reduced across the data-parallel group."""

    name: str = "abstract"

    @abc.abstractmethod
    def launch(self, bucket: Bucket) -> Any:
        """Start the reduction asynchronously (op and in-collective pre-scale from
        ``bucket.averaging``); return a handle with ``wait()`` or None."""


@dataclass(frozen=True)
class LocalOnlyStrategy(GradReduceStrategy):
    """dp_size 1 without torch.distributed: a rank's sum/average over itself is itself."""

    name: str = "local-only"

    def launch(self, bucket: Bucket) -> None:
        return None


@dataclass(frozen=True)
class AllReduceStrategy(GradReduceStrategy):
    """``dist.all_reduce`` of the whole bucket (used without the distributed optimizer)."""

    name: str = "all-reduce"

    def launch(self, bucket: Bucket) -> Any:
        return dist.all_reduce(bucket.grad_data, op=bucket.averaging.factors.op, group=bucket.dp_group,
                               async_op=True)


@dataclass(frozen=True)
class ReduceScatterStrategy(GradReduceStrategy):
    """Reduce-scatter of the bucket into this rank's shard view, through ``collective``.

    ``collective(local_shard, full, *, op, group, async_op, scratch=None)`` has the
    signature of ``fastgrad.comm.reduce_scatter_into``; the fp32-accumulating one also
    takes ``prescale=`` (the plan's :attr:`PrescaleSite.COLLECTIVE` factor). ``scratch``
    is the bucket's :meth:`Bucket.collective_scratch` (gloo only).
    """

    collective: Callable[..., Any] = reduce_scatter_into
    name: str = "reduce-scatter"

    def launch(self, bucket: Bucket) -> Any:
        plan = bucket.averaging
        extra = {}
        if plan.site is PrescaleSite.COLLECTIVE:
            extra["prescale"] = plan.factors.pre_scale
        scratch = bucket.collective_scratch()
        if scratch is not None:
            extra["scratch"] = scratch
        return self.collective(
            bucket.local_grad_shard,
            bucket.grad_data,
            op=plan.factors.op,
            group=bucket.dp_group,
            async_op=True,
            **extra,
        )


def select_reduce_strategy(config: DDPConfig, *, distributed: bool) -> GradReduceStrategy:
    """The reduction a bucket uses under ``config``; ``distributed`` = a process group exists."""
    if not isinstance(config, DDPConfig):
        raise TypeError(f"config must be a DDPConfig, got {type(config).__name__}")
    if not distributed:
        return LocalOnlyStrategy()
    if not config.use_distributed_optimizer:
        return AllReduceStrategy()
    if config.reduce_scatter_with_fp32_accumulation:
        return ReduceScatterStrategy(
            collective=reduce_scatter_with_fp32_accumulation,
            name="reduce-scatter-fp32-accumulation",
        )
    return ReduceScatterStrategy()


# --------------------------------------------------------------------------- buckets


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls inside one rank's shard of a bucket.

    ``param_offset``: (lo, hi) into the flattened parameter; ``buffer_range``:
    (start, end) of the same elements in the group buffer.
    """

    param: Any
    registration_index: int
    param_offset: tuple[int, int]
    buffer_range: tuple[int, int]


class Bucket(DataParallelView):
    """A contiguous slice of a group's buffers, reduced as one collective.

    ``params`` may be tensors or ``fastgrad.mxfp8_sharing.MXFP8Parameter``
    objects (the buffer's MXFP8 mode); both are keyed by identity.
    """

    def __init__(
        self,
        group: BucketOwner,
        bucket_id: int,
        start: int,
        end: int,
        numel_unpadded: int,
        params: list[Any],
        *,
        parallel_dims: ParallelDims,
        strategy: GradReduceStrategy,
        registration_index: Mapping[Any, int],
        averaging: GradAveraging,
    ) -> None:
        self.group = group
        self.bucket_id = bucket_id
        self.start = start
        self.end = end
        self.numel = end - start
        self.numel_unpadded = numel_unpadded
        self.params = params
        self.parallel_dims = parallel_dims
        self.strategy = strategy
        self.averaging = averaging
        self._registration_index = registration_index
        self.param_to_index: dict[Any, tuple[int, int]] = {}
        for p in params:
            p_start, p_end = group.param_range(p)
            self.param_to_index[p] = (p_start - start, p_end - start)
        self.grad_data = group.grad_data[start:end]
        self.param_data = None if group.param_data is None else group.param_data[start:end]
        self._handle: Any = None
        self._in_flight = False
        self._scratch: torch.Tensor | None = None
        # Completed reductions since construction: consumers (the distributed
        # optimizer) compare it with the count they saw to know the shard is fresh.
        self.grad_sync_count = 0

    # -- shards
    @property
    def shard_numel(self) -> int:
        """Elements per rank; the bucket must divide evenly (distributed optimizer)."""
        if self.numel % self.dp_size != 0:
            raise ValueError(
                f"bucket {self.bucket_id} has {self.numel} elements, not divisible by "
                f"dp_size={self.dp_size}; shards exist only with use_distributed_optimizer"
            )
        return self.numel // self.dp_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``(start, end)`` of rank ``rank``'s shard in the group buffer."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.dp_size:
            raise ValueError(f"rank must be an int in [0, {self.dp_size}), got {rank!r}")
        size = self.shard_numel
        return self.start + rank * size, self.start + (rank + 1) * size

    @property
    def local_shard_range(self) -> tuple[int, int]:
        """``(start, end)`` of this rank's shard in the group buffer."""
        return self.shard_range(self.dp_rank)

    def grad_shard(self, rank: int) -> torch.Tensor:
        """View of rank ``rank``'s shard of this bucket's grads."""
        lo, hi = self.shard_range(rank)
        return self.group.grad_data[lo:hi]

    def param_shard(self, rank: int) -> torch.Tensor:
        """View of rank ``rank``'s shard of this bucket's params (distributed optimizer only)."""
        if self.group.param_data is None:
            raise ValueError("param shards exist only with use_distributed_optimizer=True")
        lo, hi = self.shard_range(rank)
        return self.group.param_data[lo:hi]

    @property
    def local_grad_shard(self) -> torch.Tensor:
        return self.grad_shard(self.dp_rank)

    @property
    def local_param_shard(self) -> torch.Tensor:
        return self.param_shard(self.dp_rank)

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """The parameter elements inside rank ``rank``'s shard; empty if it is all padding."""
        lo, hi = self.shard_range(rank)
        pieces = []
        for p in self.params:
            p_start, p_end = self.group.param_range(p)
            a, b = max(lo, p_start), min(hi, p_end)
            if a < b:
                pieces.append(
                    ShardPiece(
                        param=p,
                        registration_index=self._registration_index[p],
                        param_offset=(a - p_start, b - p_start),
                        buffer_range=(a, b),
                    )
                )
        pieces.sort(key=lambda piece: piece.buffer_range)
        return pieces

    def collective_scratch(self) -> torch.Tensor | None:
        """A buffer like ``grad_data`` that the reduce-scatter may use as its working copy,
        kept for the bucket's life; only on gloo (CPU), else None.

        Both reduce-scatters need one: gloo's clones the bucket on every call (see
        :mod:`fastgrad.comm`), the fp32-accumulating one receives its all-to-all in it.
        gloo's CPU tensors come from malloc, so a fresh bucket-sized copy per step costs
        page faults; GPU backends draw it from the caching allocator and get None here.
        Memory: one more ``grad_data``-sized buffer per bucket, held instead of allocated
        at each reduction (the peak is the same).
        """
        if self._scratch is None and self.grad_data.device.type == "cpu" and self.distributed \
                and dist.get_backend(self.dp_group) == "gloo":
            self._scratch = torch.empty_like(self.grad_data)
        return self._scratch

    # -- reduction lifecycle
    @property
    def reduce_in_flight(self) -> bool:
        """True between ``start_grad_sync()`` and ``finish_grad_sync()``."""
        return self._in_flight

    def start_grad_sync(self) -> None:
        """Launch this bucket's reduction (asynchronous); pair with ``finish_grad_sync``."""
        if self._in_flight:
            raise LifecycleError(
                f"start_grad_sync on bucket {self.bucket_id} of group {self.group.key}: "
                "a reduction is already in flight (call finish_grad_sync first)"
            )
        if self.dp_size > 1 and not self.distributed:
            raise LifecycleError(
                f"cannot reduce across dp_size={self.dp_size} ranks: torch.distributed "
                "is not initialized (the buffer was built for layout/shard inspection only)"
            )
        prescale = self.averaging.prescale_at(PrescaleSite.BUCKET)
        if prescale is not None:
            # Production pre-scales in the grad dtype before a SUM collective.
            self.grad_data.mul_(prescale)
        self._handle = self.strategy.launch(self)
        self._in_flight = True

    def finish_grad_sync(self) -> None:
        """Wait for the reduction started by ``start_grad_sync``."""
        if not self._in_flight:
            raise LifecycleError(
                f"finish_grad_sync on bucket {self.bucket_id} of group {self.group.key}: "
                "no reduction is in flight (call start_grad_sync first)"
            )
        handle, self._handle = self._handle, None
        try:
            if handle is not None:
                handle.wait()
        finally:
            self._in_flight = False
        self.grad_sync_count += 1

    def __repr__(self) -> str:
        return (
            f"Bucket(id={self.bucket_id}, group={self.group.key}, range=[{self.start}, "
            f"{self.end}), numel_unpadded={self.numel_unpadded}, params={len(self.params)})"
        )

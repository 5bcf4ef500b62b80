"""Contiguous, padded parameter/gradient buffers split into buckets (REFERENCE_NOTES section 1).

API summary
-----------
``ParamAndGradBuffer(params, *, config, dp_group=None, dp_size=None, device=None,
gradient_scaling_factor=1.0)``
    ``params``: parameters in registration order (a param with attribute
    ``shared_embedding=True`` gets its own bucket under the distributed optimizer).
    ``.params``, ``.config``, ``.dp_size``, ``.dp_rank``, ``.dp_group``
    ``.groups``: ``list[BufferGroup]``, one per (param dtype, grad dtype), in
    first-seen order; ``.buckets``: every bucket of every group.
    ``.group_of(param)``, ``.bucket_of(param)``, ``.registration_index(param)``
    ``.zero_grad()``; ``.start_grad_sync()`` / ``.finish_grad_sync()`` (all
    buckets); ``.reduce_in_flight``
    ``.grad_norm_sq()``, ``.local_shard_grad_norm_sq(rank=None)``,
    ``.checkpoint_state()``, ``.shard_checkpoint_state(rank=None)``,
    ``.padding_is_zero()``: helpers that never look at padding.
``BufferGroup``
    ``.param_dtype``, ``.grad_dtype``, ``.params`` (registration order),
    ``.layout`` (``fastgrad.layout.BufferLayout``), ``.grad_data``,
    ``.param_data`` (distributed optimizer only, else None), ``.buckets``,
    ``.numel``, ``.numel_unpadded``, ``.param_range(param)``, ``.padding_mask()``
``Bucket``
    ``.bucket_id`` (within its group), ``.group``, ``.params`` (layout order =
    reverse registration), ``.param_to_index`` ({param: (start, end)} relative
    to the bucket start, as production), ``.start``/``.end`` (in the group
    buffer), ``.numel``, ``.numel_unpadded``, ``.grad_data``, ``.param_data``,
    ``.shard_numel``, ``.shard_range(rank)``, ``.grad_shard(rank)``,
    ``.param_shard(rank)``, ``.local_grad_shard``, ``.local_param_shard``,
    ``.shard_pieces(rank)``, ``.start_grad_sync()``, ``.finish_grad_sync()``,
    ``.reduce_in_flight``, ``.strategy``
``select_reduce_strategy(config, *, distributed)`` -> ``GradReduceStrategy``
    ``strategy.launch(bucket)`` reads only ``bucket.grad_data``,
    ``bucket.local_grad_shard`` and ``bucket.dp_group``, so other bucket types
    (e.g. fastgrad.mxfp8_sharing) can reuse the strategies.
``aligned_zeros(numel, dtype, device)``: a zero buffer 64-element aligned in memory.

Reduction
---------
Each bucket reduces through a strategy object chosen once from the config:
``AllReduceStrategy`` (no distributed optimizer: every rank gets the whole
reduced bucket), ``ReduceScatterStrategy`` (distributed optimizer: rank r gets
its reduced shard r, written in place into ``grad_data``; the rest of the
bucket keeps the local, unreduced grads, as in production),
``Fp32AccumulationReduceScatterStrategy`` (``reduce_scatter_with_fp32_accumulation``:
16-bit all-to-all + fp32 local sum, from ``fastgrad.reduce_scatter``), and
``LocalOnlyStrategy`` (dp_size 1 without torch.distributed: nothing to send).

Averaging: with ``average_in_collective`` the collective uses
``ReduceOp.AVG`` (torch 2.13's gloo and NCCL both support it; NCCL implements
float AVG by pre-multiplying by 1/dp, gloo sums then divides). Otherwise the
collective is a SUM and ``gradient_scaling_factor`` (default 1.0) is applied
to the bucket in the grad dtype before launching, which is what production's
DDP does with ``1/dp`` -- exact only for power-of-two dp.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fastgrad.comm import reduce_scatter_into
from fastgrad.config import DDPConfig
from fastgrad.errors import LifecycleError
from fastgrad.layout import PARAM_START_ALIGNMENT, BufferLayout, compute_layout

ALIGNMENT_ELEMENTS = PARAM_START_ALIGNMENT  # storage addresses of param views: 64 elements


# --------------------------------------------------------------------------- strategies


class GradReduceStrategy(abc.ABC):
    """How one bucket's gradients are reduced across the data-parallel group."""

    name: str = "abstract"

    @abc.abstractmethod
    def launch(self, bucket: Bucket) -> Any:
        """Start the reduction asynchronously; return a handle with ``wait()`` or None."""


def _reduce_op(config: DDPConfig) -> Any:
    return dist.ReduceOp.AVG if config.average_in_collective else dist.ReduceOp.SUM


@dataclass(frozen=True)
class LocalOnlyStrategy(GradReduceStrategy):
    """dp_size 1 without torch.distributed: a rank's sum/average over itself is itself."""

    name: str = "local-only"

    def launch(self, bucket: Bucket) -> None:
        return None


@dataclass(frozen=True)
class AllReduceStrategy(GradReduceStrategy):
    """``dist.all_reduce`` of the whole bucket (used without the distributed optimizer)."""

    op: Any = dist.ReduceOp.SUM
    name: str = "all-reduce"

    def launch(self, bucket: Bucket) -> Any:
        return dist.all_reduce(bucket.grad_data, op=self.op, group=bucket.dp_group, async_op=True)


@dataclass(frozen=True)
class ReduceScatterStrategy(GradReduceStrategy):
    """Reduce-scatter of the bucket into this rank's shard view (wire dtype = grad dtype)."""

    op: Any = dist.ReduceOp.SUM
    name: str = "reduce-scatter"

    def launch(self, bucket: Bucket) -> Any:
        return reduce_scatter_into(
            bucket.local_grad_shard,
            bucket.grad_data,
            op=self.op,
            group=bucket.dp_group,
            async_op=True,
        )


@dataclass(frozen=True)
class Fp32AccumulationReduceScatterStrategy(GradReduceStrategy):
    """16-bit all-to-all, fp32 local accumulation (``fastgrad.reduce_scatter``)."""

    op: Any = dist.ReduceOp.SUM
    name: str = "reduce-scatter-fp32-accumulation"

    def launch(self, bucket: Bucket) -> Any:
        # Imported here: fastgrad.reduce_scatter is optional for plain reductions.
        from fastgrad.reduce_scatter import reduce_scatter_with_fp32_accumulation

        return reduce_scatter_with_fp32_accumulation(
            bucket.local_grad_shard,
            bucket.grad_data,
            group=bucket.dp_group,
            async_op=True,
            op=self.op,
        )


def select_reduce_strategy(config: DDPConfig, *, distributed: bool) -> GradReduceStrategy:
    """The reduction a bucket uses under ``config``; ``distributed`` = a process group exists."""
    if not isinstance(config, DDPConfig):
        raise TypeError(f"config must be a DDPConfig, got {type(config).__name__}")
    if not distributed:
        return LocalOnlyStrategy()
    op = _reduce_op(config)
    if not config.use_distributed_optimizer:
        return AllReduceStrategy(op=op)
    if config.reduce_scatter_with_fp32_accumulation:
        return Fp32AccumulationReduceScatterStrategy(op=op)
    return ReduceScatterStrategy(op=op)


# --------------------------------------------------------------------------- buckets


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls inside one rank's shard of a bucket.

    ``param_offset``: (lo, hi) into the flattened parameter; ``buffer_range``:
    (start, end) of the same elements in the group buffer.
    """

    param: torch.Tensor
    registration_index: int
    param_offset: tuple[int, int]
    buffer_range: tuple[int, int]


class Bucket:
    """A contiguous slice of a group's buffers, reduced as one collective."""

    def __init__(
        self,
        group: BufferGroup,
        bucket_id: int,
        start: int,
        end: int,
        numel_unpadded: int,
        params: list[torch.Tensor],
    ) -> None:
        self.group = group
        self.bucket_id = bucket_id
        self.start = start
        self.end = end
        self.numel = end - start
        self.numel_unpadded = numel_unpadded
        self.params = params
        self.param_to_index: dict[torch.Tensor, tuple[int, int]] = {}
        for p in params:
            p_start, p_end = group.param_range(p)
            self.param_to_index[p] = (p_start - start, p_end - start)
        self.grad_data = group.grad_data[start:end]
        self.param_data = None if group.param_data is None else group.param_data[start:end]
        self._handle: Any = None
        self._in_flight = False

    # -- identity / process group
    @property
    def dp_size(self) -> int:
        return self.group.owner.dp_size

    @property
    def dp_rank(self) -> int:
        return self.group.owner.dp_rank

    @property
    def dp_group(self) -> Any:
        return self.group.owner.dp_group

    @property
    def strategy(self) -> GradReduceStrategy:
        return self.group.owner.strategy

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
                        registration_index=self.group.owner.registration_index(p),
                        param_offset=(a - p_start, b - p_start),
                        buffer_range=(a, b),
                    )
                )
        pieces.sort(key=lambda piece: piece.buffer_range)
        return pieces

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
        owner = self.group.owner
        if owner.dp_size > 1 and not owner.distributed:
            raise LifecycleError(
                f"cannot reduce across dp_size={owner.dp_size} ranks: torch.distributed "
                "is not initialized (the buffer was built for layout/shard inspection only)"
            )
        if owner.gradient_scaling_factor != 1.0:
            # Production pre-scales in the grad dtype before a SUM collective.
            self.grad_data.mul_(owner.gradient_scaling_factor)
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

    def __repr__(self) -> str:
        return (
            f"Bucket(id={self.bucket_id}, group={self.group.key}, range=[{self.start}, "
            f"{self.end}), numel_unpadded={self.numel_unpadded}, params={len(self.params)})"
        )


# --------------------------------------------------------------------------- groups


def aligned_zeros(
    numel: int,
    dtype: torch.dtype,
    device: torch.device | str,
    allocate: Callable[..., torch.Tensor] = torch.zeros,
) -> torch.Tensor:
    """Zeros of ``numel`` elements whose first element is 64-element aligned in memory.

    Over-allocates by 64 elements and offsets the start, because an allocator
    only promises ``element_size``-byte alignment in general. ``allocate``
    (``torch.zeros``-like) exists so tests can hand in a misaligning allocator.
    """
    element_size = torch.empty((), dtype=dtype).element_size()
    alignment_bytes = ALIGNMENT_ELEMENTS * element_size
    storage = allocate(numel + ALIGNMENT_ELEMENTS, dtype=dtype, device=device)
    offset = (-storage.data_ptr() % alignment_bytes) // element_size
    view = storage[offset : offset + numel]
    if view.data_ptr() % alignment_bytes != 0:
        raise AssertionError(f"could not align a {dtype} buffer to {alignment_bytes} bytes")
    return view


class BufferGroup:
    """One (param dtype, grad dtype) group: contiguous buffers and their buckets."""

    def __init__(
        self,
        owner: ParamAndGradBuffer,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params: list[torch.Tensor],
        shared_embedding: list[int],
        bucket_size: int | None,
        device: torch.device,
    ) -> None:
        config = owner.config
        self.owner = owner
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.key = (param_dtype, grad_dtype)
        self.params = params
        self.layout: BufferLayout = compute_layout(
            [p.numel() for p in params],
            dp_size=owner.dp_size,
            bucket_size=bucket_size,
            use_distributed_optimizer=config.use_distributed_optimizer,
            pad_buckets_for_high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
            shared_embedding=shared_embedding,
        )
        self.numel = self.layout.numel
        self.numel_unpadded = self.layout.numel_unpadded
        self._range = {
            p: (int(s), int(e))
            for p, s, e in zip(params, self.layout.param_starts, self.layout.param_ends)
        }
        self.grad_data = aligned_zeros(self.numel, grad_dtype, device)
        self.param_data = (
            aligned_zeros(self.numel, param_dtype, device)
            if config.use_distributed_optimizer
            else None
        )
        for p in params:
            start, end = self._range[p]
            old_main_grad = getattr(p, "main_grad", None)
            main_grad = self.grad_data[start:end].view(p.shape)
            if old_main_grad is not None:
                main_grad.copy_(old_main_grad)
            p.main_grad = main_grad
            if self.param_data is not None:
                new_data = self.param_data[start:end].view(p.shape)
                new_data.copy_(p.data)
                p.data = new_data
        bucket_params: list[list[torch.Tensor]] = [[] for _ in self.layout.bucket_indices]
        for p, b in zip(reversed(params), reversed(self.layout.param_bucket_ids.tolist())):
            bucket_params[b].append(p)
        self.buckets = [
            Bucket(self, b, start, end, unpadded, bucket_params[b])
            for b, ((start, end), unpadded) in enumerate(
                zip(self.layout.bucket_indices, self.layout.per_bucket_numel_unpadded)
            )
        ]
        self._padding_mask: torch.Tensor | None = None
        self._verify()

    def param_range(self, param: torch.Tensor) -> tuple[int, int]:
        """``(start, end)`` of ``param`` in this group's buffers."""
        try:
            return self._range[param]
        except KeyError:
            raise ValueError("param is not in this buffer group") from None

    def padding_mask(self) -> torch.Tensor:
        """Bool tensor over the buffer: True where no parameter lives (padding)."""
        if self._padding_mask is None:
            mask = torch.ones(self.numel, dtype=torch.bool, device=self.grad_data.device)
            for start, end in self._range.values():
                mask[start:end] = False
            self._padding_mask = mask
        return self._padding_mask

    def _verify(self) -> None:
        """Production's invariants, re-checked on the real tensors."""
        config = self.owner.config
        dp = self.owner.dp_size
        for bucket in self.buckets:
            if config.use_distributed_optimizer and (bucket.start % dp or bucket.end % dp):
                raise AssertionError(
                    f"bucket {bucket.bucket_id} [{bucket.start}, {bucket.end}) is not "
                    f"divisible by dp_size={dp}"
                )
            limit = bucket.start + bucket.numel_unpadded
            if not bucket.start <= limit <= bucket.end:
                raise AssertionError(f"bucket {bucket.bucket_id}: unpadded size out of range")
            previous_end = bucket.start
            for p in sorted(bucket.params, key=lambda q: self._range[q][0]):
                start, end = self._range[p]
                if start < previous_end or end > limit:
                    raise AssertionError(
                        f"param [{start}, {end}) touches padding or another param in bucket "
                        f"{bucket.bucket_id} (unpadded region [{bucket.start}, {limit}))"
                    )
                previous_end = end
        if config.use_distributed_optimizer:
            for p in self.params:
                views = [p.main_grad, p.data]
                for view in views:
                    alignment_bytes = ALIGNMENT_ELEMENTS * view.element_size()
                    if view.data_ptr() % alignment_bytes != 0:
                        raise AssertionError(
                            f"param view at {view.data_ptr():#x} is not aligned to "
                            f"{ALIGNMENT_ELEMENTS} elements"
                        )

    def __repr__(self) -> str:
        return (
            f"BufferGroup(param_dtype={self.param_dtype}, grad_dtype={self.grad_dtype}, "
            f"params={len(self.params)}, numel={self.numel}, buckets={len(self.buckets)})"
        )


# --------------------------------------------------------------------------- buffer


def _resolve_process_group(dp_group: Any, dp_size: int | None) -> tuple[bool, int, int]:
    """(distributed, dp_size, dp_rank) from the group / explicit size."""
    if dp_size is not None and (isinstance(dp_size, bool) or not isinstance(dp_size, int)):
        raise TypeError(f"dp_size must be an int or None, got {type(dp_size).__name__}")
    if dp_size is not None and dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(dp_group)
        if dp_size is not None and dp_size != world:
            raise ValueError(
                f"dp_size={dp_size} disagrees with the process group's size {world}"
            )
        return True, world, dist.get_rank(dp_group)
    if dp_group is not None:
        raise ValueError("dp_group was given but torch.distributed is not initialized")
    return False, 1 if dp_size is None else dp_size, 0


class ParamAndGradBuffer:
    """Contiguous padded param/grad buffers for ``params``, bucketed for reduction.

    Groups params by (param dtype, grad dtype); grad dtype is fp32 with
    ``config.grad_reduce_in_fp32``, else the param dtype. ``param.main_grad``
    (always) and ``param.data`` (distributed optimizer only) become views into
    the group's buffers, keeping their values. Without torch.distributed the
    buffer can still be built for any ``dp_size`` to inspect layouts and
    shards; reductions then need ``dp_size == 1``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        config: DDPConfig,
        dp_group: Any = None,
        dp_size: int | None = None,
        device: torch.device | str | None = None,
        gradient_scaling_factor: float = 1.0,
    ) -> None:
        if not isinstance(config, DDPConfig):
            raise TypeError(f"config must be a DDPConfig, got {type(config).__name__}")
        param_list = list(params)
        if not param_list:
            raise ValueError("params must contain at least one parameter")
        seen: set[int] = set()
        for i, p in enumerate(param_list):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{i}] must be a torch.Tensor, got {type(p).__name__}")
            if not p.is_floating_point():
                raise TypeError(f"params[{i}] must be floating point, got {p.dtype}")
            if p.numel() == 0:
                raise ValueError(f"params[{i}] has no elements")
            if id(p) in seen:
                raise ValueError(f"params[{i}] is listed twice")
            seen.add(id(p))
        if isinstance(gradient_scaling_factor, bool) or not isinstance(
            gradient_scaling_factor, (int, float)
        ):
            raise TypeError("gradient_scaling_factor must be a float")
        if not math.isfinite(gradient_scaling_factor) or gradient_scaling_factor <= 0:
            raise ValueError(
                f"gradient_scaling_factor must be finite and > 0, got {gradient_scaling_factor}"
            )
        target = torch.device(device) if device is not None else param_list[0].device
        for i, p in enumerate(param_list):
            if p.device.type != target.type or (
                target.index is not None and p.device.index != target.index
            ):
                raise ValueError(f"params[{i}] is on {p.device}, the buffer is on {target}")

        self.config = config
        self.params = param_list
        self.dp_group = dp_group
        self.distributed, self.dp_size, self.dp_rank = _resolve_process_group(dp_group, dp_size)
        self.gradient_scaling_factor = float(gradient_scaling_factor)
        self.strategy = select_reduce_strategy(config, distributed=self.distributed)
        self.bucket_size = config.resolved_bucket_size(self.dp_size)
        self._registration_index = {p: i for i, p in enumerate(param_list)}

        grouped: dict[tuple[torch.dtype, torch.dtype], list[torch.Tensor]] = {}
        for p in param_list:
            grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else p.dtype
            grouped.setdefault((p.dtype, grad_dtype), []).append(p)
        self.groups: list[BufferGroup] = []
        self._group_of: dict[torch.Tensor, BufferGroup] = {}
        for (param_dtype, grad_dtype), members in grouped.items():
            shared = [
                i for i, p in enumerate(members) if getattr(p, "shared_embedding", False)
            ]
            group = BufferGroup(
                self, param_dtype, grad_dtype, members, shared, self.bucket_size, target
            )
            self.groups.append(group)
            for p in members:
                self._group_of[p] = group
        self.buckets: list[Bucket] = [b for g in self.groups for b in g.buckets]
        self._bucket_of: dict[torch.Tensor, Bucket] = {
            p: b for b in self.buckets for p in b.params
        }

    # -- lookup
    def group_of(self, param: torch.Tensor) -> BufferGroup:
        """The group holding ``param``."""
        try:
            return self._group_of[param]
        except KeyError:
            raise ValueError("param is not in this buffer") from None

    def bucket_of(self, param: torch.Tensor) -> Bucket:
        """The bucket holding ``param``."""
        try:
            return self._bucket_of[param]
        except KeyError:
            raise ValueError("param is not in this buffer") from None

    def registration_index(self, param: torch.Tensor) -> int:
        """Position of ``param`` in the ``params`` this buffer was built from."""
        try:
            return self._registration_index[param]
        except KeyError:
            raise ValueError("param is not in this buffer") from None

    # -- lifecycle
    @property
    def reduce_in_flight(self) -> bool:
        """True while any bucket's reduction is in flight."""
        return any(b.reduce_in_flight for b in self.buckets)

    def zero_grad(self) -> None:
        """Zero every grad buffer (padding included); refused while a reduce is in flight."""
        busy = [b for b in self.buckets if b.reduce_in_flight]
        if busy:
            raise LifecycleError(
                f"zero_grad while {len(busy)} bucket reduction(s) are in flight "
                f"(first: bucket {busy[0].bucket_id} of group {busy[0].group.key}); "
                "call finish_grad_sync first"
            )
        for group in self.groups:
            group.grad_data.zero_()

    def start_grad_sync(self) -> None:
        """Launch every bucket's reduction (none may be in flight)."""
        busy = [b for b in self.buckets if b.reduce_in_flight]
        if busy:
            raise LifecycleError(
                f"start_grad_sync while bucket {busy[0].bucket_id} of group "
                f"{busy[0].group.key} is already in flight"
            )
        for bucket in self.buckets:
            bucket.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's reduction (all must have been started)."""
        idle = [b for b in self.buckets if not b.reduce_in_flight]
        if idle:
            raise LifecycleError(
                f"finish_grad_sync: bucket {idle[0].bucket_id} of group {idle[0].group.key} "
                "has no reduction in flight (call start_grad_sync first)"
            )
        for bucket in self.buckets:
            bucket.finish_grad_sync()

    # -- padding-free views for norms and checkpoints
    def _rank(self, rank: int | None) -> int:
        return self.dp_rank if rank is None else rank

    def _require_shards(self, what: str) -> None:
        if not self.config.use_distributed_optimizer:
            raise ValueError(
                f"{what} needs use_distributed_optimizer=True (without it there are no "
                "shards: every rank holds the whole all-reduced buffer)"
            )

    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares (float64) over every param's ``main_grad``; padding never counted."""
        total = torch.zeros((), dtype=torch.float64, device=self.groups[0].grad_data.device)
        for p in self.params:
            total += p.main_grad.double().square().sum()
        return total

    def local_shard_grad_norm_sq(self, rank: int | None = None) -> torch.Tensor:
        """Sum of squares (float64) of the param elements in ``rank``'s shards.

        Summed over all ranks this is the global grad norm squared after a
        reduce-scatter. A rank whose shards are all padding contributes 0.
        """
        self._require_shards("local_shard_grad_norm_sq")
        r = self._rank(rank)
        total = torch.zeros((), dtype=torch.float64, device=self.groups[0].grad_data.device)
        for bucket in self.buckets:
            for piece in bucket.shard_pieces(r):
                a, b = piece.buffer_range
                total += bucket.group.grad_data[a:b].double().square().sum()
        return total

    def checkpoint_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per registration index: clones of ``param`` and ``main_grad`` (no padding)."""
        return {
            i: {"param": p.detach().clone(), "main_grad": p.main_grad.detach().clone()}
            for i, p in enumerate(self.params)
        }

    def shard_checkpoint_state(self, rank: int | None = None) -> dict[int, list[dict[str, Any]]]:
        """What ``rank`` saves under the distributed optimizer: the param elements in its shards.

        Per registration index, a list of ``{"param_offset": (lo, hi), "main_grad":
        flat clone, "param": flat clone or None}``. A rank whose shards are all
        padding returns ``{}``, which is a valid (empty) state, not a corrupt one.
        """
        self._require_shards("shard_checkpoint_state")
        r = self._rank(rank)
        state: dict[int, list[dict[str, Any]]] = {}
        for bucket in self.buckets:
            group = bucket.group
            for piece in bucket.shard_pieces(r):
                a, b = piece.buffer_range
                state.setdefault(piece.registration_index, []).append(
                    {
                        "param_offset": piece.param_offset,
                        "main_grad": group.grad_data[a:b].clone(),
                        "param": None if group.param_data is None else group.param_data[a:b].clone(),
                    }
                )
        return state

    def padding_is_zero(self) -> bool:
        """True when every padding element of every grad (and param) buffer is zero."""
        for group in self.groups:
            mask = group.padding_mask()
            if bool(group.grad_data[mask].ne(0).any()):
                return False
            if group.param_data is not None and bool(group.param_data[mask].ne(0).any()):
                return False
        return True

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def numel_unpadded(self) -> int:
        return sum(g.numel_unpadded for g in self.groups)

    def __repr__(self) -> str:
        return (
            f"ParamAndGradBuffer(dp_size={self.dp_size}, strategy={self.strategy.name}, "
            f"groups={self.groups})"
        )

"""Bucket layout and the padded grad buffer a candidate builds, as typed observables.

The ``layout`` check asks a candidate two things:

* where it puts every parameter and bucket for a parameter list (:class:`LayoutCase` in,
  :class:`refgrad.layout.Layout` out: ``param_index_map``, ``bucket_indices``,
  ``per_bucket_numel_unpadded``), compared with refgrad's layout and its invariants;
* the buffer itself (:meth:`BucketLayout.build_buffer`): the check's parameters remapped
  into contiguous padded buffers, one :class:`GradBufferGroup` per (param dtype, grad
  dtype), each bucket reduced across real ranks through :class:`GradBucket`.

How Megatron-Core implements it (``megatron.core.distributed``): a group is one
``param_and_grad_buffer._ParamAndGradBuffer`` (``DistributedDataParallel`` makes one per
dtype pair in ``_allocate_buffers_for_parameters``); its layout is read from
``param_index_map``, ``bucket_indices`` and each bucket's ``numel_unpadded``; a rank's shard
is ``shard_buffer(bucket.grad_data, dp)[rank]``; the sync is the bucket's
``_ParamAndGradBucketGroup.start_grad_sync`` / ``finish_grad_sync``, in flight while its
``grad_reduce_handle`` is set. A buffer built without a group (``dp_group=None``) only lays
itself out (Megatron: a ``FakeProcessGroup`` of ``dp_size``). Helpers a candidate does not
have (Megatron keeps the norm and the checkpoint in its ``DistributedOptimizer``) raise
:class:`verify.candidates.api.Unsupported`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gradvocab import DDPConfig

# Layout: refgrad's record of a layout, what layouts() returns; candidates import it from here
from refgrad.layout import Layout, validate_layout_arguments
from verify.candidates.api.core import Technique, Unsupported
from verify.candidates.api.scope import TechniqueScope


def _require_bools(instance: object, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(instance, name)
        if not isinstance(value, bool):
            raise TypeError(f"{type(instance).__name__}.{name} must be a bool, "
                            f"got {type(value).__name__}")


@dataclass(frozen=True)
class LayoutCase:
    """A parameter list (sizes in registration order) and the settings that lay it out.

    ``shared_embedding``: registration indices of parameters that get a bucket of their
    own under the distributed optimizer (Megatron-Core's ``shared_embedding`` attribute).
    """

    numels: tuple[int, ...]
    dp_size: int
    bucket_size: int | None
    use_distributed_optimizer: bool
    pad_buckets_for_high_nccl_busbw: bool
    shared_embedding: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        numels, _, _, _ = validate_layout_arguments(
            self.numels, self.dp_size, self.bucket_size, self.shared_embedding)
        object.__setattr__(self, "numels", tuple(numels))
        object.__setattr__(self, "shared_embedding", tuple(self.shared_embedding))
        _require_bools(self, ("use_distributed_optimizer", "pad_buckets_for_high_nccl_busbw"))

    @property
    def ddp_bucket_cap_mb(self) -> float | None:
        """The case as torch DDP's ``bucket_cap_mb`` for fp32 params: ``bucket_size``
        elements of 4 bytes, in MiB (None: DDP's default 25 MiB with a 1 MiB first bucket)."""
        return None if self.bucket_size is None else self.bucket_size * 4 / 2**20

    def refgrad_kwargs(self) -> dict:
        """The settings as keyword arguments of ``refgrad.layout.compute_layout``."""
        return {"dp_size": self.dp_size, "bucket_size": self.bucket_size,
                "use_distributed_optimizer": self.use_distributed_optimizer,
                "pad_buckets_for_high_nccl_busbw": self.pad_buckets_for_high_nccl_busbw,
                "shared_embedding": self.shared_embedding}


@dataclass(frozen=True)
class GradPiece:
    """The part of one parameter's grad inside one rank's shard: ``param_offset`` is
    ``(lo, hi)`` into the flattened parameter, ``values`` a copy of those elements."""

    param_offset: tuple[int, int]
    values: torch.Tensor


@runtime_checkable
class GradBucket(Protocol):
    """One bucket: a contiguous range of its group's buffers, reduced as one collective."""

    @property
    def start(self) -> int:
        """First element of the bucket in its group's grad buffer."""
        ...

    @property
    def end(self) -> int:
        """One past its last element (end padding included)."""
        ...

    def grad_shard(self, rank: int) -> torch.Tensor:
        """A view of DP rank ``rank``'s shard of this bucket's grads (distributed optimizer)."""
        ...

    def start_grad_sync(self) -> None:
        """Launch this bucket's reduction (reduce-scatter, or all-reduce without the
        distributed optimizer) over the buffer's group."""
        ...

    def finish_grad_sync(self) -> None:
        """Wait for the reduction :meth:`start_grad_sync` launched."""
        ...

    @property
    def reduce_in_flight(self) -> bool:
        """True between :meth:`start_grad_sync` and :meth:`finish_grad_sync`."""
        ...


@runtime_checkable
class GradBufferGroup(Protocol):
    """The params of one (param dtype, grad dtype) in one contiguous, padded buffer."""

    @property
    def param_dtype(self) -> torch.dtype: ...

    @property
    def grad_dtype(self) -> torch.dtype: ...

    @property
    def params(self) -> Sequence[torch.nn.Parameter]:
        """The group's params in registration order; each has a ``main_grad`` view."""
        ...

    @property
    def grad_data(self) -> torch.Tensor:
        """The whole flat grad buffer, padding included."""
        ...

    @property
    def param_data(self) -> torch.Tensor | None:
        """The flat param buffer the params' data now live in (distributed optimizer), else None."""
        ...

    @property
    def buckets(self) -> Sequence[GradBucket]: ...

    def layout(self) -> Layout:
        """Where the group's params and buckets are, read from the buffer's own bookkeeping."""
        ...


@runtime_checkable
class GradBuffer(Protocol):
    """A candidate's padded param/grad buffers over the params it was given.

    The norm and checkpoint helpers must never see padding; a candidate without such a
    helper raises :class:`verify.candidates.api.Unsupported`.
    """

    @property
    def groups(self) -> Sequence[GradBufferGroup]:
        """One group per (param dtype, grad dtype), in first-seen order."""
        ...

    @property
    def buckets(self) -> Sequence[GradBucket]:
        """Every group's buckets, group after group."""
        ...

    def zero_grad(self) -> None:
        """Zero every grad buffer, padding included."""
        ...

    def padding_is_zero(self) -> bool:
        """The candidate's own test that no padding element of any buffer is non-zero."""
        ...

    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares (float64) of every param's ``main_grad``."""
        ...

    def local_shard_grad_norm_sq(self, rank: int) -> torch.Tensor:
        """Sum of squares (float64) of the param elements in DP rank ``rank``'s shards."""
        ...

    def checkpoint_grads(self) -> dict[int, torch.Tensor]:
        """Per registration index, the ``main_grad`` a (non-sharded) checkpoint saves."""
        ...

    def shard_checkpoint_grads(self, rank: int) -> dict[int, list[GradPiece]]:
        """Per registration index, the grad pieces DP rank ``rank`` saves under the
        distributed optimizer (empty for a rank whose shards are all padding)."""
        ...


@dataclass(frozen=True)
class BucketTraining:
    """How the layout check trains a module in a candidate's own DDP to watch its buckets
    (torch DDP's argument names): ``bucket_cap_mb`` (None: the default),
    ``gradient_as_bucket_view``, and how the grads are zeroed before each iteration
    (``zero_grad(set_to_none=...)``)."""

    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    set_to_none: bool = True

    def __post_init__(self) -> None:
        _require_bools(self, ("gradient_as_bucket_view", "set_to_none"))
        if self.bucket_cap_mb is not None and not (
                isinstance(self.bucket_cap_mb, (int, float)) and not isinstance(self.bucket_cap_mb, bool)
                and self.bucket_cap_mb > 0):
            raise ValueError(f"BucketTraining.bucket_cap_mb must be None or > 0, got {self.bucket_cap_mb!r}")


@dataclass(frozen=True)
class ObservedBucket:
    """One bucket as the candidate's DDP reduced it: its params (registration indices) in the
    bucket's order, where each starts in the bucket, and the bucket's elements."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int


@dataclass(frozen=True)
class ObservedIteration:
    """One training iteration: the buckets in the order of their index, whether every
    param's grad is a view into its bucket, and every param's grad after the backward."""

    buckets: tuple[ObservedBucket, ...]
    grads_are_bucket_views: bool
    grads: tuple[torch.Tensor, ...]


class BucketObserver(TechniqueScope):
    """Trains a module in the candidate's DDP and reports its buckets every iteration."""

    def train(self, module: torch.nn.Module, settings: BucketTraining,
              batches: Sequence[object], group: dist.ProcessGroup | None) -> list[ObservedIteration]:
        """``module(batch).backward()`` for each batch in the candidate's DDP over ``group``
        (the grads zeroed before each as ``settings`` says)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ParameterShard:
    """One rank's shard of one parameter: rows ``[start, stop)`` of dim 0, the rows its
    sharded storage holds with padding, and the values of its rows."""

    start: int
    stop: int
    padded_rows: int
    values: torch.Tensor


class ParameterSharding(TechniqueScope):
    """Shards parameters one by one (FSDP2's ``fully_shard``)."""

    def shard(self, params: Sequence[torch.nn.Parameter],
              group: dist.ProcessGroup | None) -> list[ParameterShard]:
        """This rank's shard of each param (registration order) over ``group``."""
        raise NotImplementedError


@runtime_checkable
class BucketLayout(TechniqueScope, Protocol):
    """The candidate's bucket layout and padded grad buffer.

    Two parts only some candidates have, Unsupported unless they override them:
    :meth:`bucket_observer` (a DDP whose buckets are watched while it trains: torch's) and
    :meth:`parameter_sharding` (parameters sharded one by one instead of a bucketed buffer:
    FSDP2's).
    """

    def bucket_observer(self) -> BucketObserver:
        """The candidate's DDP, trained with its buckets watched (torch's DDP)."""
        raise Unsupported(Technique.LAYOUT, "is not torch's DDP (no Reducer whose buckets a hook can watch)")

    def parameter_sharding(self) -> ParameterSharding:
        """Its parameters sharded one by one (FSDP2's ``fully_shard``)."""
        raise Unsupported(Technique.LAYOUT, "does not shard parameters one by one")

    def layouts(self, cases: Sequence[LayoutCase]) -> list[Layout]:
        """The candidate's layout of each case, in order (one call, so a candidate that
        needs a process of its own to lay out a buffer starts it once)."""
        ...

    def build_buffer(self, params: Sequence[torch.nn.Parameter], config: DDPConfig, *,
                     dp_size: int, dp_group: dist.ProcessGroup | None = None,
                     average: bool = False) -> GradBuffer:
        """Remap ``params`` (registration order; ``shared_embedding=True`` marks a shared
        embedding) into the candidate's buffers, values kept.

        ``dp_group`` None: laid out for ``dp_size`` ranks, for inspection only (no
        reduction); with a group, ``dp_size`` is its size. ``average``: the reduction
        averages over the ``dp_size`` replicas as the candidate decides it (production:
        ``ReduceOp.AVG`` with ``config.average_in_collective``, else a ``1/dp``
        ``gradient_scaling_factor`` before a SUM); False: it sums.
        """
        ...

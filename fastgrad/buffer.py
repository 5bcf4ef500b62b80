"""Contiguous, padded parameter/gradient buffers split into buckets (REFERENCE_NOTES section 1).

API summary
-----------
``ParamAndGradBuffer(params, *, config, parallel_dims=None, dp_group=None, dp_size=None,
device=None, averaging=Averaging.SUM, mxfp8_params=False)``
    ``params``: parameters in registration order (a param with attribute
    ``shared_embedding=True`` gets its own bucket under the distributed optimizer).
    The data-parallel group comes from ``.parallel_dims``
    (:class:`gradvocab.ParallelDims` with this rank's place; pass one, else
    ``ParallelDims.data_parallel(dp_group, dp_size)`` resolves it) and is handed to every
    bucket, as is ``.averaging`` (:func:`fastgrad.averaging.grad_averaging` of ``config``,
    the DP size and ``averaging``: the one decision of SUM, AVG or a ``1/dp`` pre-scale).
    ``.params``, ``.config``, ``.parallel_dims``, ``.dp_size``, ``.dp_rank``, ``.dp_group``
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
    ``.numel``, ``.numel_unpadded``, ``.param_range(param)``, ``.padding_mask()``,
    ``.shares_param_and_grad_memory``
``Bucket``, the reduce strategies: :mod:`fastgrad.bucket`.
``aligned_zeros(numel, dtype, device)``: a zero buffer 64-element aligned in memory.

MXFP8 mode (``mxfp8_params=True``, used by ``fastgrad.mxfp8_sharing``)
--------------------------------------------------------------------
``params`` may be :class:`fastgrad.mxfp8.MXFP8Parameter` objects or bf16
tensors; the distributed optimizer is required. ``param_data`` holds the
all-gathered bf16 params. With ``config.reuse_grad_buf_for_mxfp8_param_ag``
and at least one MXFP8 param (production's gate) ``param_data`` is a bf16 view
of the first ``ceil(numel / 2)`` fp32 grad elements (or the bf16 grad buffer
itself): one allocation. Allocations are exactly ``numel`` elements (the
memory saving is measured from storages), so the 64-element alignment of
``aligned_zeros`` is not enforced in this mode. Every param gets a
``main_grad`` view; only tensors get their ``data`` moved into ``param_data``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fastgrad.averaging import grad_averaging
from fastgrad.bucket import (  # noqa: F401  (re-exported: one import site for buffer users)
    AllReduceStrategy,
    Bucket,
    GradReduceStrategy,
    LocalOnlyStrategy,
    ReduceScatterStrategy,
    ShardPiece,
    select_reduce_strategy,
)
from fastgrad.buffer_group import ALIGNMENT_ELEMENTS, BufferGroup, aligned_zeros  # noqa: F401
from fastgrad.data_parallel_view import DataParallelView
from fastgrad.mxfp8 import PARAM_DTYPE, MXFP8Parameter
from gradvocab import Averaging, DDPConfig, LifecycleError, ParallelDims, require_place


class ParamAndGradBuffer(DataParallelView):
    """Contiguous padded param/grad buffers for ``params``, bucketed for reduction.

    Groups params by (param dtype, grad dtype); grad dtype is fp32 with
    ``config.grad_reduce_in_fp32``, else the param dtype. ``param.main_grad``
    (always) and ``param.data`` (distributed optimizer only) become views into
    the group's buffers, keeping their values. Without torch.distributed the
    buffer can still be built for any ``dp_size`` to inspect layouts and
    shards; reductions then need ``dp_size == 1``. ``averaging``: how the reduction
    combines the replicas (a :class:`gradvocab.Averaging`; the default ``Averaging.SUM``
    sums, as a bare buffer always has; None is Megatron-Core's default, as
    ``DistributedDataParallel``'s); the plan, with where a pre-scale is applied, is ``.averaging``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        config: DDPConfig,
        parallel_dims: ParallelDims | None = None,
        dp_group: Any = None,
        dp_size: int | None = None,
        device: torch.device | str | None = None,
        averaging: Averaging | None = Averaging.SUM,
        mxfp8_params: bool = False,
    ) -> None:
        if not isinstance(config, DDPConfig):
            raise TypeError(f"config must be a DDPConfig, got {type(config).__name__}")
        if mxfp8_params and not config.use_distributed_optimizer:
            raise ValueError(
                "config.use_distributed_optimizer must be True: MXFP8 params are all-gathered "
                "from fp32 master shards"
            )
        param_list = list(params)
        _validate_params(param_list, mxfp8_params=mxfp8_params)
        target = torch.device(device) if device is not None else param_list[0].device
        for i, p in enumerate(param_list):
            if p.device.type != target.type or (
                target.index is not None and p.device.index != target.index
            ):
                raise ValueError(f"params[{i}] is on {p.device}, the buffer is on {target}")
        if parallel_dims is None:
            parallel_dims = ParallelDims.data_parallel(dp_group, dp_size)
        elif dp_group is not None or dp_size is not None:
            raise ValueError("pass either parallel_dims or dp_group/dp_size, not both")
        require_place(parallel_dims, "ParamAndGradBuffer")

        self.config = config
        self.params = param_list
        self.parallel_dims = parallel_dims
        self.mxfp8_params = mxfp8_params
        self.averaging = grad_averaging(config, parallel_dims.dp_size, averaging)
        self.strategy = select_reduce_strategy(config, distributed=parallel_dims.distributed)
        self.bucket_size = config.resolved_bucket_size(parallel_dims.dp_size)
        self._registration_index = {p: i for i, p in enumerate(param_list)}

        grouped: dict[tuple[torch.dtype, torch.dtype], list[Any]] = {}
        for p in param_list:
            param_dtype = PARAM_DTYPE if isinstance(p, MXFP8Parameter) else p.dtype
            grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else param_dtype
            grouped.setdefault((param_dtype, grad_dtype), []).append(p)
        self.groups: list[BufferGroup] = []
        self._group_of: dict[Any, BufferGroup] = {}
        for (param_dtype, grad_dtype), members in grouped.items():
            group = BufferGroup(
                param_dtype,
                grad_dtype,
                members,
                config=config,
                parallel_dims=parallel_dims,
                strategy=self.strategy,
                registration_index=self._registration_index,
                averaging=self.averaging,
                device=target,
                mxfp8_params=mxfp8_params,
            )
            self.groups.append(group)
            for p in members:
                self._group_of[p] = group
        self.buckets: list[Bucket] = [b for g in self.groups for b in g.buckets]
        self._bucket_of: dict[Any, Bucket] = {p: b for b in self.buckets for p in b.params}

    @property
    def sharing(self) -> bool:
        """True when some group's param_data aliases its grad_data (MXFP8 mode)."""
        return any(g.shares_param_and_grad_memory for g in self.groups)

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

def _validate_params(params: list[Any], *, mxfp8_params: bool) -> None:
    """Types, dtypes, sizes and uniqueness of the buffer's params (ValueError/TypeError)."""
    if not params:
        raise ValueError("params must contain at least one parameter")
    seen: set[int] = set()
    for i, p in enumerate(params):
        if mxfp8_params and not isinstance(p, MXFP8Parameter | torch.Tensor):
            raise TypeError(
                f"params[{i}] must be an MXFP8Parameter or a torch.Tensor, got {type(p).__name__}"
            )
        if not mxfp8_params and not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}] must be a torch.Tensor, got {type(p).__name__}")
        if isinstance(p, torch.Tensor):
            if not p.is_floating_point():
                raise TypeError(f"params[{i}] must be floating point, got {p.dtype}")
            if mxfp8_params and p.dtype != PARAM_DTYPE:
                raise TypeError(f"params[{i}] (non-quantized) must be bfloat16, got {p.dtype}")
        if p.numel() == 0:
            raise ValueError(f"params[{i}] has no elements")
        if id(p) in seen:
            raise ValueError(f"params[{i}] is listed twice")
        seen.add(id(p))

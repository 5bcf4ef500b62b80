"""Publishing the masters into the params: cast into the param shard, all-gather, wait.

:class:`ParamPublication` is the part of :class:`fastgrad.optim.DistributedOptimizer`
that moves updated fp32 masters into the model: per bucket, cast this rank's
master shard into the bucket's param shard and all-gather the bucket's params --
synchronously, or (``overlap_param_gather``) launched at the end of the step and
waited for in a forward pre-hook of the modules owning that bucket's params. A
param written between a gather's launch and its wait races with it and is
refused (:meth:`ParamPublication._check_unmodified`). With MXFP8 params the
optimizer publishes through the ``MXFP8ParamGradBuffer`` front instead
(stage as bf16, gather, quantize).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fastgrad.comm import all_gather_into
from fastgrad.mxfp8 import MXFP8Parameter
from gradvocab import LifecycleError


class ParamPublication:
    """Masters -> params (and the forward pre-hooks of ``overlap_param_gather``)."""

    shards: list[Any]
    mxfp8: Any
    ddp: Any
    overlap_param_gather: bool
    _hooks: list[Any]
    name_of: Any  # the optimizer's: DDP names, or MXFP8 buffer order

    def master_shards(self) -> list[torch.Tensor]:
        """Per bucket, this rank's fp32 master shard laid out as the bucket shard (padding 0)."""
        out = []
        for shard in self.shards:
            bucket = shard.bucket
            full = torch.zeros(bucket.shard_numel, dtype=torch.float32, device=shard.master.device)
            start = bucket.local_shard_range[0]
            for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
                a, b = piece.buffer_range
                full[a - start : b - start] = shard.master[lo:hi]
            out.append(full)
        return out

    def publish_params(self) -> None:
        """Cast the masters into the param shards and all-gather now (and quantize MXFP8 params).

        ``step()`` does this itself; call it only to (re)publish outside a step,
        e.g. before the first forward so the params equal the masters' rounding.
        """
        self.finish_param_sync()
        self._publish_all()
        self._params_published()

    def _params_published(self) -> None:
        """Hook: the params now hold what the masters say (the optimizer records their versions)."""

    def _register_forward_pre_hooks(self) -> list[Any]:
        shard_of = {p: s for s in self.shards for p in s.bucket.params}
        hooks = []
        for module in self.ddp.module.modules():
            mine = {id(shard_of[p]): shard_of[p] for p in module.parameters(recurse=False) if p in shard_of}
            if mine:
                shards = list(mine.values())
                hooks.append(module.register_forward_pre_hook(lambda _m, _a, s=shards: self._wait(s)))
        return hooks

    def _publish_all(self, cast: Sequence[bool] | None = None) -> None:
        if self.mxfp8 is not None:
            # Megatron-Core's MXFP8 order, through the front (its guard refuses misuse):
            # stage all shards, then per bucket gather -> quantize -> zero param_data.
            self.mxfp8.stage_master_params(self.master_shards())
            self.mxfp8.gather_all_params()
            return
        for i, shard in enumerate(self.shards):  # cast[i] False: the update wrote the param copy
            self._publish_bucket(shard, cast=True if cast is None else cast[i])
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def _publish_bucket(self, shard: Any, cast: bool = True) -> None:
        bucket = shard.bucket
        if cast:
            data, values = bucket.group.param_data, shard.master.to(bucket.group.param_dtype)
            for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
                a, b = piece.buffer_range
                data[a:b].copy_(values[lo:hi])
        if bucket.dp_size > 1:
            shard.gather_handle = all_gather_into(
                bucket.param_data, bucket.local_param_shard, group=bucket.dp_group, async_op=True
            )
            shard.versions = [(p, p._version) for p in bucket.params]  # no per-param hashing

    def _wait(self, shards: Iterable[Any]) -> None:
        for shard in shards:
            if shard.gather_handle is None:
                continue
            handle, shard.gather_handle = shard.gather_handle, None
            handle.wait()
            self._check_unmodified(shard)

    def _check_unmodified(self, shard: Any) -> None:
        """Params written between the all-gather's launch and its wait race with it: refuse."""
        bucket = shard.bucket
        changed = [p for p, v in shard.versions or () if p._version != v]
        for param, published, master in self._published_and_master_bits(shard):
            if not torch.equal(published, master):
                changed.append(param)
        shard.versions = None
        if changed:
            raise LifecycleError(
                f"parameter {self.name_of(changed[0])!r} was modified between the launch of "
                f"bucket {bucket.bucket_id}'s param all-gather and its wait; the gather overwrites "
                "it (modify params only through the optimizer, or after finish_param_sync())"
            )

    def _published_and_master_bits(self, shard: Any) -> list[tuple[Any, torch.Tensor, torch.Tensor]]:
        """Per piece of ``shard``: its param, the bits of its elements in the param buffer, and
        the bits of its master cast to the param dtype.

        With fp32 params the cast is the master itself, so the views are built once and
        kept (``param_data`` and the masters are only ever written in place): every wait
        then costs one ``torch.equal`` per piece and no view-building.
        """
        if shard.published_bits is not None:
            return shard.published_bits
        data = shard.bucket.group.param_data
        cast = shard.master.to(shard.bucket.group.param_dtype)
        views = []
        for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
            a, b = piece.buffer_range
            views.append((piece.param, bits(data[a:b]), bits(cast[lo:hi])))
        if cast is shard.master:
            shard.published_bits = views
        return views

    def finish_param_sync(self) -> None:
        """Wait for every bucket's param all-gather still in flight."""
        self._wait(self.shards)

    @property
    def param_gather_in_flight(self) -> bool:
        """True while some bucket's param all-gather is launched and not yet waited for."""
        return any(s.gather_handle is not None for s in self.shards)

    def remove_hooks(self) -> None:
        """Detach the forward pre-hooks (overlap_param_gather)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def flat_fp32(param: Any) -> torch.Tensor:
    """A param's values, flat fp32 (an MXFP8 param's dequantized values, exact in fp32)."""
    if isinstance(param, MXFP8Parameter):
        return param.dequantize(torch.float32).reshape(-1)
    return param.detach().reshape(-1).float()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a 2-, 4- or 8-byte tensor (for bitwise comparisons)."""
    widths = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(widths[t.element_size()])

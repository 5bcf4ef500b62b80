"""MXFP8 parameters all-gathered through the gradient buffer (``reuse_grad_buf_for_mxfp8_param_ag``).

Production (Megatron-Core, REFERENCE_NOTES section 4): with the distributed
optimizer and MXFP8 params, one ``shared_buffer`` of grad dtype backs both
``grad_data`` and ``param_data``; ``param_data`` is the bf16 view of its first
``ceil(numel / 2)`` fp32 elements when grads are fp32 (param index k lives in
bytes [2k, 2k+2), overlapping the grads of *other* buckets), else the buffer
itself. Per iteration:

1. zero the grads;
2. copy each fp32 master shard into its bucket's ``param_data`` shard (bf16 cast);
3. all-gather every bucket's params into ``bucket.param_data``;
4. per bucket, quantize the gathered slices into the MXFP8 params, then zero
   that bucket's ``param_data`` (bucket level, never the whole buffer); a
   bucket that also holds a non-quantized param is not zeroed (that param's
   ``data`` is a view into the buffer);
5. backward accumulates grads into ``main_grad`` views; reduce-scatter per
   bucket; the optimizer updates its fp32 master shard.

:class:`MXFP8ParamGradBuffer` is the param-gather front for these steps. It
holds one ``fastgrad.buffer.ParamAndGradBuffer`` in MXFP8 mode (the one
buffer and bucket type: layout, allocation, ``main_grad`` views and the
reduce-scatter are that buffer's) and one
:class:`fastgrad.mxfp8_regions.ParamRegionGuard`. Because the same bytes hold
params and grads at different times, misuse silently computes garbage in
production; the guard tracks which byte ranges hold live params and the front
raises :class:`gradvocab.LifecycleError` instead, for:

* reading (or copying out) gathered params after their bucket was zeroed;
* a forced param sync (all-gather) whose local shard was not re-staged from
  the master params (it would gather zeros or stale values);
* writing grads, zeroing grads, or reduce-scattering over bytes that still
  hold live params (production's "zero_grad wipes params");
* staging or gathering params over grads that were not consumed yet.

The config combinations production says give NaN (sharing without both
overlaps or without ``fp8_param_gather``) are refused by
``gradvocab.DDPConfig`` itself with a ValueError.

With sharing off, the same class uses separate ``param_data`` (bf16) and
``grad_data`` allocations and the same steps, which is the baseline the
verify check holds the shared buffer to, bitwise. The distributed optimizer
that owns the fp32 master shards is ``fastgrad.optim.DistributedOptimizer``
(built on this front; its ``step()`` stages, gathers and quantizes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fastgrad.buffer import Bucket, ParamAndGradBuffer
from fastgrad.comm import all_gather_into
from fastgrad.data_parallel_view import DataParallelView
from fastgrad.mxfp8 import PARAM_DTYPE, MXFP8Parameter
from fastgrad.mxfp8_regions import BucketRegion, ParamRegionGuard, RegionState
from gradvocab import Averaging, DDPConfig, LifecycleError, ParallelDims

__all__ = [
    "PARAM_DTYPE",
    "MXFP8ParamGradBuffer",
    "MXFP8Parameter",
    "Param",
    "RegionState",
    "storage_bytes",
]

Param = MXFP8Parameter | torch.Tensor


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (an alias counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class MXFP8ParamGradBuffer(DataParallelView):
    """Param all-gather and grad accumulation for a distributed-optimizer model with MXFP8 weights.

    ``params``: :class:`MXFP8Parameter` or plain bf16 (non-quantized) tensors, in
    registration order. With ``config.reuse_grad_buf_for_mxfp8_param_ag`` (and
    at least one MXFP8 param, as production) param and grad data share one
    allocation; otherwise they are separate. Grads are fp32 with
    ``config.grad_reduce_in_fp32``, else bf16. A non-quantized param's
    ``data`` becomes a view into ``param_data`` (production's mapping).
    ``.buffer`` is the underlying ``ParamAndGradBuffer``; ``.buckets`` its buckets.
    The data-parallel group is ``parallel_dims``' or ``dp_group``'s, as for the buffer.
    ``averaging``: how the reduce-scatter combines the replicas' grads (a
    :class:`gradvocab.Averaging`; the default ``Averaging.SUM`` sums, None is
    ``DistributedDataParallel``'s default, Megatron-Core's ``1/DP`` pre-scale unless
    ``config.average_in_collective``); the plan is ``.buffer.averaging``.
    """

    def __init__(
        self,
        params: Sequence[Param],
        *,
        config: DDPConfig,
        parallel_dims: ParallelDims | None = None,
        dp_group: Any = None,
        device: torch.device | str = "cpu",
        averaging: Averaging | None = Averaging.SUM,
    ) -> None:
        self.buffer = ParamAndGradBuffer(
            params, config=config, parallel_dims=parallel_dims, dp_group=dp_group, device=device,
            mxfp8_params=True, averaging=averaging,
        )
        (group,) = self.buffer.groups  # every param is bf16 in this mode: one group
        self.group = group
        self.params = self.buffer.params
        self.config = config
        self.parallel_dims = self.buffer.parallel_dims
        self.grad_dtype = group.grad_dtype
        self.sharing = group.shares_param_and_grad_memory
        self.layout = group.layout
        self.numel = group.numel
        self.grad_data = group.grad_data
        self.param_data = group.param_data
        self.shared_buffer = group.grad_data if self.sharing else None
        self.buckets: list[Bucket] = self.buffer.buckets
        self.guard = ParamRegionGuard(
            self.buckets, sharing=self.sharing, param_dtype=PARAM_DTYPE, grad_dtype=self.grad_dtype
        )
        self.grad_element_size = self.guard.grad_element_size
        self.param_element_size = self.guard.param_element_size
        self.grads_pending = False  # grads written since zero_grad and not yet consumed
        self.grads_reduced = False
        if self.sharing:
            # A non-quantized param's data lives in param_data from the start.
            for region in self.guard.regions:
                if region.holds_non_quantized:
                    region.state = RegionState.LIVE

    # ------------------------------------------------------------------ helpers
    def bucket_of(self, param: Param) -> Bucket:
        """The bucket holding ``param``; a ValueError for a param not in this buffer."""
        return self.buffer.bucket_of(param)

    def region_of(self, param_or_bucket: Param | Bucket) -> BucketRegion:
        """The lifecycle record of a bucket (or of the bucket holding a param)."""
        bucket = (
            param_or_bucket
            if isinstance(param_or_bucket, Bucket)
            else self.bucket_of(param_or_bucket)
        )
        return self.guard.region(bucket)

    def param_range(self, param: Param) -> tuple[int, int]:
        """``(start, end)`` of ``param`` in the buffer, in elements."""
        self.bucket_of(param)
        return self.group.param_range(param)

    def allocated_bytes(self) -> int:
        """Bytes held by the param and grad allocations, measured from their storages."""
        return storage_bytes([self.grad_data, self.param_data])

    def expected_bytes(self) -> int:
        """What :meth:`allocated_bytes` must be: grads, plus bf16 params unless shared."""
        grads = self.numel * self.grad_element_size
        return grads if self.sharing else grads + self.numel * self.param_element_size

    # ------------------------------------------------------------------ grads
    def zero_grad(self) -> None:
        """Zero the grad buffer; refused while any bucket holds live params (sharing)."""
        self.guard.refuse_live("zero_grad", (0, self.numel * self.grad_element_size))
        self.grad_data.zero_()
        self.grads_pending = False
        self.grads_reduced = False
        if self.sharing:
            for region in self.guard.regions:
                region.shard_fresh = False  # the param shards were zeroed with the grads

    def main_grad_of(self, param: Param) -> torch.Tensor:
        """The ``main_grad`` view of ``param`` in the grad buffer."""
        self.bucket_of(param)
        return param.main_grad

    def accumulate_grad(self, param: Param, grad: torch.Tensor) -> None:
        """``main_grad += grad``; refused if those grad bytes still hold live params."""
        bucket = self.bucket_of(param)
        if tuple(grad.shape) != tuple(param.shape):
            raise ValueError(f"grad has shape {tuple(grad.shape)}, the param {tuple(param.shape)}")
        if self.grads_reduced:
            raise LifecycleError(
                "accumulate_grad after reduce_grads: the reduced shards would mix with new "
                "grads (call the optimizer step and zero_grad first)"
            )
        start, end = self.group.param_range(param)
        size = self.grad_element_size
        self.guard.refuse_live(
            f"accumulate_grad for a param of bucket {bucket.bucket_id}", (start * size, end * size)
        )
        param.main_grad.add_(grad)
        self.grads_pending = True

    def reduce_grads(self) -> None:
        """Reduce-scatter every bucket (synchronously, bucket by bucket)."""
        if self.grads_reduced:
            raise LifecycleError("reduce_grads called twice without an optimizer step between")
        for region in self.guard.regions:
            self.guard.refuse_live(
                f"reduce-scatter of bucket {region.bucket.bucket_id}", region.grad_bytes()
            )
        for bucket in self.buckets:
            bucket.start_grad_sync()
            bucket.finish_grad_sync()
        self.grads_reduced = True

    def consume_grads(self) -> None:
        """Called by the optimizer after it used the reduced shards."""
        if not self.grads_reduced:
            raise LifecycleError("optimizer step before reduce_grads: the grad shards are unreduced")
        self.grads_pending = False
        self.grads_reduced = False
        for region in self.guard.regions:
            region.shard_fresh = False  # the master shard moved; param shards are stale

    # ------------------------------------------------------------------ params
    def stage_master_params(self, master_shards: Sequence[torch.Tensor]) -> None:
        """Copy each bucket's fp32 master shard into its local ``param_data`` shard (bf16 RNE)."""
        if len(master_shards) != len(self.buckets):
            raise ValueError(
                f"master_shards has {len(master_shards)} entries, expected one per bucket "
                f"({len(self.buckets)})"
            )
        if self.sharing and self.grads_pending:
            raise LifecycleError(
                "stage_master_params would overwrite grads that were accumulated but not "
                "consumed by an optimizer step (param and grad share memory)"
            )
        for bucket, master in zip(self.buckets, master_shards):
            if master.shape != (bucket.shard_numel,):
                raise ValueError(
                    f"master shard of bucket {bucket.bucket_id} has shape {tuple(master.shape)}, "
                    f"expected ({bucket.shard_numel},)"
                )
            if self.guard.region(bucket).state is RegionState.GATHERING:
                raise LifecycleError(f"bucket {bucket.bucket_id} has an all-gather in flight")
        for bucket, master in zip(self.buckets, master_shards):
            region = self.guard.region(bucket)
            bucket.local_param_shard.copy_(master)
            region.shard_fresh = True
            if region.state is RegionState.FREE:
                region.state = RegionState.STAGED

    def start_param_gather(self, bucket: Bucket, *, force_sync: bool = False) -> None:
        """Launch the all-gather of ``bucket``'s params into ``bucket.param_data``.

        ``force_sync`` marks a sync outside the normal iteration (e.g. a checkpoint);
        both need a local shard re-staged from the master params since it was zeroed
        (sharing) or since the last optimizer step.
        """
        region = self.guard.region(bucket)
        if not region.shard_fresh:
            why = (
                "was zeroed for gradient accumulation (it shares memory with the grads)"
                if self.sharing
                else "is stale since the last optimizer step"
            )
            kind = "forced param sync" if force_sync else "param all-gather"
            raise LifecycleError(
                f"{kind} of bucket {bucket.bucket_id}: the local param shard {why}; "
                "call stage_master_params() first (production all-gathers zeros/stale data here)"
            )
        if region.state is RegionState.GATHERING:
            raise LifecycleError(f"bucket {bucket.bucket_id} already has an all-gather in flight")
        if self.sharing and self.grads_pending:
            raise LifecycleError(
                f"all-gather of bucket {bucket.bucket_id} would overwrite unconsumed grads "
                "(param and grad share memory)"
            )
        if self.distributed and self.dp_size > 1:
            region.gather_handle = all_gather_into(
                bucket.param_data, bucket.local_param_shard, group=self.dp_group, async_op=True
            )
        region.state = RegionState.GATHERING

    def finish_param_gather(self, bucket: Bucket) -> None:
        """Wait for the all-gather, copy the params out, and (sharing) zero the bucket's params."""
        region = self.guard.region(bucket)
        if region.state is not RegionState.GATHERING:
            raise LifecycleError(
                f"finish_param_gather on bucket {bucket.bucket_id}: no all-gather in flight "
                f"(state {region.state.value})"
            )
        handle, region.gather_handle = region.gather_handle, None
        if handle is not None:
            handle.wait()
        region.state = RegionState.GATHERED
        self.copy_params_from_buffer(bucket)

    def gather_all_params(self, *, force_sync: bool = False) -> None:
        """Launch every bucket's all-gather, then finish them in order (overlap_param_gather)."""
        for bucket in self.buckets:
            self.start_param_gather(bucket, force_sync=force_sync)
        for bucket in self.buckets:
            self.finish_param_gather(bucket)

    def gathered_param(self, param: Param) -> torch.Tensor:
        """The all-gathered bf16 values of ``param`` in ``param_data``.

        Refused once the bucket was zeroed for gradients (sharing), or before any gather.
        """
        bucket = self.bucket_of(param)
        region = self.guard.region(bucket)
        if self.sharing and region.state not in (RegionState.GATHERED, RegionState.LIVE):
            raise LifecycleError(
                f"reading gathered params of bucket {bucket.bucket_id} in state "
                f"{region.state.value}: the bucket was zeroed for gradient accumulation "
                "after its params were copied out (or was never gathered)"
            )
        start, end = self.group.param_range(param)
        return self.param_data[start:end].view(tuple(param.shape))

    def copy_params_from_buffer(self, bucket: Bucket) -> None:
        """Quantize the gathered slices into the MXFP8 params; then zero the bucket (sharing).

        A bucket holding a non-quantized param is not zeroed: that param's data
        lives in the buffer (production's rule), so the bucket stays LIVE.
        """
        region = self.guard.region(bucket)
        if region.state is not RegionState.GATHERED:
            raise LifecycleError(
                f"copying params out of bucket {bucket.bucket_id} in state {region.state.value}: "
                "its gathered params are gone (zeroed or never gathered); copying now would "
                "write zeros/grads into the MXFP8 params"
            )
        for p in bucket.params:
            if isinstance(p, MXFP8Parameter):
                start, end = bucket.param_to_index[p]
                p.copy_from(bucket.param_data[start:end])
        if not self.sharing:
            return  # separate buffers: the gathered params stay valid
        if region.holds_non_quantized:
            region.state = RegionState.LIVE
            return
        bucket.param_data.zero_()
        region.state = RegionState.FREE
        region.shard_fresh = False

    def __repr__(self) -> str:
        return (
            f"MXFP8ParamGradBuffer(sharing={self.sharing}, grad_dtype={self.grad_dtype}, "
            f"numel={self.numel}, buckets={len(self.buckets)})"
        )

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

Because the same bytes hold params and grads at different times, misuse
silently computes garbage in production. :class:`MXFP8ParamGradBuffer` tracks
which byte ranges hold live params and raises
:class:`fastgrad.errors.LifecycleError` instead, for:

* reading (or copying out) gathered params after their bucket was zeroed;
* a forced param sync (all-gather) whose local shard was not re-staged from
  the master params (it would gather zeros or stale values);
* writing grads, zeroing grads, or reduce-scattering over bytes that still
  hold live params (production's "zero_grad wipes params");
* staging or gathering params over grads that were not consumed yet.

The config combinations production says give NaN (sharing without both
overlaps or without ``fp8_param_gather``) are refused by
``fastgrad.config.DDPConfig`` itself with a ValueError.

With sharing off, the same class uses separate ``param_data`` (bf16) and
``grad_data`` allocations and the same steps, which is the baseline the
verify check holds the shared buffer to, bitwise.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastgrad import mxfp8
from fastgrad.buffer import select_reduce_strategy
from fastgrad.comm import all_gather_into
from fastgrad.config import DDPConfig
from fastgrad.errors import LifecycleError
from fastgrad.layout import BufferLayout, compute_layout

PARAM_DTYPE = torch.bfloat16  # dtype of the all-gathered params in param_data


class MXFP8Parameter:
    """A weight held as MXFP8 bits in its own storage (E8M0 scales + E4M3 elements).

    ``copy_from(values)`` quantizes ``values`` into that storage in place;
    ``dequantize()`` gives the values the forward pass computes with.
    """

    def __init__(
        self, value: torch.Tensor, *, scale_mode: str = "floor", block_size: int = 32
    ) -> None:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError("value must be a floating-point torch.Tensor")
        scale_bits, element_bits = mxfp8.quantize(
            value.detach().to(PARAM_DTYPE), scale_mode=scale_mode, block_size=block_size
        )
        self.shape = tuple(value.shape)
        self.scale_mode = scale_mode
        self.block_size = block_size
        self.scale_bits = scale_bits
        self.element_bits = element_bits

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.element_bits.device

    def copy_from(self, values: torch.Tensor) -> None:
        """Quantize ``values`` (any float dtype, ``numel`` elements) into this parameter, in place."""
        if values.numel() != self.numel():
            raise ValueError(f"values has {values.numel()} elements, the parameter {self.numel()}")
        scale_bits, element_bits = mxfp8.quantize(
            values.reshape(self.shape), scale_mode=self.scale_mode, block_size=self.block_size
        )
        self.scale_bits.copy_(scale_bits)
        self.element_bits.copy_(element_bits)

    def dequantize(self, dtype: torch.dtype = PARAM_DTYPE) -> torch.Tensor:
        """The parameter's values (exact in bf16 and fp32 for the scales quantize produces)."""
        return mxfp8.dequantize(
            self.scale_bits, self.element_bits, block_size=self.block_size, dtype=dtype
        )

    def __repr__(self) -> str:
        return f"MXFP8Parameter(shape={self.shape}, scale_mode={self.scale_mode!r})"


Param = MXFP8Parameter | torch.Tensor


class RegionState(enum.Enum):
    """What a bucket's param bytes hold right now."""

    FREE = "free"  # nothing live: the bytes belong to the grads (zeroed or accumulating)
    STAGED = "staged"  # this rank's shard holds its bf16 params, ready to all-gather
    GATHERING = "gathering"  # an all-gather into the whole bucket is in flight
    GATHERED = "gathered"  # the whole bucket holds the all-gathered bf16 params
    LIVE = "live"  # copied out, but not zeroed: a non-quantized param lives in the buffer


_LIVE_WHOLE_BUCKET = (RegionState.GATHERING, RegionState.GATHERED, RegionState.LIVE)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class SharedBucket:
    """One bucket: views into the buffers, its params and its lifecycle state.

    Offers what ``fastgrad.buffer``'s reduce strategies use (``grad_data``,
    ``local_grad_shard``, ``dp_group``) so the reduction is theirs.
    """

    def __init__(
        self,
        owner: MXFP8ParamGradBuffer,
        bucket_id: int,
        start: int,
        end: int,
        params: list[Param],
        param_ranges: dict[int, tuple[int, int]],
    ) -> None:
        self.owner = owner
        self.bucket_id = bucket_id
        self.start = start
        self.end = end
        self.numel = end - start
        self.params = params
        # As production: (start, end) relative to the bucket start.
        self.param_to_index = {id(p): (param_ranges[id(p)][0] - start, param_ranges[id(p)][1] - start) for p in params}
        self.grad_data = owner.grad_data[start:end]
        self.param_data = owner.param_data[start:end]
        self.shard_numel = self.numel // owner.dp_size
        self.holds_non_quantized = any(not isinstance(p, MXFP8Parameter) for p in params)
        self.state = RegionState.FREE
        self.shard_fresh = False  # local param shard equals the master shard since the last step
        self._gather_handle: Any = None

    @property
    def dp_group(self) -> Any:
        return self.owner.dp_group

    @property
    def local_shard_range(self) -> tuple[int, int]:
        """``(start, end)`` of this rank's shard, in buffer elements."""
        lo = self.start + self.owner.dp_rank * self.shard_numel
        return lo, lo + self.shard_numel

    @property
    def local_grad_shard(self) -> torch.Tensor:
        lo, hi = self.local_shard_range
        return self.owner.grad_data[lo:hi]

    @property
    def local_param_shard(self) -> torch.Tensor:
        lo, hi = self.local_shard_range
        return self.owner.param_data[lo:hi]

    def live_param_bytes(self) -> tuple[int, int] | None:
        """Byte range (in the shared allocation) holding live params, or None."""
        if self.state is RegionState.STAGED:
            lo, hi = self.local_shard_range
        elif self.state in _LIVE_WHOLE_BUCKET:
            lo, hi = self.start, self.end
        else:
            return None
        size = self.owner.param_element_size
        return lo * size, hi * size

    def param_bytes(self) -> tuple[int, int]:
        size = self.owner.param_element_size
        return self.start * size, self.end * size

    def grad_bytes(self) -> tuple[int, int]:
        size = self.owner.grad_element_size
        return self.start * size, self.end * size

    def __repr__(self) -> str:
        return (
            f"SharedBucket(id={self.bucket_id}, range=[{self.start}, {self.end}), "
            f"state={self.state.value}, params={len(self.params)})"
        )


def _resolve_dp(dp_group: Any) -> tuple[bool, int, int]:
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_world_size(dp_group), dist.get_rank(dp_group)
    if dp_group is not None:
        raise ValueError("dp_group was given but torch.distributed is not initialized")
    return False, 1, 0


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (an alias counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class MXFP8ParamGradBuffer:
    """Param/grad buffers for a distributed-optimizer model with MXFP8 weights.

    ``params``: :class:`MXFP8Parameter` or plain (non-quantized) tensors, in
    registration order. With ``config.reuse_grad_buf_for_mxfp8_param_ag`` (and
    at least one MXFP8 param, as production) param and grad data share one
    allocation; otherwise they are separate. Grads are fp32 with
    ``config.grad_reduce_in_fp32``, else bf16. A non-quantized param's
    ``data`` becomes a view into ``param_data`` (production's mapping).
    """

    def __init__(
        self,
        params: Sequence[Param],
        *,
        config: DDPConfig,
        dp_group: Any = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if not isinstance(config, DDPConfig):
            raise TypeError(f"config must be a DDPConfig, got {type(config).__name__}")
        if not config.use_distributed_optimizer:
            raise ValueError(
                "config.use_distributed_optimizer must be True: params are all-gathered "
                "from fp32 master shards"
            )
        self.params = list(params)
        if not self.params:
            raise ValueError("params must contain at least one parameter")
        for i, p in enumerate(self.params):
            if not isinstance(p, MXFP8Parameter | torch.Tensor):
                raise TypeError(
                    f"params[{i}] must be an MXFP8Parameter or a torch.Tensor, "
                    f"got {type(p).__name__}"
                )
            if isinstance(p, torch.Tensor) and p.dtype != PARAM_DTYPE:
                raise TypeError(f"params[{i}] (non-quantized) must be bfloat16, got {p.dtype}")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("params must not list a parameter twice")
        self.config = config
        self.dp_group = dp_group
        self.distributed, self.dp_size, self.dp_rank = _resolve_dp(dp_group)
        self.strategy = select_reduce_strategy(config, distributed=self.distributed)
        self.grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else torch.bfloat16
        self.grad_element_size = torch.empty((), dtype=self.grad_dtype).element_size()
        self.param_element_size = torch.empty((), dtype=PARAM_DTYPE).element_size()
        self.sharing = config.reuse_grad_buf_for_mxfp8_param_ag and any(
            isinstance(p, MXFP8Parameter) for p in self.params
        )
        self.layout: BufferLayout = compute_layout(
            [p.numel() for p in self.params],
            dp_size=self.dp_size,
            bucket_size=config.resolved_bucket_size(self.dp_size),
            use_distributed_optimizer=True,
            pad_buckets_for_high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
        )
        numel = self.layout.numel
        self.numel = numel
        if self.sharing:
            self.shared_buffer = torch.zeros(numel, dtype=self.grad_dtype, device=device)
            self.grad_data = self.shared_buffer
            if self.grad_dtype == torch.float32:
                # ceil(numel/2) fp32 elements hold numel bf16 values (numel is even
                # with the distributed optimizer, but production writes ceil).
                half = self.shared_buffer[: math.ceil(numel / 2)]
                self.param_data = half.view(PARAM_DTYPE)[:numel]
            else:
                self.param_data = self.shared_buffer
        else:
            self.shared_buffer = None
            self.grad_data = torch.zeros(numel, dtype=self.grad_dtype, device=device)
            self.param_data = torch.zeros(numel, dtype=PARAM_DTYPE, device=device)

        self._range: dict[int, tuple[int, int]] = {
            id(p): (int(s), int(e))
            for p, s, e in zip(self.params, self.layout.param_starts, self.layout.param_ends)
        }
        self.main_grad: dict[int, torch.Tensor] = {}
        for p in self.params:
            start, end = self._range[id(p)]
            self.main_grad[id(p)] = self.grad_data[start:end].view(self._shape(p))
        bucket_params: list[list[Param]] = [[] for _ in self.layout.bucket_indices]
        for p, b in zip(reversed(self.params), reversed(self.layout.param_bucket_ids.tolist())):
            bucket_params[b].append(p)
        self.buckets = [
            SharedBucket(self, b, start, end, bucket_params[b], self._range)
            for b, (start, end) in enumerate(self.layout.bucket_indices)
        ]
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self.grads_pending = False  # grads written since zero_grad and not yet consumed
        self.grads_reduced = False
        # Production's mapping of non-quantized params: param.data is a view into param_data.
        for p in self.params:
            if isinstance(p, torch.Tensor):
                start, end = self._range[id(p)]
                view = self.param_data[start:end].view(p.shape)
                view.copy_(p.data)
                p.data = view
                self._bucket_of[id(p)].state = (
                    RegionState.LIVE if self.sharing else RegionState.FREE
                )

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _shape(p: Param) -> tuple[int, ...]:
        return tuple(p.shape)

    def bucket_of(self, param: Param) -> SharedBucket:
        """The bucket holding ``param``; a ValueError for a param not in this buffer."""
        try:
            return self._bucket_of[id(param)]
        except KeyError:
            raise ValueError("param is not in this buffer") from None

    def param_range(self, param: Param) -> tuple[int, int]:
        """``(start, end)`` of ``param`` in the buffer, in elements."""
        self.bucket_of(param)
        return self._range[id(param)]

    def allocated_bytes(self) -> int:
        """Bytes held by the param and grad allocations, measured from their storages."""
        return storage_bytes([self.grad_data, self.param_data])

    def expected_bytes(self) -> int:
        """What :meth:`allocated_bytes` must be: grads, plus bf16 params unless shared."""
        grads = self.numel * self.grad_element_size
        return grads if self.sharing else grads + self.numel * self.param_element_size

    def _live_conflicts(self, byte_range: tuple[int, int]) -> list[SharedBucket]:
        """Buckets whose live param bytes overlap ``byte_range`` of the shared allocation."""
        if not self.sharing:
            return []
        return [
            b
            for b in self.buckets
            if (live := b.live_param_bytes()) is not None and _overlaps(live, byte_range)
        ]

    def _refuse_live(self, action: str, byte_range: tuple[int, int]) -> None:
        conflicts = self._live_conflicts(byte_range)
        if conflicts:
            b = conflicts[0]
            reason = (
                "it keeps a non-quantized param that lives in the buffer"
                if b.state is RegionState.LIVE
                else f"its params are {b.state.value} and not yet copied out and zeroed"
            )
            raise LifecycleError(
                f"{action} would overwrite live params: bytes {byte_range} of the shared "
                f"param/grad buffer overlap bucket {b.bucket_id}'s param bytes "
                f"{b.live_param_bytes()} ({reason})"
            )

    # ------------------------------------------------------------------ grads
    def zero_grad(self) -> None:
        """Zero the grad buffer; refused while any bucket holds live params (sharing)."""
        self._refuse_live("zero_grad", (0, self.numel * self.grad_element_size))
        self.grad_data.zero_()
        self.grads_pending = False
        self.grads_reduced = False
        if self.sharing:
            for bucket in self.buckets:
                bucket.shard_fresh = False  # the param shards were zeroed with the grads

    def main_grad_of(self, param: Param) -> torch.Tensor:
        """The ``main_grad`` view of ``param`` in the grad buffer."""
        self.bucket_of(param)
        return self.main_grad[id(param)]

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
        start, end = self._range[id(param)]
        size = self.grad_element_size
        self._refuse_live(
            f"accumulate_grad for a param of bucket {bucket.bucket_id}", (start * size, end * size)
        )
        self.main_grad[id(param)].add_(grad)
        self.grads_pending = True

    def reduce_grads(self) -> None:
        """Reduce-scatter every bucket (synchronously, bucket by bucket)."""
        if self.grads_reduced:
            raise LifecycleError("reduce_grads called twice without an optimizer step between")
        for bucket in self.buckets:
            self._refuse_live(f"reduce-scatter of bucket {bucket.bucket_id}", bucket.grad_bytes())
        for bucket in self.buckets:
            handle = self.strategy.launch(bucket)
            if handle is not None:
                handle.wait()
        self.grads_reduced = True

    def consume_grads(self) -> None:
        """Called by the optimizer after it used the reduced shards."""
        if not self.grads_reduced:
            raise LifecycleError("optimizer step before reduce_grads: the grad shards are unreduced")
        self.grads_pending = False
        self.grads_reduced = False
        for bucket in self.buckets:
            bucket.shard_fresh = False  # the master shard moved; param shards are stale

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
            if bucket.state in (RegionState.GATHERING,):
                raise LifecycleError(f"bucket {bucket.bucket_id} has an all-gather in flight")
        for bucket, master in zip(self.buckets, master_shards):
            bucket.local_param_shard.copy_(master)
            bucket.shard_fresh = True
            if bucket.state is RegionState.FREE:
                bucket.state = RegionState.STAGED

    def start_param_gather(self, bucket: SharedBucket, *, force_sync: bool = False) -> None:
        """Launch the all-gather of ``bucket``'s params into ``bucket.param_data``.

        ``force_sync`` marks a sync outside the normal iteration (e.g. a checkpoint);
        both need a local shard re-staged from the master params since it was zeroed
        (sharing) or since the last optimizer step.
        """
        if not bucket.shard_fresh:
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
        if bucket.state is RegionState.GATHERING:
            raise LifecycleError(f"bucket {bucket.bucket_id} already has an all-gather in flight")
        if self.sharing and self.grads_pending:
            raise LifecycleError(
                f"all-gather of bucket {bucket.bucket_id} would overwrite unconsumed grads "
                "(param and grad share memory)"
            )
        if self.distributed and self.dp_size > 1:
            bucket._gather_handle = all_gather_into(
                bucket.param_data, bucket.local_param_shard, group=self.dp_group, async_op=True
            )
        bucket.state = RegionState.GATHERING

    def finish_param_gather(self, bucket: SharedBucket) -> None:
        """Wait for the all-gather, copy the params out, and (sharing) zero the bucket's params."""
        if bucket.state is not RegionState.GATHERING:
            raise LifecycleError(
                f"finish_param_gather on bucket {bucket.bucket_id}: no all-gather in flight "
                f"(state {bucket.state.value})"
            )
        handle, bucket._gather_handle = bucket._gather_handle, None
        if handle is not None:
            handle.wait()
        bucket.state = RegionState.GATHERED
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
        readable = (RegionState.GATHERED, RegionState.LIVE)
        if self.sharing and bucket.state not in readable:
            raise LifecycleError(
                f"reading gathered params of bucket {bucket.bucket_id} in state "
                f"{bucket.state.value}: the bucket was zeroed for gradient accumulation "
                "after its params were copied out (or was never gathered)"
            )
        start, end = self._range[id(param)]
        return self.param_data[start:end].view(self._shape(param))

    def copy_params_from_buffer(self, bucket: SharedBucket) -> None:
        """Quantize the gathered slices into the MXFP8 params; then zero the bucket (sharing).

        A bucket holding a non-quantized param is not zeroed: that param's data
        lives in the buffer (production's rule), so the bucket stays LIVE.
        """
        if bucket.state is not RegionState.GATHERED:
            raise LifecycleError(
                f"copying params out of bucket {bucket.bucket_id} in state {bucket.state.value}: "
                "its gathered params are gone (zeroed or never gathered); copying now would "
                "write zeros/grads into the MXFP8 params"
            )
        for p in bucket.params:
            if isinstance(p, MXFP8Parameter):
                start, end = bucket.param_to_index[id(p)]
                p.copy_from(bucket.param_data[start:end])
        if not self.sharing:
            return  # separate buffers: the gathered params stay valid
        if bucket.holds_non_quantized:
            bucket.state = RegionState.LIVE
            return
        bucket.param_data.zero_()
        bucket.state = RegionState.FREE
        bucket.shard_fresh = False

    def __repr__(self) -> str:
        return (
            f"MXFP8ParamGradBuffer(sharing={self.sharing}, grad_dtype={self.grad_dtype}, "
            f"numel={self.numel}, buckets={len(self.buckets)})"
        )


class ShardedOptimizer:
    """A distributed optimizer: fp32 master shards per bucket, SGD or Adam on the local shard."""

    KINDS = ("sgd", "adam")

    def __init__(
        self,
        buffer: MXFP8ParamGradBuffer,
        *,
        kind: str = "sgd",
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        if not (isinstance(lr, float) and 0 < lr < math.inf):
            raise ValueError(f"lr must be a positive finite float, got {lr!r}")
        if len(betas) != 2 or not all(isinstance(b, float) and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
        if not (isinstance(eps, float) and 0 < eps < math.inf):
            raise ValueError(f"eps must be a positive finite float, got {eps!r}")
        self.buffer = buffer
        self.kind = kind
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.step_count = 0
        self.master_shards: list[torch.Tensor] = []
        for bucket in buffer.buckets:
            lo, hi = bucket.local_shard_range
            master = torch.zeros(hi - lo, dtype=torch.float32, device=buffer.grad_data.device)
            for p in bucket.params:
                start, end = buffer.param_range(p)
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    values = p.dequantize(torch.float32) if isinstance(p, MXFP8Parameter) else p.float()
                    master[a - lo : b - lo] = values.reshape(-1)[a - start : b - start]
            self.master_shards.append(master)
        self.exp_avg = [torch.zeros_like(m) for m in self.master_shards]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master_shards]

    def step(self) -> None:
        """Update every master shard from the reduced local grad shard."""
        if not self.buffer.grads_reduced:
            raise LifecycleError(
                "optimizer step before reduce_grads: the grad shards are unreduced"
            )
        self.step_count += 1
        beta1, beta2 = self.betas
        for i, bucket in enumerate(self.buffer.buckets):
            grad = bucket.local_grad_shard.float()
            master = self.master_shards[i]
            if self.kind == "sgd":
                master.sub_(grad * self.lr)
                continue
            self.exp_avg[i].mul_(beta1).add_(grad * (1 - beta1))
            self.exp_avg_sq[i].mul_(beta2).add_(grad * grad * (1 - beta2))
            m_hat = self.exp_avg[i] / (1 - beta1**self.step_count)
            v_hat = self.exp_avg_sq[i] / (1 - beta2**self.step_count)
            master.sub_(self.lr * m_hat / (v_hat.sqrt() + self.eps))
        self.buffer.consume_grads()

    def stage(self) -> None:
        """Copy the master shards into the buffer's param shards."""
        self.buffer.stage_master_params(self.master_shards)

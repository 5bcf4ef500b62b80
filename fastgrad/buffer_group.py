"""One (param dtype, grad dtype) group of a ``ParamAndGradBuffer``: its buffers and buckets.

``BufferGroup``
    ``.param_dtype``, ``.grad_dtype``, ``.key``, ``.params`` (registration order),
    ``.layout`` (``fastgrad.layout.BufferLayout``), ``.grad_data``,
    ``.param_data`` (distributed optimizer only, else None), ``.buckets``,
    ``.numel``, ``.numel_unpadded``, ``.param_range(param)``, ``.padding_mask()``,
    ``.shares_param_and_grad_memory`` (MXFP8 sharing mode, see ``fastgrad.buffer``).
``aligned_zeros(numel, dtype, device)``: a zero buffer 64-element aligned in memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fastgrad.averaging import GradAveraging
from fastgrad.bucket import Bucket, GradReduceStrategy
from fastgrad.layout import PARAM_START_ALIGNMENT, BufferLayout, compute_layout
from fastgrad.mxfp8 import MXFP8Parameter
from gradvocab import DDPConfig, ParallelDims

ALIGNMENT_ELEMENTS = PARAM_START_ALIGNMENT  # storage addresses of param views: 64 elements


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
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params: list[Any],
        *,
        config: DDPConfig,
        parallel_dims: ParallelDims,
        strategy: GradReduceStrategy,
        registration_index: Mapping[Any, int],
        averaging: GradAveraging,
        device: torch.device,
        mxfp8_params: bool = False,
    ) -> None:
        self.config = config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.key = (param_dtype, grad_dtype)
        self.params = params
        self.mxfp8_params = mxfp8_params
        shared_embedding = [
            i for i, p in enumerate(params) if getattr(p, "shared_embedding", False)
        ]
        self.layout: BufferLayout = compute_layout(
            [p.numel() for p in params],
            dp_size=parallel_dims.dp_size,
            bucket_size=config.resolved_bucket_size(parallel_dims.dp_size),
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
        self.shares_param_and_grad_memory = (
            mxfp8_params
            and config.reuse_grad_buf_for_mxfp8_param_ag
            and any(isinstance(p, MXFP8Parameter) for p in params)
        )
        self.grad_data, self.param_data = self._allocate(device)
        for p in params:
            start, end = self._range[p]
            old_main_grad = getattr(p, "main_grad", None)
            main_grad = self.grad_data[start:end].view(p.shape)
            if old_main_grad is not None:
                main_grad.copy_(old_main_grad)
            p.main_grad = main_grad
            if self.param_data is not None and isinstance(p, torch.Tensor):
                new_data = self.param_data[start:end].view(p.shape)
                new_data.copy_(p.data)
                p.data = new_data
        bucket_params: list[list[Any]] = [[] for _ in self.layout.bucket_indices]
        for p, b in zip(reversed(params), reversed(self.layout.param_bucket_ids.tolist())):
            bucket_params[b].append(p)
        self.buckets = [
            Bucket(
                self,
                b,
                start,
                end,
                unpadded,
                bucket_params[b],
                parallel_dims=parallel_dims,
                strategy=strategy,
                registration_index=registration_index,
                averaging=averaging,
            )
            for b, ((start, end), unpadded) in enumerate(
                zip(self.layout.bucket_indices, self.layout.per_bucket_numel_unpadded)
            )
        ]
        self._padding_mask: torch.Tensor | None = None
        self._verify(parallel_dims.dp_size)

    def _allocate(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(grad_data, param_data)``; param_data only with the distributed optimizer."""
        if not self.mxfp8_params:
            grad_data = aligned_zeros(self.numel, self.grad_dtype, device)
            if not self.config.use_distributed_optimizer:
                return grad_data, None
            return grad_data, aligned_zeros(self.numel, self.param_dtype, device)
        if not self.shares_param_and_grad_memory:
            return (
                torch.zeros(self.numel, dtype=self.grad_dtype, device=device),
                torch.zeros(self.numel, dtype=self.param_dtype, device=device),
            )
        shared = torch.zeros(self.numel, dtype=self.grad_dtype, device=device)
        if self.grad_dtype == self.param_dtype:
            return shared, shared
        # ceil(numel / 2) fp32 elements hold numel bf16 values (numel is even with
        # the distributed optimizer, but production writes ceil).
        half = shared[: math.ceil(self.numel / 2)]
        return shared, half.view(self.param_dtype)[: self.numel]

    def param_range(self, param: Any) -> tuple[int, int]:
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

    def _verify(self, dp: int) -> None:
        """Production's invariants, re-checked on the real tensors."""
        config = self.config
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
        if config.use_distributed_optimizer and not self.mxfp8_params:
            for p in self.params:
                for view in (p.main_grad, p.data):
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

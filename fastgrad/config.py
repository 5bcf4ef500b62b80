"""Data-parallel buffer configuration, with production's (Megatron-Core) field names.

``DDPConfig`` validates itself on construction: every field has a fixed type, and
combinations production accepts but then miscomputes are refused with a
ValueError naming the fields and the rule.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields

from gradvocab import default_bucket_size

_BOOL_FIELDS = (
    "use_distributed_optimizer",
    "pad_buckets_for_high_nccl_busbw",
    "grad_reduce_in_fp32",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "reduce_scatter_with_fp32_accumulation",
    "average_in_collective",
    "fp8_param_gather",
    "reuse_grad_buf_for_mxfp8_param_ag",
)


@dataclass(frozen=True)
class DDPConfig:
    """How gradients are bucketed, padded and reduced across data-parallel ranks.

    Fields (production names):
      use_distributed_optimizer: shard optimizer state; buckets are padded and
        reduce-scattered (otherwise all-reduced, no padding).
      bucket_size: elements per bucket before padding; None = the default,
        :func:`gradvocab.default_bucket_size` (``max(40_000_000, 1_000_000 * dp)``). Only
        used with overlap_grad_reduce; without it everything goes in one bucket, as in
        production.
      pad_buckets_for_high_nccl_busbw: pad bucket ends to ``lcm(dp, 128, 2**16)``
        instead of ``lcm(dp, 128)`` (no effect without the distributed optimizer).
      grad_reduce_in_fp32: main_grad is fp32 regardless of the param dtype.
      overlap_grad_reduce / overlap_param_gather: launch collectives
        asynchronously per bucket while compute continues.
      reduce_scatter_with_fp32_accumulation: reduce-scatter 16-bit grads through
        an all-to-all and accumulate in fp32 (fastgrad.reduce_scatter).
      average_in_collective: average (not sum) in the collective.
      fp8_param_gather / reuse_grad_buf_for_mxfp8_param_ag: MXFP8 param
        all-gather, optionally through the grad buffer's memory.
    """

    use_distributed_optimizer: bool = False
    bucket_size: int | None = None
    pad_buckets_for_high_nccl_busbw: bool = False
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"DDPConfig.{name} must be a bool, got {type(value).__name__}")
        if self.bucket_size is not None:
            if isinstance(self.bucket_size, bool):
                raise TypeError("DDPConfig.bucket_size must be an int or None, got bool")
            try:
                size = operator.index(self.bucket_size)
            except TypeError:
                raise TypeError(
                    "DDPConfig.bucket_size must be an int or None, got "
                    f"{type(self.bucket_size).__name__}"
                ) from None
            if size <= 0:
                raise ValueError(f"DDPConfig.bucket_size must be > 0 or None, got {size}")
            object.__setattr__(self, "bucket_size", size)
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "DDPConfig.overlap_param_gather requires use_distributed_optimizer=True "
                "(params are only all-gathered from optimizer shards)"
            )
        if self.reduce_scatter_with_fp32_accumulation and not self.use_distributed_optimizer:
            raise ValueError(
                "DDPConfig.reduce_scatter_with_fp32_accumulation requires "
                "use_distributed_optimizer=True (without it grads are all-reduced, "
                "not reduce-scattered)"
            )
        if self.reuse_grad_buf_for_mxfp8_param_ag:
            missing = [
                name
                for name in (
                    "fp8_param_gather",
                    "use_distributed_optimizer",
                    "overlap_param_gather",
                    "overlap_grad_reduce",
                )
                if not getattr(self, name)
            ]
            if missing:
                raise ValueError(
                    "DDPConfig.reuse_grad_buf_for_mxfp8_param_ag requires "
                    + ", ".join(f"{m}=True" for m in missing)
                    + " (production silently produces NaN loss at iteration 2 otherwise: "
                    "the shared buffer is zeroed/overwritten while still in use)"
                )

    def resolved_bucket_size(self, dp_size: int) -> int | None:
        """Bucket size used for ``dp_size`` ranks; None means a single bucket.

        As production: None when overlap_grad_reduce is off, else ``bucket_size``
        or :func:`gradvocab.default_bucket_size`.
        """
        if isinstance(dp_size, bool) or not isinstance(dp_size, int):
            raise TypeError(f"dp_size must be an int, got {type(dp_size).__name__}")
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if not self.overlap_grad_reduce:
            return None
        if self.bucket_size is None:
            return default_bucket_size(dp_size)
        return self.bucket_size

    def to_dict(self) -> dict[str, object]:
        """The fields as a plain dict (for reports)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


__all__ = ["DDPConfig"]

"""The data-parallel settings, one type for every package: :class:`DDPConfig`.

Megatron-Core's ``DistributedDataParallelConfig`` field names (the ten that fastgrad
implements and the layout check varies), so a config maps onto Megatron-Core's with
``DistributedDataParallelConfig(**config.to_dict())``. It validates itself on construction:
every field has a fixed type, and the combinations Megatron-Core accepts but then
miscomputes are refused with a ValueError naming the fields and the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from gradvocab.averaging import Averaging
from gradvocab.bucket_size import default_bucket_size
from gradvocab.validation import int_at_least

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
# What reuse_grad_buf_for_mxfp8_param_ag needs: the grad buffer doubles as the MXFP8
# all-gather's, so it must be sharded, gathered and reduced in the overlapped schedule.
_MXFP8_SHARING_NEEDS = (
    "fp8_param_gather",
    "use_distributed_optimizer",
    "overlap_param_gather",
    "overlap_grad_reduce",
)


@dataclass(frozen=True)
class DDPConfig:
    """How gradients are bucketed, padded and reduced across data-parallel ranks.

    Fields (Megatron-Core's names):
      use_distributed_optimizer: shard optimizer state; buckets are padded and
        reduce-scattered (otherwise all-reduced, no padding).
      bucket_size: elements per bucket before padding; None = the default,
        :func:`gradvocab.default_bucket_size` (``max(40_000_000, 1_000_000 * dp)``). Only
        used with overlap_grad_reduce; without it everything goes in one bucket, as in
        Megatron-Core (:meth:`resolved_bucket_size`).
      pad_buckets_for_high_nccl_busbw: pad bucket ends to ``lcm(dp, 128, 2**16)``
        instead of ``lcm(dp, 128)`` (no effect without the distributed optimizer).
      grad_reduce_in_fp32: main_grad is fp32 regardless of the param dtype.
      overlap_grad_reduce / overlap_param_gather: launch collectives
        asynchronously per bucket while compute continues.
      reduce_scatter_with_fp32_accumulation: reduce-scatter 16-bit grads through
        an all-to-all and accumulate in fp32.
      average_in_collective: average (``ReduceOp.AVG``) in the collective instead of a
        ``1/dp`` gradient scaling factor before a SUM: Megatron-Core's spelling of
        ``Averaging.AVG`` (:meth:`resolve_averaging` holds the two together).
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
            object.__setattr__(self, "bucket_size", int_at_least(
                self.bucket_size, "DDPConfig.bucket_size", 1, expected="an int or None",
                rule="positive (> 0) or None"))
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
            missing = [name for name in _MXFP8_SHARING_NEEDS if not getattr(self, name)]
            if missing:
                raise ValueError(
                    "DDPConfig.reuse_grad_buf_for_mxfp8_param_ag requires "
                    + ", ".join(f"{m}=True" for m in missing)
                    + " (Megatron-Core silently produces NaN loss at iteration 2 otherwise: "
                    "the shared buffer is zeroed/overwritten while still in use)"
                )

    def resolved_bucket_size(self, dp_size: int) -> int | None:
        """Elements per bucket of a buffer reduced over ``dp_size`` ranks; None: one bucket.

        As Megatron-Core's ``DistributedDataParallel.__init__``: None without
        ``overlap_grad_reduce``, else ``bucket_size`` or :func:`gradvocab.default_bucket_size`.
        """
        default = default_bucket_size(dp_size)  # also the one check of dp_size
        if not self.overlap_grad_reduce:
            return None
        return default if self.bucket_size is None else self.bucket_size

    def resolve_averaging(self, averaging: Averaging | None) -> Averaging:
        """How DP grads are combined under this config: ``averaging``, or, for None,
        Megatron-Core's default (``Averaging.from_megatron`` of ``average_in_collective``:
        ``AVG`` with it, ``PRESCALE`` without).

        A bool is refused (TypeError: it does not say how); so is a way that contradicts
        ``average_in_collective`` (ValueError: ``AVG`` exactly when it is set, as
        ``Averaging.megatron_flags`` spells it) and ``POSTSCALE`` (no Megatron-Core flags).
        """
        if averaging is None:
            return Averaging.from_megatron(average=True,
                                           average_in_collective=self.average_in_collective)
        if not isinstance(averaging, Averaging):
            raise TypeError(
                f"averaging must be a gradvocab.Averaging or None, got {type(averaging).__name__} "
                f"{averaging!r} (a bool does not say how: Averaging.SUM sums, Averaging.PRESCALE "
                "or Averaging.AVG average, None is Megatron-Core's default)")
        if averaging.megatron_flags().average_in_collective != self.average_in_collective:
            raise ValueError(
                f"averaging={averaging} contradicts DDPConfig.average_in_collective="
                f"{self.average_in_collective}: Averaging.AVG averages in the collective, "
                "and only it")
        return averaging

    def to_dict(self) -> dict[str, object]:
        """The fields as a plain dict (for reports, and for Megatron-Core's own config)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


__all__ = ["DDPConfig"]

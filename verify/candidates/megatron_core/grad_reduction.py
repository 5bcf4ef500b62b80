"""Megatron-Core's DP gradient reduction behind :mod:`verify.candidates.interfaces`.

Megatron-Core's own code, unmodified:

* the collective is ``megatron.core.distributed.reduce_scatter_with_fp32_accumulation.
  reduce_scatter_with_fp32_accumulation`` (16-bit all-to-all, fp32 sum, one rounding). It
  takes ``ReduceOp.SUM`` only (``assert op == torch.distributed.ReduceOp.SUM``, as its
  docstring says), so AVG is Unsupported here; a caller's scratch exists only where the
  installed version has ``all_to_all_output_tensor``;
* its local step is the work handle's ``wait`` (``_ReduceScatterWithFP32AccumulationWorkHandle``:
  ``torch.sum(shards, dim=0, dtype=torch.float32)``, copied into the output), called with the
  received shards;
* a bucket is reduced by Megatron's ``DistributedDataParallel`` over one parameter of the
  bucket's size, built on the check's DP group through a ``ProcessGroupCollection`` (its
  tensor, pipeline and expert groups are this rank alone): the bucket's ``grad_data`` is
  filled with the rank's grads and ``start_grad_sync`` / ``finish_grad_sync`` run
  ``_ParamAndGradBucketGroup``'s reduction (the ``1/W`` pre-scale of ``gradient_scaling_factor``
  or ``ReduceOp.AVG``, then ``dist_reduce_scatter_func`` / ``all_reduce``). The config's
  ``Averaging`` becomes Megatron's flags (``ReductionConfig.megatron_flags``): ``SUM`` is
  ``TransformerConfig.calculate_per_token_loss`` (no pre-scale).

Everything runs inside the interface's ``with`` block (:class:`~verify.candidates.megatron_core.scope.MegatronScope`:
the CPU redirects on a machine without CUDA).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gradvocab import Averaging, ParallelDims
from verify.candidates.interfaces import (
    SUM,
    BucketReduction,
    Completion,
    GradReduction,
    LocalReduction,
    ReduceScatter,
    ReductionConfig,
    ScratchReduceScatter,
    Technique,
    Unsupported,
)
from verify.candidates.megatron_core.process_groups import megatron_process_groups
from verify.candidates.megatron_core.scope import MegatronScope
from verify.candidates.megatron_core.version import installed

FP32_RS = "megatron.core.distributed.reduce_scatter_with_fp32_accumulation"
ONLY_SUM = ("takes ReduceOp.SUM only in its reduce_scatter_with_fp32_accumulation (`assert op == "
            "torch.distributed.ReduceOp.SUM`, as its docstring says); its DDP averages by "
            "pre-scaling the bucket instead (the DDP bucket cases)")


def _unsupported(reason: str) -> Unsupported:
    return Unsupported(Technique.GRAD_REDUCTION, f"megatron-core {reason}")


def _require_fp32_reduce_scatter() -> None:
    """Unsupported where the installed version has no fp32-accumulating reduce-scatter."""
    reason = installed().skip_reason("reduce_scatter_with_fp32_accumulation")
    if reason is not None:
        raise _unsupported(f"{installed().version}: {reason}")


@dataclass(frozen=True)
class MegatronFP32ReduceScatter(ReduceScatter):
    """Megatron-Core's ``reduce_scatter_with_fp32_accumulation``, called as published (SUM only:
    Megatron asserts it; DDP averages by pre-scaling the bucket instead)."""

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *,  # noqa: A002
                 group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType,
                 async_op: bool = False) -> Completion | None:
        from megatron.core.distributed.reduce_scatter_with_fp32_accumulation import (
            reduce_scatter_with_fp32_accumulation,
        )

        return reduce_scatter_with_fp32_accumulation(output, input, op=op, group=group,
                                                     async_op=async_op)


@dataclass(frozen=True)
class MegatronScratchReduceScatter(ScratchReduceScatter):
    """The same, with the caller's all-to-all buffer (``all_to_all_output_tensor``), in the
    versions that have it."""

    def __call__(self, output: torch.Tensor, input: torch.Tensor, scratch: torch.Tensor, *,  # noqa: A002
                 group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType,
                 async_op: bool = False) -> Completion | None:
        from megatron.core.distributed.reduce_scatter_with_fp32_accumulation import (
            reduce_scatter_with_fp32_accumulation,
        )

        return reduce_scatter_with_fp32_accumulation(output, input, op=op, group=group,
                                                     async_op=async_op,
                                                     all_to_all_output_tensor=scratch)


@dataclass(frozen=True)
class MegatronLocalReduction(LocalReduction):
    """The fp32 step of Megatron's work handle (``wait`` with the all-to-all already done)."""

    def __call__(self, shards: torch.Tensor, output: torch.Tensor, *,
                 op: dist.ReduceOp.RedOpType) -> None:
        from megatron.core.distributed.reduce_scatter_with_fp32_accumulation import (
            _ReduceScatterWithFP32AccumulationWorkHandle,
        )

        if Averaging.from_reduce_op(op) is not Averaging.SUM:
            raise _unsupported(ONLY_SUM)
        world = shards.shape[0]
        _ReduceScatterWithFP32AccumulationWorkHandle(None, shards.reshape(-1), output.view(-1),
                                                     world).wait()


class _OneParameter(torch.nn.Module):
    """A module holding one flat parameter: Megatron's DDP lays its grad buffer out as one bucket."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))


def model_config(**kwargs):
    """A minimal ``TransformerConfig`` for wrapping non-transformer modules in Megatron's DDP
    (CPU initialisation), without its construction-time deprecation notice (a default of
    TransformerConfig's CUDA-graph settings: noise in every rank's stderr)."""
    from megatron.core.transformer import TransformerConfig

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                 use_cpu_initialization=True, **kwargs)


def own_rank_group(cache: dict) -> dist.ProcessGroup:
    """This rank alone, as a group (its tensor, pipeline and expert groups in a DP-only grid);
    made once per process with local synchronisation, so no other rank takes part."""
    rank = dist.get_rank()
    if rank not in cache:
        cache[rank] = dist.new_group([rank], use_local_synchronization=True)
    return cache[rank]


def data_parallel_groups(group: dist.ProcessGroup | None, cache: dict):
    """A ``ProcessGroupCollection`` for a DP-only grid on ``group`` (None: the world); its
    size-1 groups (tensor, pipeline, expert) are a real group of this rank alone, made once
    per process (:func:`own_rank_group`)."""
    return megatron_process_groups(ParallelDims.data_parallel(group),
                                   alone=own_rank_group(cache))


@dataclass(frozen=True)
class MegatronBucketReduction(BucketReduction):
    """Megatron's ``DistributedDataParallel`` over a one-parameter module per (group, dtype,
    size): the bucket's ``grad_data`` holds the grads, ``start_grad_sync`` /
    ``finish_grad_sync`` reduce it. ``ddp_class``: the DDP class (tests plant a bug in a
    subclass of Megatron's)."""

    config: ReductionConfig
    ddp_class: type | None = None
    _built: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _alone: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _ddp(self, grads: torch.Tensor, group: dist.ProcessGroup | None):
        key = (id(group), grads.dtype, grads.numel())
        if key not in self._built:
            from megatron.core.distributed import (
                DistributedDataParallel,
                DistributedDataParallelConfig,
            )

            config = self.config
            flags = config.megatron_flags()
            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=config.use_distributed_optimizer,
                overlap_grad_reduce=config.overlap_grad_reduce, bucket_size=None,
                average_in_collective=flags.average_in_collective,
                reduce_scatter_with_fp32_accumulation=config.reduce_scatter_with_fp32_accumulation)
            module = _OneParameter(grads.numel(), grads.dtype)
            ddp_class = self.ddp_class or DistributedDataParallel
            self._built[key] = ddp_class(model_config(calculate_per_token_loss=flags.calculate_per_token_loss),
                                         ddp_config, module,
                                         pg_collection=data_parallel_groups(group, self._alone))
        return self._built[key]

    def __call__(self, grads: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
        ddp = self._ddp(grads, group)
        (buffer,) = ddp.buffers
        if buffer.grad_data.numel() != grads.numel() or len(buffer.buckets) != 1:
            raise ValueError(f"Megatron laid the bucket out as {len(buffer.buckets)} bucket(s) of "
                             f"{buffer.grad_data.numel()} elements (grads: {grads.numel()}); sizes "
                             "must be multiples of 128 * W")
        ddp.zero_grad_buffer()
        buffer.grad_data.copy_(grads)
        ddp.start_grad_sync()  # what the backward hooks do once every grad of the bucket is in
        ddp.finish_grad_sync()
        if not self.config.use_distributed_optimizer:
            return buffer.grad_data.clone()
        size = buffer.data_parallel_world_size
        shard = grads.numel() // size
        rank = buffer.data_parallel_group.rank()
        return buffer.grad_data[rank * shard:(rank + 1) * shard].clone()


@dataclass(frozen=True)
class MegatronGradReduction(MegatronScope, GradReduction):
    """The seam's ``GradReduction`` for Megatron-Core (module docstring). ``ddp_class``: the
    DDP class its bucket reductions build (a test's broken copy of Megatron's)."""

    ddp_class: type | None = None

    def reduce_scatter(self, op: dist.ReduceOp.RedOpType = SUM) -> ReduceScatter:
        _require_fp32_reduce_scatter()
        if Averaging.from_reduce_op(op) is not Averaging.SUM:
            raise _unsupported(ONLY_SUM)
        return MegatronFP32ReduceScatter()

    def scratch_reduce_scatter(self, op: dist.ReduceOp.RedOpType = SUM) -> ScratchReduceScatter:
        _require_fp32_reduce_scatter()
        if Averaging.from_reduce_op(op) is not Averaging.SUM:
            raise _unsupported(ONLY_SUM)
        reason = installed().skip_reason("fp32_rs_caller_scratch")
        if reason is not None:
            raise _unsupported(f"{installed().version}: {reason}")
        return MegatronScratchReduceScatter()

    def local_reduction(self, op: dist.ReduceOp.RedOpType = SUM) -> LocalReduction:
        _require_fp32_reduce_scatter()
        if Averaging.from_reduce_op(op) is not Averaging.SUM:
            raise _unsupported(ONLY_SUM)
        return MegatronLocalReduction()

    def bucket_reduction(self, config: ReductionConfig) -> BucketReduction:
        if config.reduce_scatter_with_fp32_accumulation:
            _require_fp32_reduce_scatter()
        return MegatronBucketReduction(config, self.ddp_class)



__all__ = ["MegatronBucketReduction", "MegatronFP32ReduceScatter",
           "MegatronGradReduction", "MegatronLocalReduction", "MegatronScratchReduceScatter",
           "data_parallel_groups", "model_config", "own_rank_group"]

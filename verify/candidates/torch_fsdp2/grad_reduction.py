"""FSDP2's gradient reduction behind :mod:`verify.candidates.interfaces`.

Parameters of the check's shapes under ``fully_shard`` with a ``MixedPrecisionPolicy``
(``sharding``); each microbatch's grads come from autograd (the forward is
``sum(p * c)``), the grad sync only on the last one (``set_requires_gradient_sync``), and
FSDP2's ``foreach_reduce`` reduce-scatters them in the backward: cast to ``reduce_dtype``,
averaged as ``_get_gradient_divide_factors`` decides (``ReduceOp.AVG`` for fp32 and bf16,
a pre- and a post-division for fp16), cast to the sharded parameter's dtype. A SUM is
``set_gradient_divide_factor(1.0)``, FSDP2's own setting for it.

A DDP bucket is one 1-D parameter of the bucket's size (its shards are the bucket's).
FSDP2 reduce-scatters, never all-reduces whole grads, never pre-scales by ``1/W`` and has no
fp32-accumulating collective: those configurations are Unsupported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gradvocab import Averaging
from verify.candidates.interfaces import (
    SUM,
    BucketReduction,
    GradReduction,
    LocalReduction,
    ReduceScatter,
    ReductionConfig,
    ScratchReduceScatter,
    ShardedGradCase,
    ShardedReduction,
    Technique,
    Unsupported,
)
from verify.candidates.torch_fsdp2.sharding import Coefficients, dtype_named, mesh_of, policy

NO_COLLECTIVE = ("torch-fsdp2 has no fp32-accumulating reduce-scatter: "
                 "MixedPrecisionPolicy(reduce_dtype=torch.float32) casts the grads to fp32 "
                 "before the collective instead (the reduce_dtype cases)")


def refusal(config: ReductionConfig) -> str | None:
    """Why FSDP2 cannot reduce a bucket under ``config`` (None: it can)."""
    if not config.use_distributed_optimizer:
        return "torch-fsdp2 reduce-scatters the grads (no all-reduce of whole grads: torch-ddp)"
    if config.reduce_scatter_with_fp32_accumulation:
        return NO_COLLECTIVE
    if config.averaging is Averaging.PRESCALE:
        return ("torch-fsdp2 never pre-scales the grads by 1/W: it averages in the collective or "
                "by factors of W (_get_gradient_divide_factors; the AVG-in-the-collective cases)")
    return None


@dataclass(frozen=True)
class FSDP2Step(ShardedReduction):
    """A module of ``case``'s parameters under ``fully_shard`` per group; a call is one step.
    ``divide_factor``: FSDP2's ``set_gradient_divide_factor`` (None: its default, the mean)."""

    case: ShardedGradCase
    divide_factor: float | None = None
    _built: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _module(self, group: dist.ProcessGroup | None):
        if id(group) not in self._built:
            from torch.distributed.fsdp import fully_shard

            orig, param = dtype_named(self.case.orig_dtype), dtype_named(self.case.param_dtype)
            params = [torch.zeros(shape, dtype=orig) for shape in self.case.shapes]
            module = fully_shard(Coefficients(params), mesh=mesh_of(group),
                                 mp_policy=policy(None if param == orig else param,
                                                  dtype_named(self.case.reduce_dtype)))
            if self.divide_factor is not None:
                module.set_gradient_divide_factor(self.divide_factor)
            self._built[id(group)] = module
        return self._built[id(group)]

    def __call__(self, microbatch_grads: Sequence[Sequence[torch.Tensor]], *,
                 group: dist.ProcessGroup | None) -> list[torch.Tensor]:
        module = self._module(group)
        module.zero_grad(set_to_none=True)
        for m, grads in enumerate(microbatch_grads):
            module.set_requires_gradient_sync(m == len(microbatch_grads) - 1)
            module(list(grads)).backward()
        return [p.grad.to_local().detach().clone() for p in module.parameters()]


@dataclass(frozen=True)
class FSDP2BucketReduction(BucketReduction):
    """A bucket as one 1-D parameter under ``fully_shard``: its shards are the bucket's."""

    reduce_dtype: str | None = None
    divide_factor: float | None = None
    step_class: type[FSDP2Step] = FSDP2Step
    _steps: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __call__(self, grads: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
        dtype = str(grads.dtype).removeprefix("torch.")
        key = (dtype, grads.numel())
        if key not in self._steps:
            case = ShardedGradCase(((grads.numel(),),), dtype, dtype, self.reduce_dtype, 1)
            self._steps[key] = self.step_class(case, self.divide_factor)
        (shard,) = self._steps[key]([[grads]], group=group)
        return shard


class TorchFSDP2GradReduction(GradReduction):
    """FSDP2's reduce-scatter: per bucket, per ``reduce_dtype``, and over sharded parameters.
    ``step_class``: what builds and runs the sharded module (tests plant a bug in a subclass)."""

    step_class: type[FSDP2Step] = FSDP2Step

    def reduce_scatter(self, op: dist.ReduceOp.RedOpType = SUM) -> ReduceScatter:
        raise Unsupported(Technique.GRAD_REDUCTION, NO_COLLECTIVE)

    def scratch_reduce_scatter(self, op: dist.ReduceOp.RedOpType = SUM) -> ScratchReduceScatter:
        raise Unsupported(Technique.GRAD_REDUCTION, NO_COLLECTIVE)

    def local_reduction(self, op: dist.ReduceOp.RedOpType = SUM) -> LocalReduction:
        raise Unsupported(Technique.GRAD_REDUCTION, NO_COLLECTIVE)

    def bucket_reduction(self, config: ReductionConfig) -> BucketReduction:
        return self.reduce_in(config, None)

    def reduce_in(self, config: ReductionConfig, dtype: torch.dtype | None) -> BucketReduction:
        reason = refusal(config)
        if reason is not None:
            raise Unsupported(Technique.GRAD_REDUCTION, reason)
        return FSDP2BucketReduction(None if dtype is None else str(dtype).removeprefix("torch."),
                                    None if config.averaging.averages else 1.0, self.step_class)

    def sharded_reduction(self, case: ShardedGradCase) -> ShardedReduction:
        return self.step_class(case)


"""torch DDP's gradient reduction behind :mod:`verify.candidates.interfaces`.

A bucket is one parameter of the bucket's size in a ``torch.nn.parallel.DistributedDataParallel``
over the check's group; its grads are made by autograd (``(weight * grads).sum()``: the grad
is ``grads``) and the Reducer reduces them in the backward:

* by default (no hook) it multiplies each grad by ``1/W`` as it copies it into the bucket
  (``Reducer::mark_variable_ready_dense``, ``at::mul_out``) and all-reduces the bucket (SUM);
* :meth:`TorchDDPGradReduction.reduce_in` registers torch's ``fp16_compress_hook`` or
  ``bf16_compress_hook`` (``ddp_comm_hooks.default_hooks``): cast, divide by ``W``,
  all-reduce in 16 bits, cast back. DDP refuses ``bf16_compress_hook`` by its name without
  CUDA and NCCL 2.10 (``DistributedDataParallel._check_comm_hook``); on such a machine it is
  registered through a function of another name that calls it (``redirects`` in the report).

DDP all-reduces every bucket and always averages: the reduce-scatter, SUM and
``ReduceOp.AVG`` configurations, and its fp32-accumulating collectives, are Unsupported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gradvocab import Averaging
from verify.candidates.interfaces import (
    SUM,
    BucketReduction,
    GradReduction,
    LocalReduction,
    ReduceScatter,
    ReductionConfig,
    ScratchReduceScatter,
    Technique,
    Unsupported,
)

NO_COLLECTIVE = ("torch-ddp has no fp32-accumulating reduce-scatter: DDP all-reduces each bucket "
                 "in its own dtype")
HOOKS = {torch.float16: default_hooks.fp16_compress_hook,
         torch.bfloat16: default_hooks.bf16_compress_hook}


def forward_to_bf16_compress_hook(state, bucket):
    """torch's ``bf16_compress_hook``, under a name DDP does not refuse without CUDA/NCCL."""
    return default_hooks.bf16_compress_hook(state, bucket)


def registrable(hook: Callable) -> Callable:
    """``hook`` as DDP will register it here (the bf16 hook through its forwarder off CUDA)."""
    if hook is default_hooks.bf16_compress_hook and not torch.cuda.is_available():
        return forward_to_bf16_compress_hook
    return hook


def refusal(config: ReductionConfig) -> str | None:
    """Why DDP cannot reduce a bucket under ``config`` (None: it can)."""
    if config.use_distributed_optimizer:
        return ("torch-ddp all-reduces every bucket (no reduce-scatter: torch-fsdp2 shards "
                "the grads)")
    if config.averaging is Averaging.SUM:
        return "torch-ddp always averages over its process group (the Reducer's div_factor_)"
    if config.averaging is Averaging.AVG:
        return "torch-ddp averages before the all-reduce, never with ReduceOp.AVG"
    return None


class _OneParameter(torch.nn.Module):
    """One flat parameter; ``forward(grads)`` is ``sum(weight * grads)``: its grad is ``grads``."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))

    def forward(self, grads: torch.Tensor) -> torch.Tensor:
        return (self.weight * grads).sum()


@dataclass(frozen=True)
class TorchDDPBucketReduction(BucketReduction):
    """A ``DistributedDataParallel`` over one parameter per (group, dtype, size), with ``hook``
    registered (None: DDP's default reduction)."""

    hook: Callable | None = None
    _built: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _ddp(self, grads: torch.Tensor, group: dist.ProcessGroup | None):
        from torch.nn.parallel import DistributedDataParallel

        key = (id(group), grads.dtype, grads.numel())
        if key not in self._built:
            ddp = DistributedDataParallel(_OneParameter(grads.numel(), grads.dtype), process_group=group)
            if self.hook is not None:
                ddp.register_comm_hook(group, registrable(self.hook))
            self._built[key] = ddp
        return self._built[key]

    def __call__(self, grads: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
        ddp = self._ddp(grads, group)
        ddp.zero_grad(set_to_none=True)
        ddp(grads).backward()
        return ddp.module.weight.grad.detach().clone()


class TorchDDPGradReduction(GradReduction):
    """DDP's bucket all-reduce, plain or through its compress hooks (``hooks``: the hook per
    16-bit dtype; tests plant a bug in a copy of torch's)."""

    hooks: dict = HOOKS

    def reduce_scatter(self, op: dist.ReduceOp.RedOpType = SUM) -> ReduceScatter:
        raise Unsupported(Technique.GRAD_REDUCTION, NO_COLLECTIVE)

    def scratch_reduce_scatter(self, op: dist.ReduceOp.RedOpType = SUM) -> ScratchReduceScatter:
        raise Unsupported(Technique.GRAD_REDUCTION, NO_COLLECTIVE)

    def local_reduction(self, op: dist.ReduceOp.RedOpType = SUM) -> LocalReduction:
        raise Unsupported(Technique.GRAD_REDUCTION, NO_COLLECTIVE)

    def bucket_reduction(self, config: ReductionConfig) -> BucketReduction:
        reason = refusal(config)
        if reason is not None:
            raise Unsupported(Technique.GRAD_REDUCTION, reason)
        return TorchDDPBucketReduction()

    def reduce_in(self, config: ReductionConfig, dtype: torch.dtype) -> BucketReduction:
        reason = refusal(config)
        if reason is not None:
            raise Unsupported(Technique.GRAD_REDUCTION, reason)
        if dtype not in self.hooks:
            raise Unsupported(Technique.GRAD_REDUCTION,
                              f"torch-ddp's compress hooks cast to fp16 or bf16, not {dtype}")
        return TorchDDPBucketReduction(hook=self.hooks[dtype])


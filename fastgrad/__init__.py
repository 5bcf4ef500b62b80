"""fastgrad: Megatron-Core's data-parallel gradient machinery for a PyTorch training loop.

The public face is what a training loop needs (as FSDP2's ``torch.distributed.fsdp``
exports ``fully_shard`` and its policies, not its internals)::

    from fastgrad import DDPConfig, DistributedDataParallel, AdamWConfig, DistributedOptimizer

* wrapping: :class:`DistributedDataParallel` configured by :class:`DDPConfig`;
* stepping: :class:`DistributedOptimizer` (sharded fp32 masters) or
  :class:`ReplicatedOptimizer` (all-reduced grads), both ``torch.optim.Optimizer``
  subclasses, with :class:`AdamWConfig` / :class:`SGDConfig`,
  :func:`param_groups_without_decay_for`, :class:`DynamicLossScaler` (fp16) and
  :class:`StepResult`; :class:`ModelChunks` puts several model chunks under one optimizer;
* pipelines: :func:`build_parallel_groups` (:class:`ParallelGroups`),
  :func:`forward_backward_1f1b`, :func:`forward_backward_interleaved`, :func:`finalize_grads`;
* misuse: :class:`LifecycleError`.

The techniques' building blocks (buffers and buckets, the fp32-accumulating
reduce-scatter, deferred wgrad layers, MXFP8 params and buffers, timelines) stay
in their modules (``fastgrad.buffer``, ``fastgrad.reduce_scatter``,
``fastgrad.deferred_wgrad``, ``fastgrad.mxfp8_sharing``, ...); docs/DESIGN.md maps them.
"""

from fastgrad.config import DDPConfig
from fastgrad.ddp import DistributedDataParallel
from fastgrad.errors import LifecycleError
from fastgrad.optim import (
    AdamWConfig,
    DistributedOptimizer,
    DynamicLossScaler,
    ModelChunks,
    ReplicatedOptimizer,
    SGDConfig,
    StepResult,
    param_groups_without_decay_for,
)
from fastgrad.pipeline import (
    ParallelGroups,
    build_parallel_groups,
    finalize_grads,
    forward_backward_1f1b,
)
from fastgrad.pipeline_interleaved import forward_backward_interleaved

__all__ = [
    "AdamWConfig",
    "DDPConfig",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "LifecycleError",
    "ModelChunks",
    "ParallelGroups",
    "ReplicatedOptimizer",
    "SGDConfig",
    "StepResult",
    "build_parallel_groups",
    "finalize_grads",
    "forward_backward_1f1b",
    "forward_backward_interleaved",
    "param_groups_without_decay_for",
]

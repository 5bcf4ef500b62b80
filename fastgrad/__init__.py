"""fastgrad: Megatron-Core's data-parallel gradient machinery for a PyTorch training loop.

The public face is what a training loop needs (as FSDP2's ``torch.distributed.fsdp``
exports ``fully_shard`` and its policies, not its internals)::

    from fastgrad import DDPConfig, DistributedDataParallel, AdamWConfig, DistributedOptimizer

* wrapping: :class:`DistributedDataParallel` configured by :class:`DDPConfig` (gradvocab's,
  the one DDP settings type every package shares);
* stepping: :class:`DistributedOptimizer` (sharded fp32 masters) or
  :class:`ReplicatedOptimizer` (all-reduced grads), both ``torch.optim.Optimizer``
  subclasses, with :class:`AdamWConfig` / :class:`SGDConfig`,
  :func:`param_groups_without_decay_for`, :class:`DynamicLossScaler` (fp16, its settings a
  :class:`LossScaling`; the three settings types gradvocab's) and
  :class:`StepOutcome`; :class:`ModelChunks` puts several model chunks under one optimizer;
* the parallel grid: :class:`ParallelDims` (the TP/CP/DP/PP/VPP sizes; ``build()`` gives
  this rank's coordinates and process groups; ``ParallelDims.data_parallel(dp_group)``);
* pipelines: :func:`forward_backward_1f1b`, :func:`forward_backward_interleaved`, :func:`finalize_grads`;
* misuse: :class:`LifecycleError`.

The techniques' building blocks (buffers and buckets, the fp32-accumulating
reduce-scatter, deferred wgrad layers, MXFP8 params and buffers, timelines) stay
in their modules (``fastgrad.buffer``, ``fastgrad.reduce_scatter``,
``fastgrad.deferred_wgrad``, ``fastgrad.mxfp8_sharing``, ...); docs/DESIGN.md maps them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The public names, each from the module that defines it (the shared vocabulary's from
# gradvocab). They are imported on first use (PEP 562), so importing one building block
# (``fastgrad.timeline``, ``fastgrad.reduce_scatter``) does not load the DDP, optimizer and kernels.
_PUBLIC = {
    "DDPConfig": "gradvocab",
    "DistributedDataParallel": "fastgrad.ddp",
    "LifecycleError": "gradvocab",
    "AdamWConfig": "gradvocab",
    "DistributedOptimizer": "fastgrad.optim",
    "DynamicLossScaler": "fastgrad.optim",
    "LossScaling": "gradvocab",
    "ModelChunks": "fastgrad.optim",
    "ReplicatedOptimizer": "fastgrad.optim",
    "SGDConfig": "gradvocab",
    "param_groups_without_decay_for": "fastgrad.optim",
    "ParallelDims": "gradvocab",
    "StepOutcome": "gradvocab",
    "finalize_grads": "fastgrad.pipeline",
    "forward_backward_1f1b": "fastgrad.pipeline",
    "forward_backward_interleaved": "fastgrad.pipeline_interleaved",
}

if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from fastgrad.ddp import DistributedDataParallel
    from fastgrad.optim import (
        DistributedOptimizer,
        DynamicLossScaler,
        ModelChunks,
        ReplicatedOptimizer,
        param_groups_without_decay_for,
    )
    from fastgrad.pipeline import finalize_grads, forward_backward_1f1b
    from fastgrad.pipeline_interleaved import forward_backward_interleaved
    from gradvocab import (
        AdamWConfig,
        DDPConfig,
        LifecycleError,
        LossScaling,
        ParallelDims,
        SGDConfig,
        StepOutcome,
    )


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'fastgrad' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


__all__ = [
    "AdamWConfig",
    "DDPConfig",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "LifecycleError",
    "LossScaling",
    "ModelChunks",
    "ParallelDims",
    "ReplicatedOptimizer",
    "SGDConfig",
    "StepOutcome",
    "finalize_grads",
    "forward_backward_1f1b",
    "forward_backward_interleaved",
    "param_groups_without_decay_for",
]

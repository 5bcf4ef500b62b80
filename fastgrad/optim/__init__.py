"""Distributed optimizer over the bucket shards of ``fastgrad.buffer`` (see ``refgrad.optim`` for the spec).

Public API: :class:`DistributedOptimizer`, :class:`ModelChunks` (several DDP
chunks under one optimizer), :class:`ReplicatedOptimizer` (the same step over
all-reduced grads, without the distributed optimizer), :class:`AdamWConfig`,
:class:`SGDConfig` (both gradvocab's), :class:`DynamicLossScaler` (over gradvocab's
:class:`LossScaling`), :func:`param_groups_without_decay_for` and
:func:`default_no_decay`. ``step()`` returns a :class:`gradvocab.StepOutcome`.
``DistributedOptimizer`` also drives MXFP8 params (``supports_mxfp8``): build it
on a ``fastgrad.mxfp8_sharing.MXFP8ParamGradBuffer``.
"""

from fastgrad.optim.chunks import ModelChunks
from fastgrad.optim.config import DynamicLossScaler
from fastgrad.optim.distributed import (
    DistributedOptimizer,
    default_no_decay,
    param_groups_without_decay_for,
)
from fastgrad.optim.replicated import ReplicatedOptimizer
from gradvocab import AdamWConfig, LossScaling, SGDConfig

__all__ = [
    "AdamWConfig",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "LossScaling",
    "ModelChunks",
    "ReplicatedOptimizer",
    "SGDConfig",
    "default_no_decay",
    "param_groups_without_decay_for",
]

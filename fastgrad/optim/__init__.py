"""Distributed optimizer over the bucket shards of ``fastgrad.buffer`` (see ``refgrad.optim`` for the spec).

Public API: :class:`DistributedOptimizer`, :class:`AdamWConfig`,
:class:`SGDConfig`, :class:`DynamicLossScaler`, :class:`StepResult`,
:func:`param_groups_without_decay_for`, :func:`default_no_decay`, and
:class:`ShardedOptimizer` (the MXFP8 param-gather front's optimizer).
"""

from fastgrad.optim.config import AdamWConfig, DynamicLossScaler, SGDConfig, StepResult
from fastgrad.optim.distributed import (
    DistributedOptimizer,
    default_no_decay,
    param_groups_without_decay_for,
)
from fastgrad.optim.sharded import ShardedOptimizer

__all__ = [
    "AdamWConfig",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "SGDConfig",
    "ShardedOptimizer",
    "StepResult",
    "default_no_decay",
    "param_groups_without_decay_for",
]

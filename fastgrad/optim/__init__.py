"""Distributed optimizer over the bucket shards of ``fastgrad.buffer`` (see ``refgrad.optim`` for the spec).

Public API: :class:`DistributedOptimizer`, :class:`AdamWConfig`,
:class:`SGDConfig`, :class:`DynamicLossScaler`, :class:`StepResult`,
:func:`param_groups_without_decay_for`, :func:`default_no_decay`.
"""

from fastgrad.optim.config import AdamWConfig, DynamicLossScaler, SGDConfig, StepResult
from fastgrad.optim.distributed import (
    DistributedOptimizer,
    default_no_decay,
    param_groups_without_decay_for,
)

__all__ = [
    "AdamWConfig",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "SGDConfig",
    "StepResult",
    "default_no_decay",
    "param_groups_without_decay_for",
]

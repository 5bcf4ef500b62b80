"""Deliberately broken copies of the Megatron-Core candidate, to prove each comparison can fail.

Test-only: each is a subclass or a wrapper of Megatron-Core's own object on one instance;
Megatron-Core itself is never modified. Module-level, so the spawned ranks can unpickle them.
"""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel
from megatron.core.utils import drain_embedding_wgrad_compute


class WronglyScaledBucketDDP(DistributedDataParallel):
    """Megatron's DDP with its last bucket's averaging factor doubled (a bucket scaled wrongly)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.buffers[0].buckets[-1].gradient_scaling_factor *= 2


def drain_dropping_first(config, embedding_activation_buffer, grad_output_buffer, weight, tp_group):
    """Megatron's drain after losing the first deferred microbatch (its wgrad never lands)."""
    embedding_activation_buffer.pop(0)
    grad_output_buffer.pop(0)
    return drain_embedding_wgrad_compute(config, embedding_activation_buffer, grad_output_buffer,
                                         weight, tp_group)

"""The DDP grad buffer's default bucket size, written once for every package.

Megatron-Core's rule, in two places that agree: ``DistributedDataParallel.__init__``
(``megatron/core/distributed/distributed_data_parallel.py``: ``bucket_size = max(40000000,
1000000 * dp_group.size())`` when the config gives none) and Megatron-LM's launch
(``megatron/training/training.py``, ``resolve_ddp_bucket_size``: the same over the
data-and-context-parallel group). Buckets grow with the DP size so that each rank's chunk of
an NCCL ring reduce stays large enough to be bandwidth-bound rather than latency-bound.
Without ``overlap_grad_reduce`` both then drop the size: every param goes in one bucket.
"""

from __future__ import annotations

from gradvocab.validation import int_at_least

# Elements, not bytes: the floor, and the growth per rank of the reducing group.
MIN_DEFAULT_BUCKET_SIZE = 40_000_000
DEFAULT_BUCKET_SIZE_PER_RANK = 1_000_000


def default_bucket_size(dp_size: int) -> int:
    """Elements per bucket when none is configured: ``max(40_000_000, 1_000_000 * dp_size)``.

    ``dp_size`` is the size of the group the buckets are reduced over (DP x CP under context
    parallelism, as ``resolve_ddp_bucket_size``); an int >= 1.
    """
    size = int_at_least(dp_size, "dp_size", 1)
    return max(MIN_DEFAULT_BUCKET_SIZE, DEFAULT_BUCKET_SIZE_PER_RANK * size)


__all__ = ["DEFAULT_BUCKET_SIZE_PER_RANK", "MIN_DEFAULT_BUCKET_SIZE", "default_bucket_size"]

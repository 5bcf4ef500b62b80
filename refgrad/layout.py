"""Reference layout of a bucketed, padded parameter/gradient buffer.

This follows REFERENCE_NOTES section 1 line by line, one parameter at a time,
so it can be read against the notes (and against production's
``_ParamAndGradBuffer.__init__``). All sizes are in elements, never bytes.

With the distributed optimizer:
  * every parameter start is padded to a multiple of 64;
  * every bucket end is padded to ``lcm(dp, 128)``, or ``lcm(dp, 128, 2**16)``
    with ``pad_buckets_for_high_nccl_busbw``;
  * a shared-embedding parameter gets a bucket of its own.
Without it there is no padding at all and no shared-embedding split.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gradvocab.validation import int_at_least

PARAM_START_ALIGNMENT = 64  # elements: 128 bytes for >= 16-bit params
BUCKET_END_ALIGNMENT = 128  # elements: 256 bytes for >= 16-bit params
HIGH_BUSBW_ALIGNMENT = 2**16  # elements: NCCL ring message-size divisibility


def pad(value: int, divisor: int) -> int:
    """``ceil(value / divisor) * divisor`` in exact integer arithmetic."""
    return -(-value // divisor) * divisor


def bucket_end_divisor(
    dp_size: int, use_distributed_optimizer: bool, pad_buckets_for_high_nccl_busbw: bool
) -> int:
    """What every bucket end is padded to (1 = no padding)."""
    if not use_distributed_optimizer:
        return 1
    if pad_buckets_for_high_nccl_busbw:
        return math.lcm(dp_size, BUCKET_END_ALIGNMENT, HIGH_BUSBW_ALIGNMENT)
    return math.lcm(dp_size, BUCKET_END_ALIGNMENT)


@dataclass(frozen=True)
class Layout:
    """Where every parameter and bucket lives in the flat buffer.

    ``param_index_map[i]`` is ``(start, end, bucket_id)`` for the parameter with
    registration index ``i``; ``bucket_indices[b]`` is ``(start, end)`` of bucket
    ``b`` including its end padding. Both are tuples (immutable sequences).
    """

    param_index_map: tuple[tuple[int, int, int], ...]
    bucket_indices: tuple[tuple[int, int], ...]
    per_bucket_numel_unpadded: tuple[int, ...]
    numel: int
    numel_unpadded: int
    dp_size: int

    @property
    def num_buckets(self) -> int:
        """How many buckets the buffer has (shared embeddings' own buckets included)."""
        return len(self.bucket_indices)

    def shard(self, bucket_id: int, rank: int) -> tuple[int, int]:
        """``(start, end)`` in the buffer of rank ``rank``'s contiguous shard of a bucket."""
        if not 0 <= bucket_id < len(self.bucket_indices):
            raise ValueError(
                f"bucket_id must be in [0, {len(self.bucket_indices)}), got {bucket_id}"
            )
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank must be in [0, {self.dp_size}), got {rank}")
        start, end = self.bucket_indices[bucket_id]
        if (end - start) % self.dp_size != 0:
            raise ValueError(
                f"bucket {bucket_id} has {end - start} elements, not divisible by "
                f"dp_size={self.dp_size}; only distributed-optimizer layouts are sharded"
            )
        shard_numel = (end - start) // self.dp_size
        return start + rank * shard_numel, start + (rank + 1) * shard_numel

    def to_dict(self) -> dict:
        """Plain lists and ints, for equality checks and JSON."""
        return {
            "param_index_map": [list(t) for t in self.param_index_map],
            "bucket_indices": [list(t) for t in self.bucket_indices],
            "per_bucket_numel_unpadded": list(self.per_bucket_numel_unpadded),
            "numel": self.numel,
            "numel_unpadded": self.numel_unpadded,
            "dp_size": self.dp_size,
        }


def positive_int(value: object, name: str) -> int:
    """``value`` as an int; TypeError unless it is an integer (bool excluded), ValueError unless > 0."""
    return int_at_least(value, name, 1, rule="positive")


def validate_layout_arguments(
    numels: Iterable[int],
    dp_size: int,
    bucket_size: int | None,
    shared_embedding: Iterable[int],
) -> tuple[list[int], int, int | None, frozenset[int]]:
    """Check the arguments of :func:`compute_layout`; return them normalised."""
    numel_list = [positive_int(n, f"numels[{i}]") for i, n in enumerate(numels)]
    if not numel_list:
        raise ValueError("numels must contain at least one parameter size")
    dp = positive_int(dp_size, "dp_size")
    size = None if bucket_size is None else positive_int(bucket_size, "bucket_size")
    return numel_list, dp, size, validate_shared_embedding(shared_embedding, len(numel_list))


def validate_shared_embedding(shared_embedding: Iterable[int], count: int) -> frozenset[int]:
    """The shared-embedding registration indices; each an int in ``[0, count)``, listed once."""
    shared: set[int] = set()
    for index in shared_embedding:
        if isinstance(index, bool):
            raise TypeError("shared_embedding entries must be ints, got bool")
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(
                f"shared_embedding entries must be ints, got {type(index).__name__}"
            ) from None
        if not 0 <= i < count:
            raise ValueError(f"shared_embedding index {i} is out of range for {count} parameters")
        if i in shared:
            raise ValueError(f"shared_embedding index {i} is listed twice")
        shared.add(i)
    return frozenset(shared)


def compute_layout(
    numels: Sequence[int],
    *,
    dp_size: int,
    bucket_size: int | None,
    use_distributed_optimizer: bool,
    pad_buckets_for_high_nccl_busbw: bool,
    shared_embedding: Iterable[int] = (),
) -> Layout:
    """Lay out parameters of the given sizes (registration order) into padded buckets.

    ``shared_embedding`` holds registration indices of shared-embedding params.
    ``bucket_size=None`` means one bucket for everything (except shared embeddings).
    """
    numel_list, dp, size, shared = validate_layout_arguments(
        numels, dp_size, bucket_size, shared_embedding
    )
    divisor = bucket_end_divisor(dp, use_distributed_optimizer, pad_buckets_for_high_nccl_busbw)

    def pad_start_of_param(start: int) -> int:
        if use_distributed_optimizer:
            return pad(start, PARAM_START_ALIGNMENT)
        return start

    def requires_own_bucket(index: int) -> bool:
        # Only the distributed optimizer (reduce-scatter) splits shared embeddings.
        return use_distributed_optimizer and index in shared

    index_map: dict[int, tuple[int, int, int]] = {}
    bucket_indices: list[tuple[int, int]] = []
    unpadded: list[int] = []
    bucket_start = 0
    bucket_len = 0  # params in the open bucket
    bucket_id = 0

    def close_bucket(end: int) -> int:
        nonlocal bucket_start, bucket_len, bucket_id
        unpadded.append(end - bucket_start)  # includes the 64-alignment gaps
        padded_end = pad(end, divisor)
        bucket_indices.append((bucket_start, padded_end))
        bucket_start = padded_end
        bucket_len = 0
        bucket_id += 1
        return padded_end

    param_start = 0
    param_end = 0
    # Reverse registration order roughly follows the order backprop produces grads.
    for index in reversed(range(len(numel_list))):
        # 1. pad the start
        param_start = pad_start_of_param(param_start)
        # 2. a shared embedding closes a non-empty open bucket at its padded start
        if requires_own_bucket(index) and bucket_len > 0:
            param_start = close_bucket(param_start)
        # 3. record
        param_end = param_start + numel_list[index]
        index_map[index] = (param_start, param_end, bucket_id)
        bucket_len += 1
        # 4. close when big enough (checked after adding) or for a shared embedding
        if (size is not None and param_end - bucket_start >= size) or requires_own_bucket(index):
            param_start = close_bucket(param_end)
        else:
            param_start = param_end
    if bucket_len > 0:
        close_bucket(param_end)

    numel = bucket_indices[-1][1]
    numel_unpadded = sum(unpadded)
    assert numel_unpadded <= numel
    if use_distributed_optimizer:
        assert numel % dp == 0
    return Layout(
        param_index_map=tuple(index_map[i] for i in range(len(numel_list))),
        bucket_indices=tuple(bucket_indices),
        per_bucket_numel_unpadded=tuple(unpadded),
        numel=numel,
        numel_unpadded=numel_unpadded,
        dp_size=dp,
    )

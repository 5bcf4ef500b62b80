"""Bucketed, padded buffer layout, vectorised for models with 10^5+ parameters.

Same contract as ``refgrad.layout.compute_layout`` (REFERENCE_NOTES section 1),
computed bucket by bucket instead of parameter by parameter:

Inside a bucket whose start is a multiple of 64 (every bucket start is: the
first is 0 and the others are padded to a multiple of 128), the next parameter
start is ``pad64(previous end)``, so the starts are the bucket start plus the
exclusive prefix sum of the 64-padded sizes ``P``. The key ``C[j] + n[j]``
(prefix of P before j, plus j's own size) is strictly increasing, so the
parameter that first fills a bucket is found with one ``searchsorted``. The
Python loop runs once per bucket, not once per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

# Argument validation is shared with the reference (one set of rules and messages);
# the layout arithmetic below is deliberately independent of refgrad's.
from refgrad.layout import positive_int, validate_shared_embedding

PARAM_START_ALIGNMENT = 64  # elements: 128-byte aligned starts for >= 16-bit params
BUCKET_END_ALIGNMENT = 128  # elements: 256-byte aligned bucket ends
HIGH_BUSBW_ALIGNMENT = 2**16  # elements: NCCL ring message sizes divisible by 2^16


def bucket_end_divisor(
    dp_size: int, use_distributed_optimizer: bool, pad_buckets_for_high_nccl_busbw: bool
) -> int:
    """What every bucket end is padded to; 1 without the distributed optimizer."""
    if not use_distributed_optimizer:
        return 1
    if pad_buckets_for_high_nccl_busbw:
        return math.lcm(dp_size, BUCKET_END_ALIGNMENT, HIGH_BUSBW_ALIGNMENT)
    return math.lcm(dp_size, BUCKET_END_ALIGNMENT)


@dataclass(frozen=True, eq=False)
class BufferLayout:
    """Where every parameter and bucket lives in the flat buffer (elements).

    ``param_starts/param_ends/param_bucket_ids`` are read-only int64 arrays in
    registration order. ``param_index_map``, ``bucket_indices`` and
    ``per_bucket_numel_unpadded`` are tuples with the same contents as
    refgrad's ``Layout``. Equality compares the layouts' contents.
    """

    param_starts: np.ndarray
    param_ends: np.ndarray
    param_bucket_ids: np.ndarray
    bucket_indices: tuple[tuple[int, int], ...]
    per_bucket_numel_unpadded: tuple[int, ...]
    numel: int
    numel_unpadded: int
    dp_size: int

    @cached_property
    def param_index_map(self) -> tuple[tuple[int, int, int], ...]:
        """``(start, end, bucket_id)`` per parameter, in registration order."""
        return tuple(
            zip(
                self.param_starts.tolist(),
                self.param_ends.tolist(),
                self.param_bucket_ids.tolist(),
            )
        )

    @property
    def num_buckets(self) -> int:
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
        """Plain lists and ints (same shape as ``refgrad.layout.Layout.to_dict``)."""
        return {
            "param_index_map": [
                list(t)
                for t in zip(
                    self.param_starts.tolist(),
                    self.param_ends.tolist(),
                    self.param_bucket_ids.tolist(),
                )
            ],
            "bucket_indices": [list(t) for t in self.bucket_indices],
            "per_bucket_numel_unpadded": list(self.per_bucket_numel_unpadded),
            "numel": self.numel,
            "numel_unpadded": self.numel_unpadded,
            "dp_size": self.dp_size,
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BufferLayout):
            return NotImplemented
        return (
            self.bucket_indices == other.bucket_indices
            and self.per_bucket_numel_unpadded == other.per_bucket_numel_unpadded
            and self.numel == other.numel
            and self.numel_unpadded == other.numel_unpadded
            and self.dp_size == other.dp_size
            and np.array_equal(self.param_starts, other.param_starts)
            and np.array_equal(self.param_ends, other.param_ends)
            and np.array_equal(self.param_bucket_ids, other.param_bucket_ids)
        )

    __hash__ = None  # type: ignore[assignment]


def _numels_array(numels: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(numels, np.ndarray):
        if numels.ndim != 1:
            raise ValueError(f"numels must be one-dimensional, got shape {numels.shape}")
        if numels.dtype == np.bool_ or not np.issubdtype(numels.dtype, np.integer):
            raise TypeError(f"numels must hold integers, got dtype {numels.dtype}")
        if numels.size and np.issubdtype(numels.dtype, np.unsignedinteger) and int(numels.max()) >= 2**62:
            raise ValueError(f"numels must be < 2**62 each, got {int(numels.max())}")
        array = numels.astype(np.int64)
    else:
        values = numels if isinstance(numels, list) else list(numels)
        element_types = set(map(type, values))
        if not all(t is int or (issubclass(t, np.integer)) for t in element_types):
            for i, n in enumerate(values):
                if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
                    raise TypeError(f"numels[{i}] must be an int, got {type(n).__name__}")
        try:
            array = np.array(values, dtype=np.int64)
        except OverflowError:
            raise ValueError("numels must be < 2**62 each") from None
    if array.size and int(array.max()) >= 2**62:
        raise ValueError(f"numels must be < 2**62 each, got {int(array.max())}")
    if array.size == 0:
        raise ValueError("numels must contain at least one parameter size")
    bad = np.flatnonzero(array <= 0)
    if bad.size:
        raise ValueError(f"numels[{int(bad[0])}] must be positive, got {int(array[bad[0]])}")
    return array


def compute_layout(
    numels: Sequence[int] | np.ndarray,
    *,
    dp_size: int,
    bucket_size: int | None,
    use_distributed_optimizer: bool,
    pad_buckets_for_high_nccl_busbw: bool,
    shared_embedding: Iterable[int] = (),
) -> BufferLayout:
    """Lay out parameters of the given sizes (registration order) into padded buckets.

    Same arguments and results as ``refgrad.layout.compute_layout``; ``numels``
    may also be a 1-D integer numpy array.
    """
    sizes = _numels_array(numels)
    count = int(sizes.size)
    dp = positive_int(dp_size, "dp_size")
    size = None if bucket_size is None else positive_int(bucket_size, "bucket_size")
    shared = sorted(validate_shared_embedding(shared_embedding, count))
    divisor = bucket_end_divisor(dp, use_distributed_optimizer, pad_buckets_for_high_nccl_busbw)
    align = PARAM_START_ALIGNMENT if use_distributed_optimizer else 1

    # Work in reverse registration order: position p is registration index count-1-p.
    rev = sizes[::-1]
    padded = -(-rev // align) * align
    prefix = np.zeros(count + 1, dtype=np.int64)
    if float(padded.astype(np.float64).sum()) >= 2.0**61:
        raise ValueError("the parameters' total size must stay below 2**61 elements")
    np.cumsum(padded, out=prefix[1:])
    end_key = prefix[:-1] + rev  # strictly increasing
    # Shared embeddings only split buckets with the distributed optimizer.
    shared_positions = sorted(count - 1 - i for i in shared) if use_distributed_optimizer else []

    # The loop runs once per bucket; per-parameter arrays are filled afterwards
    # with np.repeat.
    bucket_first: list[int] = []  # first layout position of each bucket
    bucket_count: list[int] = []  # params in each bucket
    bucket_indices: list[tuple[int, int]] = []
    unpadded: list[int] = []

    first = 0
    bucket_start = 0
    shared_cursor = 0
    while first < count:
        while shared_cursor < len(shared_positions) and shared_positions[shared_cursor] < first:
            shared_cursor += 1
        next_shared = (
            shared_positions[shared_cursor] if shared_cursor < len(shared_positions) else count
        )
        base = int(prefix[first])
        if next_shared == first:
            following = first + 1  # a shared embedding alone in its bucket
            bucket_unpadded = int(rev[first])
        else:
            filled = count if size is None else int(end_key.searchsorted(base + size))
            if filled < next_shared:
                following = filled + 1  # closes at the end of the param that filled it
                bucket_unpadded = int(end_key[filled]) - base
            elif next_shared < count:
                following = next_shared  # closes at the shared embedding's padded start
                bucket_unpadded = int(prefix[next_shared]) - base
            else:
                following = count
                bucket_unpadded = int(end_key[count - 1]) - base
        padded_end = -(-(bucket_start + bucket_unpadded) // divisor) * divisor
        bucket_first.append(first)
        bucket_count.append(following - first)
        bucket_indices.append((bucket_start, padded_end))
        unpadded.append(bucket_unpadded)
        bucket_start = padded_end
        first = following

    counts = np.array(bucket_count, dtype=np.int64)
    bucket_of = np.repeat(np.arange(len(bucket_indices), dtype=np.int64), counts)
    bucket_base = np.repeat(np.array([b for b, _ in bucket_indices], dtype=np.int64), counts)
    first_prefix = np.repeat(prefix[np.array(bucket_first, dtype=np.int64)], counts)
    starts_rev = bucket_base + prefix[:-1] - first_prefix
    starts = np.ascontiguousarray(starts_rev[::-1])
    ends = starts + sizes
    bucket_ids = np.ascontiguousarray(bucket_of[::-1])
    for array in (starts, ends, bucket_ids):
        array.setflags(write=False)
    numel = bucket_indices[-1][1]
    numel_unpadded = sum(unpadded)
    if use_distributed_optimizer and numel % dp != 0:
        raise AssertionError(f"buffer numel {numel} not divisible by dp_size={dp}")
    return BufferLayout(
        param_starts=starts,
        param_ends=ends,
        param_bucket_ids=bucket_ids,
        bucket_indices=tuple(bucket_indices),
        per_bucket_numel_unpadded=tuple(unpadded),
        numel=numel,
        numel_unpadded=numel_unpadded,
        dp_size=dp,
    )

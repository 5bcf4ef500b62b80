"""Reference layouts of torch's own data parallelism: DDP's buckets and FSDP2's dim-0 shards.

These depart from ``refgrad.layout`` (Megatron-Core's padded, bucketed buffer) by design.
Each function follows the torch source it names, one parameter at a time, so it can be
read against it (torch 2.13):

**DistributedDataParallel** (``torch/nn/parallel/distributed.py`` and the C++ Reducer,
``torch/csrc/distributed/c10d/reducer.cpp``):

* ``_BucketCapacityConfig.create``: ``bucket_cap_mb`` (default 25) becomes
  ``bucket_bytes_cap = int(bucket_cap_mb * 2**20)``; only with the default is the first
  bucket smaller, ``first_bucket_bytes_cap = dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB);
  a ``bucket_cap_mb`` given makes both caps equal.
* ``compute_bucket_assignment_by_size``: tensors in the order given go into the open
  bucket of their (dtype, device) key, sizes in *bytes* (``numel * element_size``); a
  bucket closes *after* adding a tensor when its size reaches the current limit, and the
  key's limit then advances to the next one of ``bucket_size_limits`` (the last one stays).
  With ``tensor_indices`` given the buckets keep that order; otherwise they are sorted by
  their smallest index.
* ``_ddp_init_helper``: the first iteration's assignment (``find_unused_parameters=False``,
  no static graph) has one limit, ``sys.maxsize``: one bucket in registration order.
* ``Reducer::rebuild_buckets``, after the first backward: the params in the order their
  grads became ready (``rebuilt_params_``: for a module whose forward uses its params in
  registration order, the reverse of it), limits ``[first_bucket_bytes_cap,
  bucket_bytes_cap]``, the ready order kept.
* ``Reducer::initialize_buckets``: within a bucket the params sit back to back in the
  bucket's order, with no padding; each bucket is a tensor of its own.

**FSDP2** (``torch/distributed/fsdp/_fully_shard``):

* ``_fsdp_param.FSDPParam._init_sharded_param``: each parameter is split on dim 0 by
  ``_fsdp_common._chunk_with_empty`` (``torch.chunk`` into ``W`` chunks of
  ``ceil(dim0 / W)`` rows, the last ones short or empty); rank ``r`` holds chunk ``r``,
  padded to the first chunk's rows.
* ``_fsdp_collectives.foreach_reduce``: the reduce-scatter input is, per rank chunk, every
  parameter's chunk padded to ``ceil(dim0 / W)`` rows (``_get_dim0_padded_size``,
  ``foreach_reduce_scatter_copy_in``'s ``chunk_cat``), parameters in registration order.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from refgrad.layout import Layout, positive_int

MIB = 2**20  # torch.nn.parallel.distributed._MB_TO_BYTES
DEFAULT_BUCKET_CAP_MB = 25  # torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB
DEFAULT_FIRST_BUCKET_BYTES = 2**20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


@dataclass(frozen=True)
class DDPBucketCaps:
    """DDP's bucket size limits in bytes, as ``_BucketCapacityConfig.create`` derives them."""

    bucket_bytes_cap: int
    first_bucket_bytes_cap: int

    @classmethod
    def from_bucket_cap_mb(cls, bucket_cap_mb: float | None) -> DDPBucketCaps:
        """``bucket_cap_mb`` None: the default 25 MiB with a 1 MiB first bucket; given: both
        caps ``int(bucket_cap_mb * 2**20)`` bytes."""
        if bucket_cap_mb is None:
            return cls(int(DEFAULT_BUCKET_CAP_MB * MIB), DEFAULT_FIRST_BUCKET_BYTES)
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be None or a number > 0, got {bucket_cap_mb!r}")
        cap = int(bucket_cap_mb * MIB)
        return cls(cap, cap)

    def rebuild_limits(self) -> tuple[int, int]:
        """``Reducer::rebuild_buckets``'s limits: the first bucket's, then every other's."""
        return (self.first_bucket_bytes_cap, self.bucket_bytes_cap)


def bucket_assignment_by_size(sizes_bytes: Sequence[int], limits: Sequence[int],
                              order: Sequence[int] | None = None) -> list[list[int]]:
    """``compute_bucket_assignment_by_size`` for tensors of one dtype and device.

    ``sizes_bytes[i]``: tensor ``i``'s bytes. ``order``: the order the tensors are given in
    (the Reducer's ``tensor_indices``; the buckets then keep it); None: ``0..n-1``, and the
    buckets are sorted by their smallest index. Returns each bucket's tensor indices.
    """
    sizes = [positive_int(s, f"sizes_bytes[{i}]") for i, s in enumerate(sizes_bytes)]
    if not sizes:
        raise ValueError("sizes_bytes must hold at least one tensor")
    limit_list = [positive_int(x, f"limits[{i}]") for i, x in enumerate(limits)]
    if not limit_list:
        raise ValueError("limits must hold at least one bucket size limit")
    indices = list(range(len(sizes))) if order is None else [int(i) for i in order]
    if sorted(indices) != list(range(len(sizes))):
        raise ValueError(f"order must be a permutation of 0..{len(sizes) - 1}, got {list(order or ())}")
    buckets: list[list[int]] = []
    open_bucket: list[int] = []
    open_bytes = 0
    limit_at = 0
    for index in indices:
        open_bucket.append(index)
        open_bytes += sizes[index]
        if open_bytes >= limit_list[limit_at]:  # checked after adding
            buckets.append(open_bucket)
            open_bucket, open_bytes = [], 0
            limit_at = min(limit_at + 1, len(limit_list) - 1)  # the last limit stays
    if open_bucket:
        buckets.append(open_bucket)
    if order is None:
        buckets.sort(key=min)
    return buckets


def ddp_initial_buckets(count: int) -> list[list[int]]:
    """The first iteration's buckets (limit ``sys.maxsize``): all ``count`` params in one
    bucket, in registration order."""
    return bucket_assignment_by_size([1] * positive_int(count, "count"), [sys.maxsize])


def ddp_rebuilt_buckets(sizes_bytes: Sequence[int], caps: DDPBucketCaps,
                        ready_order: Sequence[int]) -> list[list[int]]:
    """The buckets from the second iteration on: the params in the order their grads became
    ready, limits ``[first_bucket_bytes_cap, bucket_bytes_cap]``, that order kept."""
    return bucket_assignment_by_size(sizes_bytes, caps.rebuild_limits(), ready_order)


def ddp_layout(numels: Sequence[int], *, element_size: int, caps: DDPBucketCaps,
               ready_order: Sequence[int] | None = None, dp_size: int = 1) -> Layout:
    """DDP's buckets after the rebuild as a :class:`refgrad.layout.Layout`: the buckets one
    after another, each param's elements back to back in its bucket's order, no padding.

    ``ready_order`` None: the reverse of registration order (a forward that uses the params
    in registration order). ``dp_size`` is recorded only: DDP's layout does not depend on it.
    """
    sizes = [positive_int(n, f"numels[{i}]") * positive_int(element_size, "element_size")
             for i, n in enumerate(numels)]
    order = list(reversed(range(len(sizes)))) if ready_order is None else list(ready_order)
    buckets = ddp_rebuilt_buckets(sizes, caps, order)
    return _back_to_back(list(numels), buckets, positive_int(dp_size, "dp_size"))


def _back_to_back(numels: list[int], buckets: list[list[int]], dp_size: int) -> Layout:
    index_map: dict[int, tuple[int, int, int]] = {}
    bucket_indices = []
    start = 0
    for bucket_id, members in enumerate(buckets):
        bucket_start = start
        for index in members:
            index_map[index] = (start, start + numels[index], bucket_id)
            start += numels[index]
        bucket_indices.append((bucket_start, start))
    return Layout(param_index_map=tuple(index_map[i] for i in range(len(numels))),
                  bucket_indices=tuple(bucket_indices),
                  per_bucket_numel_unpadded=tuple(e - s for s, e in bucket_indices),
                  numel=start, numel_unpadded=start, dp_size=dp_size)


# --------------------------------------------------------------------------- FSDP2


@dataclass(frozen=True)
class Dim0Shard:
    """One rank's shard of one parameter: rows ``[start, stop)`` of dim 0 (empty when equal),
    padded to ``padded_rows`` rows in its sharded storage and in the reduce-scatter input."""

    start: int
    stop: int
    padded_rows: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def fsdp2_shards(dim0: int, world_size: int) -> list[Dim0Shard]:
    """Every rank's shard of a parameter of ``dim0`` rows: ``torch.chunk`` into chunks of
    ``ceil(dim0 / W)`` rows (``_chunk_with_empty``: the chunks torch.chunk does not make are
    empty), each padded to that many rows."""
    rows = positive_int(dim0, "dim0")
    world = positive_int(world_size, "world_size")
    chunk = math.ceil(rows / world)
    return [Dim0Shard(min(rows, r * chunk), min(rows, (r + 1) * chunk), chunk) for r in range(world)]


@dataclass(frozen=True)
class ReduceScatterPlacement:
    """Where one rank's chunk of FSDP2's reduce-scatter input holds each parameter:
    ``offsets[i]`` its first element, ``padded_numels[i]`` its padded shard's elements
    (``padded_rows * row_numel``); ``chunk_numel`` the chunk's size (the same on every rank)."""

    offsets: tuple[int, ...]
    padded_numels: tuple[int, ...]
    chunk_numel: int


def fsdp2_reduce_scatter_placement(shapes: Sequence[Sequence[int]], world_size: int
                                   ) -> ReduceScatterPlacement:
    """``foreach_reduce``'s input layout: rank chunk ``r`` is every parameter's padded shard
    ``r`` (``ceil(dim0 / W)`` rows), in registration order."""
    offsets, padded = [], []
    at = 0
    for i, shape in enumerate(shapes):
        if not shape:
            raise ValueError(f"shapes[{i}] must have at least one dimension (FSDP2 shards dim 0)")
        row_numel = math.prod(positive_int(d, f"shapes[{i}]") for d in shape[1:])
        numel = fsdp2_shards(shape[0], world_size)[0].padded_rows * row_numel
        offsets.append(at)
        padded.append(numel)
        at += numel
    return ReduceScatterPlacement(tuple(offsets), tuple(padded), at)


__all__ = ["DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_BYTES", "DDPBucketCaps", "Dim0Shard",
           "ReduceScatterPlacement", "bucket_assignment_by_size", "ddp_initial_buckets",
           "ddp_layout", "ddp_rebuilt_buckets", "fsdp2_reduce_scatter_placement", "fsdp2_shards"]

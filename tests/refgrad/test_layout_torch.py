"""refgrad.layout_torch: DDP's buckets and FSDP2's dim-0 shards, hand-derived and against
torch's own functions (``dist._compute_bucket_assignment_by_size``, ``torch.chunk``)."""

import random
import sys

import pytest
import torch
import torch.distributed as dist

from refgrad.layout_torch import (
    DDPBucketCaps,
    bucket_assignment_by_size,
    ddp_initial_buckets,
    ddp_layout,
    fsdp2_reduce_scatter_placement,
    fsdp2_shards,
)


def test_caps_follow_bucket_capacity_config():
    # _BucketCapacityConfig.create: default 25 MiB with a 1 MiB first bucket; given: equal.
    assert DDPBucketCaps.from_bucket_cap_mb(None) == DDPBucketCaps(25 * 2**20, 2**20)
    assert DDPBucketCaps.from_bucket_cap_mb(1) == DDPBucketCaps(2**20, 2**20)
    assert DDPBucketCaps.from_bucket_cap_mb(400 / 2**20) == DDPBucketCaps(400, 400)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDPBucketCaps.from_bucket_cap_mb(0)


def test_hand_derived_assignment():
    # sizes 40, 30, 50, 10 bytes in ready order 3, 2, 1, 0 with limits [50, 60]:
    # 10 (10) + 50 -> 60 >= 50 closes [3, 2]; limit 60: 30 + 40 = 70 >= 60 closes [1, 0].
    assert bucket_assignment_by_size([40, 30, 50, 10], [50, 60], [3, 2, 1, 0]) == [[3, 2], [1, 0]]
    # without an order: closes after adding, sorted by the smallest index
    assert bucket_assignment_by_size([40, 30, 50, 10], [50]) == [[0, 1], [2], [3]]
    assert ddp_initial_buckets(4) == [[0, 1, 2, 3]]


def test_hand_derived_layout():
    # numels 3, 5, 7 (fp32: 12, 20, 28 bytes), caps first 30 / then 40, ready 2, 1, 0:
    # 28 < 30, + 20 = 48 >= 30 closes [2, 1]; 12 left: [0]. Back to back: 7 at 0, 5 at 7, 3 at 12.
    layout = ddp_layout([3, 5, 7], element_size=4, caps=DDPBucketCaps(40, 30))
    assert layout.param_index_map == ((12, 15, 1), (7, 12, 0), (0, 7, 0))
    assert layout.bucket_indices == ((0, 12), (12, 15))
    assert layout.numel == layout.numel_unpadded == 15


@pytest.mark.parametrize("seed", range(20))
def test_rebuilt_buckets_equal_torch(seed):
    rng = random.Random(seed)
    numels = [rng.choice((rng.randint(1, 50), rng.randint(1, 400_000))) for _ in range(rng.randint(1, 12))]
    caps = DDPBucketCaps.from_bucket_cap_mb(rng.choice((None, 0.5, 1, rng.randint(1, 4000) / 2**20)))
    order = list(range(len(numels)))
    rng.shuffle(order)
    params = [torch.empty(n, device="meta") for n in numels]
    torch_buckets, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], list(caps.rebuild_limits()), [False] * len(numels), order)
    assert bucket_assignment_by_size([4 * n for n in numels], caps.rebuild_limits(), order) == torch_buckets
    torch_initial, _ = dist._compute_bucket_assignment_by_size(params, [sys.maxsize], [False] * len(numels))
    assert ddp_initial_buckets(len(numels)) == torch_initial


@pytest.mark.parametrize("dim0,world", [(5, 4), (8, 3), (1, 2), (7, 7), (2, 3), (100, 6)])
def test_fsdp2_shards_are_torch_chunk(dim0, world):
    chunks = list(torch.arange(dim0).chunk(world))
    shards = fsdp2_shards(dim0, world)
    for rank, shard in enumerate(shards):
        want = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(shard.start, shard.stop)) == want
        assert shard.padded_rows == len(chunks[0])


def test_fsdp2_placement_hand_derived():
    # W = 3: (5, 2) -> 2 rows of 2 = 4; (7,) -> 3; (2, 4) -> 1 row of 4 = 4
    placement = fsdp2_reduce_scatter_placement([(5, 2), (7,), (2, 4)], 3)
    assert placement.offsets == (0, 4, 7)
    assert placement.padded_numels == (4, 3, 4)
    assert placement.chunk_numel == 11

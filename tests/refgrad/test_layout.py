"""refgrad.layout against layouts worked out by hand from REFERENCE_NOTES section 1."""

import math

import pytest

from refgrad.layout import bucket_end_divisor, compute_layout, pad
from verify.checks.layout import HAND_CASES, hand_case_mismatch, layout_violations

DIST = {"use_distributed_optimizer": True, "pad_buckets_for_high_nccl_busbw": False}


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda c: c.name)
def test_hand_derived_layouts(case):
    layout = compute_layout(list(case.numels), **case.kwargs())
    assert hand_case_mismatch(case, layout) == ""
    assert layout_violations(layout, case.numels, **case.kwargs()) == []


def test_totals_and_shards_hand_derived():
    # numels (50, 60, 70, 80), dp 3, bucket 100 (see HAND_CASES): buckets [0,384) and
    # [384,768); unpadded 198 + 114 = 312. Shards of 128 (bucket 0) and 128 (bucket 1).
    layout = compute_layout([50, 60, 70, 80], dp_size=3, bucket_size=100, **DIST)
    assert (layout.numel, layout.numel_unpadded) == (768, 312)
    assert [layout.shard(0, r) for r in range(3)] == [(0, 128), (128, 256), (256, 384)]
    assert [layout.shard(1, r) for r in range(3)] == [(384, 512), (512, 640), (640, 768)]


def test_shared_embedding_in_the_middle():
    # numels (10, 20, 30, 40), shared index 2, dp 2, no bucket size.
    # Reverse: 40 at [0,40); pad64 -> 64; param 2 is shared and the bucket is open:
    # close bucket 0 at 64 (unpadded 64, end pad(64,128)=128). 30 at [128,158), own
    # bucket 1, closes at 158 -> 256. 20 at [256,276); pad64 -> 320; 10 at [320,330);
    # final close: unpadded 330-256=74, end pad(330,128)=384.
    layout = compute_layout([10, 20, 30, 40], dp_size=2, bucket_size=None,
                            shared_embedding=[2], **DIST)
    assert layout.param_index_map == ((320, 330, 2), (256, 276, 2), (128, 158, 1), (0, 40, 0))
    assert layout.bucket_indices == ((0, 128), (128, 256), (256, 384))
    assert layout.per_bucket_numel_unpadded == (64, 30, 74)
    assert layout.num_buckets == 3  # the shared embedding's own bucket counts


def test_shared_embedding_larger_than_a_bucket():
    # numels (500, 10), shared index 0, bucket 100, dp 1 (divisor 128).
    # 10 at [0,10) (<100); pad64 -> 64; shared closes bucket 0 at 64 (unpadded 64, end 128).
    # 500 at [128,628) own bucket; unpadded 500, end pad(628,128)=640.
    layout = compute_layout([500, 10], dp_size=1, bucket_size=100, shared_embedding=[0], **DIST)
    assert layout.param_index_map == ((128, 628, 1), (0, 10, 0))
    assert layout.bucket_indices == ((0, 128), (128, 640))
    assert layout.per_bucket_numel_unpadded == (64, 500)


def test_bucket_closed_by_size_just_before_a_shared_embedding():
    # numels (5, 100), shared index 0, bucket 100, dp 1: 100 at [0,100) reaches the size and
    # closes at 100 (unpadded 100, not 128), end 128; 5 at [128,133): unpadded 5, end 256.
    layout = compute_layout([5, 100], dp_size=1, bucket_size=100, shared_embedding=[0], **DIST)
    assert layout.per_bucket_numel_unpadded == (100, 5)
    assert layout.bucket_indices == ((0, 128), (128, 256))


def test_every_param_its_own_bucket_with_bucket_size_one():
    # bucket_size 1: each param closes its bucket. dp 2 -> divisor 128.
    # Reverse: 3 at [0,3) -> end 128; 200 at [128,328) -> end 384; 1 at [384,385) -> 512.
    layout = compute_layout([1, 200, 3], dp_size=2, bucket_size=1, **DIST)
    assert layout.param_index_map == ((384, 385, 2), (128, 328, 1), (0, 3, 0))
    assert layout.bucket_indices == ((0, 128), (128, 384), (384, 512))
    assert layout.num_buckets == 3


def test_divisors_from_the_formula():
    # lcm(8,128)=128; lcm(64,128,65536)=65536 (the seed says 4,194,304); lcm(3,128,65536)=196608;
    # lcm(1000,128)=16000 (1000=2^3*5^3, 128=2^7 -> 2^7*5^3).
    assert bucket_end_divisor(8, True, False) == 128
    assert bucket_end_divisor(64, True, True) == 65_536
    assert bucket_end_divisor(3, True, True) == 196_608
    assert bucket_end_divisor(1000, True, False) == 16_000
    assert bucket_end_divisor(1000, False, True) == 1
    assert pad(10_000_000, 128) == 10_000_000  # already a multiple: 128 * 78125
    assert pad(40_000_000, 65_536) == 40_042_496  # 611 * 65536


def test_seed_example_2_shard_is_not_divisible_by_2_16():
    # 40M elements at dp 64 with high busbw: bucket 40,042,496, shard 625,664 = 611 * 2^10.
    layout = compute_layout([40_000_000], dp_size=64, bucket_size=None,
                            use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=True)
    lo, hi = layout.shard(0, 0)
    assert hi - lo == 625_664
    assert (hi - lo) % 2**16 != 0 and (hi - lo) % 2**10 == 0


def test_without_distributed_optimizer_no_padding_and_single_bucket():
    numels = [7, 1, 129, 64, 3]
    layout = compute_layout(numels, dp_size=5, bucket_size=None,
                            use_distributed_optimizer=False, pad_buckets_for_high_nccl_busbw=True,
                            shared_embedding=[0, 4])
    assert layout.numel == layout.numel_unpadded == sum(numels)
    assert layout.bucket_indices == ((0, sum(numels)),)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"numels": []}, ValueError, "at least one"),
        ({"numels": [3, 0]}, ValueError, r"numels\[1\] must be positive"),
        ({"numels": [3, -2]}, ValueError, r"numels\[1\] must be positive"),
        ({"numels": [3, 2.0]}, TypeError, r"numels\[1\] must be an int"),
        ({"numels": [True]}, TypeError, r"numels\[0\] must be an int"),
        ({"dp_size": 0}, ValueError, "dp_size must be positive"),
        ({"dp_size": 2.0}, TypeError, "dp_size must be an int"),
        ({"bucket_size": 0}, ValueError, "bucket_size must be positive"),
        ({"bucket_size": "10"}, TypeError, "bucket_size must be an int"),
        ({"shared_embedding": [5]}, ValueError, "out of range"),
        ({"shared_embedding": [1, 1]}, ValueError, "listed twice"),
        ({"shared_embedding": [True]}, TypeError, "must be ints"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = {"numels": [3, 4], "dp_size": 2, "bucket_size": None, **DIST, **kwargs}
    numels = args.pop("numels")
    with pytest.raises(error, match=match):
        compute_layout(numels, **args)


def test_shard_errors():
    layout = compute_layout([3, 4], dp_size=2, bucket_size=None, **DIST)
    with pytest.raises(ValueError, match="bucket_id"):
        layout.shard(1, 0)
    with pytest.raises(ValueError, match="rank"):
        layout.shard(0, 2)
    unpadded = compute_layout([3, 4], dp_size=2, bucket_size=None,
                              use_distributed_optimizer=False, pad_buckets_for_high_nccl_busbw=False)
    with pytest.raises(ValueError, match="not divisible"):
        unpadded.shard(0, 0)  # 7 elements, dp 2


def test_layout_is_frozen():
    layout = compute_layout([3], dp_size=1, bucket_size=None, **DIST)
    with pytest.raises(AttributeError):
        layout.numel = 5  # type: ignore[misc]
    assert math.gcd(layout.numel, 128) == 128

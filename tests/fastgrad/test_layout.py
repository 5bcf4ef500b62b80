"""fastgrad.layout: exactly refgrad's layout, for random problems and 10^5 parameters."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgrad.layout import compute_layout
from refgrad.layout import compute_layout as reference_layout
from verify.checks.layout import HAND_CASES, hand_case_mismatch, layout_violations

POWERS_OF_TWO = [2**k for k in range(11)]


@st.composite
def layout_problems(draw):
    n = draw(st.integers(1, 14))
    numels = draw(
        st.lists(
            st.one_of(st.integers(1, 70), st.integers(1, 5000), st.integers(1, 300_000)),
            min_size=n,
            max_size=n,
        )
    )
    dp = draw(st.one_of(st.sampled_from(POWERS_OF_TWO), st.integers(1, 1024)))
    bucket_size = draw(st.one_of(st.none(), st.integers(1, 600), st.integers(1, 400_000)))
    position = draw(st.sampled_from(["none", "first", "middle", "last", "first+last"]))
    shared = {
        "none": [],
        "first": [0],
        "middle": [n // 2],
        "last": [n - 1],
        "first+last": sorted({0, n - 1}),
    }[position]
    if shared and bucket_size is not None and draw(st.booleans()):
        numels[shared[0]] = bucket_size + draw(st.integers(1, 1000))  # larger than a bucket
    return {
        "numels": numels,
        "dp_size": dp,
        "bucket_size": bucket_size,
        "use_distributed_optimizer": draw(st.booleans()),
        "pad_buckets_for_high_nccl_busbw": draw(st.booleans()),
        "shared_embedding": shared,
    }


@settings(max_examples=1000, deadline=None)
@given(layout_problems())
def test_fastgrad_equals_refgrad_and_invariants_hold(problem):
    numels = problem.pop("numels")
    ref = reference_layout(numels, **problem)
    fast = compute_layout(numels, **problem)
    assert fast.to_dict() == ref.to_dict()
    assert fast.param_index_map == ref.param_index_map
    # Invariants from the notes, shards of all ranks tiling every bucket included.
    assert layout_violations(fast, numels, **problem) == []


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda c: c.name)
def test_hand_derived_layouts(case):
    assert hand_case_mismatch(case, compute_layout(list(case.numels), **case.kwargs())) == ""


def test_hundred_thousand_params_equal_refgrad():
    rng = random.Random(3)
    numels = [rng.choice((64, 4096, rng.randint(1, 10**6))) for _ in range(100_000)]
    kwargs = {
        "dp_size": 24,
        "bucket_size": 40_000_000,
        "use_distributed_optimizer": True,
        "pad_buckets_for_high_nccl_busbw": True,
        "shared_embedding": (0, 50_000, 99_999),
    }
    fast = compute_layout(numels, **kwargs)
    ref = reference_layout(numels, **kwargs)
    assert fast.to_dict() == ref.to_dict()
    assert len(fast.bucket_indices) > 100


def test_numpy_input_and_equality():
    numels = [5, 300, 64, 1]
    kwargs = {"dp_size": 6, "bucket_size": 200, "use_distributed_optimizer": True,
              "pad_buckets_for_high_nccl_busbw": False}
    a = compute_layout(numels, **kwargs)
    b = compute_layout(np.array(numels, dtype=np.int32), **kwargs)
    assert a == b
    assert a != compute_layout(numels, **{**kwargs, "dp_size": 5})
    assert not a.param_starts.flags.writeable
    with pytest.raises(AttributeError):
        a.numel = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("numels", "kwargs", "error", "match"),
    [
        ([], {}, ValueError, "at least one"),
        ([3, 0], {}, ValueError, r"numels\[1\] must be positive"),
        ([3, 2.5], {}, TypeError, r"numels\[1\] must be an int"),
        ([3, True], {}, TypeError, r"numels\[1\] must be an int"),
        ([2**63], {}, ValueError, "2\\*\\*62"),
        (np.array([[1, 2]]), {}, ValueError, "one-dimensional"),
        (np.array([1.0]), {}, TypeError, "integers"),
        (np.array([2**63], dtype=np.uint64), {}, ValueError, "2\\*\\*62"),
        ([3], {"dp_size": 0}, ValueError, "dp_size must be positive"),
        ([3], {"dp_size": True}, TypeError, "dp_size must be an int"),
        ([3], {"bucket_size": -1}, ValueError, "bucket_size must be positive"),
        ([3], {"shared_embedding": [1]}, ValueError, "out of range"),
        ([3, 4], {"shared_embedding": [0, 0]}, ValueError, "listed twice"),
        ([3], {"shared_embedding": ["0"]}, TypeError, "must be ints"),
    ],
)
def test_bad_arguments(numels, kwargs, error, match):
    args = {"dp_size": 2, "bucket_size": None, "use_distributed_optimizer": True,
            "pad_buckets_for_high_nccl_busbw": False, **kwargs}
    with pytest.raises(error, match=match):
        compute_layout(numels, **args)


def test_shard_errors():
    layout = compute_layout([3, 4], dp_size=2, bucket_size=None, use_distributed_optimizer=False,
                            pad_buckets_for_high_nccl_busbw=False)
    with pytest.raises(ValueError, match="not divisible"):
        layout.shard(0, 0)
    with pytest.raises(ValueError, match="rank"):
        layout.shard(0, -1)
    with pytest.raises(ValueError, match="bucket_id"):
        layout.shard(3, 0)

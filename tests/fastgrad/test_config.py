"""DDPConfig validation and bucket-size resolution."""

import dataclasses

import pytest

from fastgrad.config import DDPConfig
from gradvocab import default_bucket_size


def test_defaults_match_production():
    config = DDPConfig()
    assert not config.use_distributed_optimizer and config.bucket_size is None
    # Without overlap production puts everything in one bucket.
    assert config.resolved_bucket_size(8) is None
    overlap = DDPConfig(overlap_grad_reduce=True)
    # max(40_000_000, 1_000_000 * dp): 40M up to dp 40, then 1M per rank.
    assert overlap.resolved_bucket_size(8) == 40_000_000
    assert overlap.resolved_bucket_size(40) == 40_000_000
    assert overlap.resolved_bucket_size(64) == 64_000_000
    assert DDPConfig(overlap_grad_reduce=True, bucket_size=123).resolved_bucket_size(512) == 123
    assert default_bucket_size(1024) == 1_024_000_000


def test_frozen_and_replace_revalidates():
    config = DDPConfig(use_distributed_optimizer=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bucket_size = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match="overlap_param_gather requires use_distributed_optimizer"):
        dataclasses.replace(config, use_distributed_optimizer=False, overlap_param_gather=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"bucket_size": 0}, ValueError, "bucket_size must be > 0"),
        ({"bucket_size": -5}, ValueError, "bucket_size must be > 0"),
        ({"bucket_size": 1.5}, TypeError, "bucket_size must be an int"),
        ({"bucket_size": True}, TypeError, "bucket_size must be an int"),
        ({"use_distributed_optimizer": 1}, TypeError, "use_distributed_optimizer must be a bool"),
        ({"overlap_param_gather": True}, ValueError, "overlap_param_gather requires"),
        (
            {"reduce_scatter_with_fp32_accumulation": True},
            ValueError,
            "reduce_scatter_with_fp32_accumulation requires use_distributed_optimizer",
        ),
        (
            {"reuse_grad_buf_for_mxfp8_param_ag": True, "use_distributed_optimizer": True},
            ValueError,
            "fp8_param_gather=True, overlap_param_gather=True, overlap_grad_reduce=True",
        ),
        (
            {
                "reuse_grad_buf_for_mxfp8_param_ag": True,
                "fp8_param_gather": True,
                "use_distributed_optimizer": True,
                "overlap_param_gather": True,
            },
            ValueError,
            "NaN",
        ),
    ],
)
def test_invalid_configs(kwargs, error, match):
    with pytest.raises(error, match=match):
        DDPConfig(**kwargs)


def test_valid_full_mxfp8_sharing_config():
    config = DDPConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        fp8_param_gather=True,
        reuse_grad_buf_for_mxfp8_param_ag=True,
    )
    assert config.to_dict()["reuse_grad_buf_for_mxfp8_param_ag"] is True


@pytest.mark.parametrize(("dp", "error"), [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_resolved_bucket_size_checks_dp(dp, error):
    with pytest.raises(error, match="dp_size"):
        DDPConfig(overlap_grad_reduce=True).resolved_bucket_size(dp)

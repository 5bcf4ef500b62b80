"""gradvocab.DDPConfig: the one DDP settings type validates itself (errors name the field and
the rule) and resolves the bucket size by Megatron-Core's rule, written out here by hand."""

import dataclasses

import pytest

from gradvocab import Averaging, DDPConfig


def megatron_bucket_size(overlap_grad_reduce: bool, bucket_size: int | None, dp: int) -> int | None:
    """Megatron-Core 0.16's ``DistributedDataParallel.__init__``, transcribed::

        if self.ddp_config.bucket_size is None:
            self.ddp_config.bucket_size = max(40000000, 1000000 * dp_group.size())
        if not self.ddp_config.overlap_grad_reduce:
            self.ddp_config.bucket_size = None
    """
    if bucket_size is None:
        bucket_size = max(40000000, 1000000 * dp)
    if not overlap_grad_reduce:
        bucket_size = None
    return bucket_size


@pytest.mark.parametrize("dp", [1, 2, 8, 39, 40, 41, 64, 512, 1024])
@pytest.mark.parametrize("bucket_size", [None, 1, 123, 40_000_001])
@pytest.mark.parametrize("overlap", [False, True])
def test_resolved_bucket_size_is_megatron_cores_rule(overlap, bucket_size, dp):
    config = DDPConfig(overlap_grad_reduce=overlap, bucket_size=bucket_size)
    assert config.resolved_bucket_size(dp) == megatron_bucket_size(overlap, bucket_size, dp)


def test_defaults_are_megatron_cores():
    config = DDPConfig()
    assert not any(v for k, v in config.to_dict().items() if k != "bucket_size")
    assert config.bucket_size is None
    assert list(config.to_dict()) == [f.name for f in dataclasses.fields(DDPConfig)]


def test_the_field_names_are_megatron_cores():
    megatron = pytest.importorskip("megatron.core.distributed")
    theirs = {f.name for f in dataclasses.fields(megatron.DistributedDataParallelConfig)}
    assert set(DDPConfig().to_dict()) <= theirs
    megatron.DistributedDataParallelConfig(**DDPConfig(overlap_grad_reduce=True).to_dict())


def test_frozen_and_replace_revalidates():
    config = DDPConfig(use_distributed_optimizer=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bucket_size = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match="overlap_param_gather requires use_distributed_optimizer"):
        dataclasses.replace(config, use_distributed_optimizer=False, overlap_param_gather=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"bucket_size": 0}, ValueError, r"DDPConfig.bucket_size must be positive \(> 0\) or None, got 0"),
        ({"bucket_size": -5}, ValueError, r"DDPConfig.bucket_size must be positive \(> 0\) or None, got -5"),
        ({"bucket_size": 1.5}, TypeError, "DDPConfig.bucket_size must be an int or None, got float"),
        ({"bucket_size": True}, TypeError, "DDPConfig.bucket_size must be an int or None, got bool"),
        ({"use_distributed_optimizer": 1}, TypeError, "DDPConfig.use_distributed_optimizer must be a bool"),
        ({"overlap_grad_reduce": "yes"}, TypeError, "DDPConfig.overlap_grad_reduce must be a bool, got str"),
        ({"reuse_grad_buf_for_mxfp8_param_ag": None}, TypeError,
         "DDPConfig.reuse_grad_buf_for_mxfp8_param_ag must be a bool"),
        ({"overlap_param_gather": True}, ValueError,
         "DDPConfig.overlap_param_gather requires use_distributed_optimizer=True"),
        (
            {"reduce_scatter_with_fp32_accumulation": True},
            ValueError,
            "DDPConfig.reduce_scatter_with_fp32_accumulation requires use_distributed_optimizer=True",
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
            "requires overlap_grad_reduce=True .*NaN",
        ),
    ],
)
def test_invalid_configs_name_the_field_and_the_rule(kwargs, error, match):
    with pytest.raises(error, match=match):
        DDPConfig(**kwargs)


def test_bucket_size_is_normalised_to_an_int():
    class Index:
        def __index__(self) -> int:
            return 60

    assert type(DDPConfig(bucket_size=Index()).bucket_size) is int


def test_valid_full_mxfp8_sharing_config():
    config = DDPConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        fp8_param_gather=True,
        reuse_grad_buf_for_mxfp8_param_ag=True,
    )
    assert config.to_dict()["reuse_grad_buf_for_mxfp8_param_ag"] is True


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("dp", "error"), [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_resolved_bucket_size_checks_dp(dp, error, overlap):
    with pytest.raises(error, match="dp_size"):
        DDPConfig(overlap_grad_reduce=overlap).resolved_bucket_size(dp)


@pytest.mark.parametrize(("average_in_collective", "default"),
                         [(False, Averaging.PRESCALE), (True, Averaging.AVG)])
def test_no_averaging_named_is_megatron_cores_default(average_in_collective, default):
    # Megatron-Core's DistributedDataParallel.__init__: gradient_scaling_factor = 1.0 and
    # ReduceOp.AVG with average_in_collective, else 1.0 / dp before a SUM
    config = DDPConfig(average_in_collective=average_in_collective)
    assert config.resolve_averaging(None) is default
    assert config.resolve_averaging(default) is default


@pytest.mark.parametrize("flag", [True, False])
def test_a_bool_is_not_an_averaging(flag):
    with pytest.raises(TypeError, match="averaging must be a gradvocab.Averaging or None, got bool"):
        DDPConfig().resolve_averaging(flag)


@pytest.mark.parametrize(("average_in_collective", "averaging"), [
    (True, Averaging.SUM), (True, Averaging.PRESCALE), (False, Averaging.AVG)])
def test_an_averaging_that_contradicts_average_in_collective_is_refused(average_in_collective, averaging):
    with pytest.raises(ValueError, match=f"averaging={averaging} contradicts "
                                         f"DDPConfig.average_in_collective={average_in_collective}"):
        DDPConfig(average_in_collective=average_in_collective).resolve_averaging(averaging)


def test_postscale_is_refused_as_megatron_core_has_no_flags_for_it():
    with pytest.raises(ValueError, match="POSTSCALE has no Megatron-Core flags"):
        DDPConfig().resolve_averaging(Averaging.POSTSCALE)

"""Every place the Megatron-Core candidate builds Megatron's ``DistributedDataParallelConfig``
from a ``gradvocab.DDPConfig`` goes through one guard (``version.megatron_ddp_config``): a
setting the installed version lacks is Unsupported with the feature's reason, a field its
dataclass does not have is dropped only while it is off. Runs without Megatron-Core: the
installed version is stood in for by a feature table and a dataclass of the fields it has."""

from __future__ import annotations

import dataclasses

import pytest

from gradvocab import DDPConfig
from verify.candidates.interfaces import Technique, Unsupported
from verify.candidates.megatron_core.version import Feature, MegatronCoreInfo, megatron_ddp_config


@dataclasses.dataclass
class OldDDPConfig:
    """A version whose config has neither average_in_collective nor the fp32-accumulating
    reduce-scatter, nor the MXFP8 buffer sharing fields."""

    use_distributed_optimizer: bool = False
    bucket_size: int | None = None
    pad_buckets_for_high_nccl_busbw: bool = False
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    fp8_param_gather: bool = False


OLD = MegatronCoreInfo("0.0-old", {
    "reduce_scatter_with_fp32_accumulation": Feature(False, "no fp32 RS in this version"),
    "average_in_collective": Feature(False, "no average_in_collective in this version"),
    "pad_buckets_for_high_nccl_busbw": Feature(True, "has the padding field"),
})


def refuse(reason: str) -> Unsupported:
    return Unsupported(Technique.OPTIMIZER, f"megatron-core {reason}")


def test_fields_the_version_lacks_are_dropped_only_while_off():
    built = megatron_ddp_config(DDPConfig(use_distributed_optimizer=True, bucket_size=40),
                                OLD, refuse, OldDDPConfig)
    assert built == OldDDPConfig(use_distributed_optimizer=True, bucket_size=40)


@pytest.mark.parametrize(("setting", "reason"), [
    ({"average_in_collective": True}, "no average_in_collective in this version"),
    ({"use_distributed_optimizer": True, "reduce_scatter_with_fp32_accumulation": True},
     "no fp32 RS in this version"),
])
def test_a_setting_the_version_lacks_is_unsupported_with_the_features_reason(setting, reason):
    with pytest.raises(Unsupported, match=reason):
        megatron_ddp_config(DDPConfig(**setting), OLD, refuse, OldDDPConfig)


def test_a_set_field_without_a_feature_entry_is_refused_not_lost():
    """reuse_grad_buf_for_mxfp8_param_ag on: the old dataclass has no such field; passing the
    rest would silently train without the sharing the caller asked for."""
    config = DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                       overlap_param_gather=True, fp8_param_gather=True,
                       reuse_grad_buf_for_mxfp8_param_ag=True, grad_reduce_in_fp32=True)
    with pytest.raises(Unsupported, match="has no field 'reuse_grad_buf_for_mxfp8_param_ag'"):
        megatron_ddp_config(config, OLD, refuse, OldDDPConfig)

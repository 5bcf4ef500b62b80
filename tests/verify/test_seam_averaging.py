"""The seam's averaging is one type, ``gradvocab.Averaging``, and its DDP settings one type,
``gradvocab.DDPConfig``: a bool where an Averaging is expected is a TypeError naming the
parameter, at every place the seam takes one (``ReductionConfig.averaging``,
``BucketLayout.build_buffer(averaging=)``, ``DistributedOptimizerStep.data_parallel(averaging=)``,
the layout check's ``ReduceScenario.averaging``; Megatron-Core's ``data_parallel`` in
tests/candidates/test_megatron_core_candidate.py). Expected values are Megatron-Core's flags,
written out by hand from ``DistributedDataParallel.__init__``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradvocab import Averaging, DDPConfig
from verify.candidates.fastgrad.layout import FastgradLayout
from verify.candidates.fastgrad.optimizer import FastgradOptimizer
from verify.candidates.interfaces import ReductionConfig
from verify.candidates.torch_fsdp2.optimizer import TorchFSDP2Optimizer
from verify.checks.layout.worker import ReduceScenario
from verify.checks.optim.cases import OptimCase

DIST_OPT = DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=64)


@pytest.mark.parametrize("value", [True, False, "prescale", 1])
def test_a_reduction_config_refuses_anything_but_an_averaging(value):
    with pytest.raises(TypeError, match="ReductionConfig.averaging must be a gradvocab.Averaging"):
        ReductionConfig(averaging=value)


def test_a_reduction_config_refuses_postscale_which_megatron_cannot_spell():
    with pytest.raises(ValueError, match="POSTSCALE has no Megatron-Core flags"):
        ReductionConfig(averaging=Averaging.POSTSCALE)


@pytest.mark.parametrize(("averaging", "in_collective", "per_token"), [
    (Averaging.PRESCALE, False, False),  # Megatron-Core's default: 1/dp gradient scaling factor
    (Averaging.AVG, True, False),        # average_in_collective
    (Averaging.SUM, False, True),        # calculate_per_token_loss
])
def test_a_reduction_configs_megatron_flags(averaging, in_collective, per_token):
    flags = ReductionConfig(averaging=averaging).megatron_flags()
    assert (flags.average_in_collective, flags.calculate_per_token_loss) == (in_collective, per_token)
    assert ReductionConfig().averaging is Averaging.PRESCALE


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3, 5)), nn.Parameter(torch.zeros(40))]


def test_build_buffer_refuses_a_bool_for_averaging():
    with pytest.raises(TypeError, match="averaging must be a gradvocab.Averaging"):
        FastgradLayout().build_buffer(_params(), DIST_OPT, dp_size=2, averaging=True)


def test_build_buffer_refuses_an_averaging_its_config_contradicts():
    with pytest.raises(ValueError, match="contradicts DDPConfig.average_in_collective=False"):
        FastgradLayout().build_buffer(_params(), DIST_OPT, dp_size=2, averaging=Averaging.AVG)


@pytest.mark.parametrize("optimizer", [FastgradOptimizer(), TorchFSDP2Optimizer()],
                         ids=["fastgrad", "torch-fsdp2"])
def test_data_parallel_refuses_a_bool_for_averaging(optimizer):
    # refused before any process group is touched: no world is set up here
    with pytest.raises(TypeError, match="averaging must be a gradvocab.Averaging"):
        optimizer.data_parallel(nn.Linear(2, 2), DIST_OPT, None, averaging=True)


def test_a_reduce_scenario_refuses_a_bool_for_averaging():
    with pytest.raises(TypeError, match="averaging must be a gradvocab.Averaging"):
        ReduceScenario("bool", ((3,),), ("float32",), DIST_OPT, averaging=True)


@pytest.mark.parametrize(("ranks", "averaging"), [
    ((0, 1), Averaging.PRESCALE), ((0, 1, 2, 3), Averaging.PRESCALE), ((0, 1, 2), Averaging.SUM)])
def test_the_optim_check_averages_at_power_of_two_dp_only(ranks, averaging):
    case = OptimCase(ranks=ranks, algorithm="adamw", grads="bf16", main_grads_fp32=True,
                     clip=None, overlap=True, steps=2)
    assert case.averaging is averaging
    config = case.ddp_config()
    assert (config.use_distributed_optimizer, config.overlap_grad_reduce,
            config.overlap_param_gather, config.grad_reduce_in_fp32) == (True, True, True, True)

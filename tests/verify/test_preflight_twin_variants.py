"""The twin's typed variants (``verify.preflight.twin.variants``), the run a rank is handed
(``TwinRun``), and ``PreflightConfig``'s one carrier of the grid's sizes (``ParallelDims``)."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from gradvocab import CONSTANT_SCALE_WINDOW, LossScaling, ParallelDims, RankResult
from tests.candidates.fastgrad_faults import Fault, FaultyFastgrad
from tests.distributed_utils import run_distributed
from tests.verify.preflight_launch import preflight_config
from verify.candidates import FastgradCandidate
from verify.candidates.interfaces import (
    MXFP8Params,
    StageSettings,
)
from verify.preflight.config import ConfigError
from verify.preflight.twin import (
    AdamWTwin,
    MXFP8Twin,
    SGDTwin,
    TwinOptions,
    TwinPrecision,
    plan_twin,
)
from verify.preflight.twin.rank import TwinRun, twin_phases_worker
from verify.preflight.twin.reference import reference_for
from verify.preflight.twin.variants import TWIN_ADAMW, TWIN_SCHEDULE, Dtype, adamw_of
from verify.preflight.twin.verdict import _ranks, twin_section

MODEL = ["--micro-batch-size", "1", "--num-layers", "4", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
         "--padded-vocab-size", "128"]


def test_each_variant_says_what_the_candidate_builds_for_it():
    """SGD: no model settings, no optimizer (the candidate's own ``train``); AdamW: its dtypes,
    overlaps and scaler; MXFP8: fp32 stages over MXFP8 params and AdamW's settings."""
    assert SGDTwin().stage_settings(True) is None and SGDTwin().optimizer_settings() is None
    adamw = AdamWTwin(max_grad_norm=0.5, loss_scale=256.0, dynamic=True, min_loss_scale=2.0,
                      loss_scale_window=7, hysteresis=3, overlap_param_gather=True,
                      precision=TwinPrecision("bf16", "fp32"))
    assert adamw.stage_settings(True) == StageSettings(
        param_dtype=torch.bfloat16, grad_dtype=torch.float32, overlap_grad_reduce=True,
        overlap_param_gather=True)
    settings = adamw.optimizer_settings()
    assert settings.adamw == TWIN_ADAMW and settings.max_grad_norm == 0.5
    # the lr and weight decay of each update: the twin's schedule, its peak and end TWIN_ADAMW's
    assert settings.schedule == TWIN_SCHEDULE == adamw.schedule
    assert (TWIN_SCHEDULE.max_lr, TWIN_SCHEDULE.end_wd) == (TWIN_ADAMW.lr, TWIN_ADAMW.weight_decay)
    values = TWIN_SCHEDULE.values(3)
    assert len({lr for lr, _ in values}) == 3 and len({wd for _, wd in values}) == 3, values
    assert settings.loss_scaling == LossScaling(initial_scale=256.0, min_scale=2.0,
                                                growth_interval=7, hysteresis=3)
    constant = replace(adamw, dynamic=False).loss_scaling
    assert (constant.min_scale, constant.growth_interval) == (256.0, CONSTANT_SCALE_WINDOW)
    assert not constant.dynamic and settings.loss_scaling.dynamic
    mx = MXFP8Twin(adamw=AdamWTwin(overlap_param_gather=True), reuse_grad_buffer=True)
    assert mx.stage_settings(False) == StageSettings(overlap_param_gather=True,
                                                     mxfp8=MXFP8Params(reuse_grad_buffer=True))
    assert [adamw_of(t) for t in (SGDTwin(), adamw, mx)] == [None, adamw, mx.adamw]
    assert {SGDTwin.name, AdamWTwin.name, MXFP8Twin.name} == {
        "sgd", "adamw", "adamw over MXFP8 params"}


def test_variants_refuse_what_they_cannot_be():
    with pytest.raises(ValueError, match="AdamWTwin.loss_scale must be a power of two"):
        AdamWTwin(loss_scale=1000.0)
    with pytest.raises(TypeError, match="AdamWTwin.precision must be a TwinPrecision"):
        AdamWTwin(precision="bf16")
    with pytest.raises(TypeError, match="MXFP8Twin.adamw must be an AdamWTwin"):
        MXFP8Twin(adamw=SGDTwin())
    with pytest.raises(ValueError, match="MXFP8Twin.adamw.loss_scale must be None"):
        MXFP8Twin(adamw=AdamWTwin(loss_scale=8.0))
    with pytest.raises(ValueError, match="MXFP8Twin.adamw.precision must be fp32"):
        MXFP8Twin(adamw=AdamWTwin(precision=TwinPrecision("bf16")))
    with pytest.raises(ValueError, match=r"TwinPrecision.params must be one of \['fp32', 'bf16', 'fp16'\]"):
        TwinPrecision("fp8")
    with pytest.raises(ValueError, match="MXFP8Params|StageSettings.mxfp8 computes in fp32"):
        StageSettings(param_dtype=torch.bfloat16, mxfp8=MXFP8Params())
    with pytest.raises(ValueError, match="LossScaling.initial_scale must be a power of two"):
        LossScaling(initial_scale=3.0, min_scale=1.0, growth_interval=1, hysteresis=1)


def test_precision_takes_megatrons_names_and_prints_them():
    precision = TwinPrecision("bf16", "fp32")
    assert precision == TwinPrecision(Dtype.BF16, Dtype.FP32) and precision.mixed
    assert (precision.param_dtype, precision.grad_dtype) == (torch.bfloat16, torch.float32)
    assert f"{precision.params} params, {precision.grads} grads" == "bf16 params, fp32 grads"
    assert not TwinPrecision().mixed


def test_a_twin_run_is_typed_and_travels_to_the_ranks():
    config = preflight_config(MODEL + ["--world-size", "2", "--pipeline-model-parallel-size", "2",
                                       "--global-batch-size", "2"])
    plan = plan_twin(config, TwinOptions(hidden_size=8, steps=2))
    run = TwinRun(plan.case, plan.overlap, plan.training,
                  FaultyFastgrad(Fault.LIFO_DRAIN))
    assert pickle.loads(pickle.dumps(run)) == run
    with pytest.raises(TypeError, match="TwinRun.training must be one of"):
        TwinRun(plan.case, plan.overlap, "adamw")
    with pytest.raises(TypeError, match="TwinRun.candidate must be a Candidate"):
        TwinRun(plan.case, plan.overlap, plan.training, "fastgrad")


@pytest.mark.dist
def test_the_sgd_variant_trains_through_the_candidates_own_training():
    """SGD: the ranks call the candidate's ``PipelineTraining.train`` (the pipeline check's),
    and the twin holds it to refgrad.pipeline.reference_training, bitwise at DP 2; a LIFO
    drain fails on the head's grad."""
    config = preflight_config(MODEL + ["--world-size", "4", "--pipeline-model-parallel-size", "2",
                                       "--global-batch-size", "8", "--defer-embedding-wgrad-compute"])
    plan = replace(plan_twin(config, TwinOptions(hidden_size=8, steps=2)), training=SGDTwin())
    broken = FaultyFastgrad(Fault.LIFO_DRAIN)
    runs = [TwinRun(plan.case, plan.overlap, plan.training),
            TwinRun(plan.case.at(4), plan.overlap, plan.training, broken)]
    ranks = run_distributed(twin_phases_worker, 8, [runs], timeout_s=300)
    assert all(isinstance(r[0][0 if i < 4 else 1], RankResult) for i, r in enumerate(ranks))
    good = twin_section(config, plan, [r[0][0] for r in ranks], where="test",
                        candidate=FastgradCandidate())
    assert good["passed"] and good["optimizer"] == "sgd", good["failures"][:3]
    assert all(s["grads_bitwise"] == s["grads_total"] > 0 and s["state_total"] == 0
               for s in good["steps"])
    bad = twin_section(config, replace(plan, case=plan.case.at(4)), [r[0][1] for r in ranks],
                       where="test", candidate=broken)
    assert not bad["passed"] and bad["candidate"] == "fastgrad (fault: lifo_drain)"
    assert any(f.startswith("step 0: reduced gradient stage1.head.weight (replica 0)")
               for f in bad["failures"])
    # refgrad's SGD run at the case's lr
    assert reference_for(plan.case, plan.training).losses


def test_preflight_config_holds_one_parallel_dims():
    config = preflight_config(MODEL + ["--world-size", "16", "--tensor-model-parallel-size", "2",
                                       "--pipeline-model-parallel-size", "2",
                                       "--num-virtual-stages-per-pipeline-rank", "2",
                                       "--context-parallel-size", "2", "--sequence-parallel",
                                       "--global-batch-size", "8"])
    assert config.dims == ParallelDims(tp_size=2, cp_size=2, dp_size=2, pp_size=2, vpp_size=2,
                                       sequence_parallel=True)
    assert not config.dims.built
    # Megatron's names are views of it, and the JSON keeps them
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
            config.virtual_pipeline_model_parallel_size, config.context_parallel_size,
            config.data_parallel_size, config.sequence_parallel) == (2, 2, 2, 2, 2, True)
    assert config.data_context_parallel_size == 4 and config.shape == "TP=2 PP=2 VPP=2 CP=2 DP=2"
    out = config.to_dict()
    assert "dims" not in out and out["data_parallel_size"] == 2 and out["sequence_parallel"] is True
    with pytest.raises(AttributeError):
        config.data_parallel_size = 3
    with pytest.raises(TypeError, match="PreflightConfig.dims must be a ParallelDims"):
        replace(config, dims=(2, 2, 2))
    # the twin's case carries a ParallelDims too: the config's, scaled
    plan = plan_twin(config, TwinOptions(hidden_size=8, max_world_size=16))
    assert plan.case.dims == replace(config.dims, cp_size=1, dp_size=4)


def test_the_sizes_are_checked_under_their_flags_before_the_dims_are_built():
    with pytest.raises(ConfigError, match=r"--num-virtual-stages-per-pipeline-rank \(VPP 2, "
                                          r"interleaved schedule\) requires "
                                          r"--pipeline-model-parallel-size >= 2, got 1"):
        preflight_config(MODEL + ["--world-size", "1", "--num-virtual-stages-per-pipeline-rank", "2"])
    # validate_args turns sequence parallelism off at TP 1 (noted), so the dims never see it
    config = preflight_config(MODEL + ["--world-size", "1", "--sequence-parallel"])
    assert not config.dims.sequence_parallel
    assert any("--sequence-parallel ignored" in n for n in config.notes)


def test_a_twin_scaled_below_the_launchs_tp_says_so_in_the_verdict():
    """A TP 2 launch whose twin ran at TP 1 has not had its tensor parallelism checked: the
    verdict's first line says so, not only the list of what was not twinned."""
    assert _ranks({"world_size": 2, "tp_size": 1}, launch_tp=2) == "2 ranks, TP 2 scaled to TP 1"
    assert _ranks({"world_size": 4, "tp_size": 2}, launch_tp=2) == "4 ranks"

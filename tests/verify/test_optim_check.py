"""The ``optim`` check: fastgrad's optimizer passes it; broken optimizers fail it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fastgrad.mxfp8_sharing import MXFP8ParamGradBuffer
from fastgrad.optim import DistributedOptimizer
from tests.distributed_utils import run_distributed
from verify.check import FAIL, PASS, CheckContext, CheckRecorder
from verify.checks import check_by_name
from verify.checks.optim import OptimCandidate
from verify.checks.optim.cases import case_matrix
from verify.checks.optim.mxfp8 import compare_runs, refgrad_trajectory, train_mxfp8


class DecaysEverything(DistributedOptimizer):
    """Broken on purpose: drops the param groups' overrides, so biases and norm weights decay."""

    def __init__(self, ddp, config, param_groups=None, **kwargs):
        plain = None if param_groups is None else [{"params": g["params"]} for g in param_groups]
        super().__init__(ddp, config, plain, **kwargs)


class LocalNorm(DistributedOptimizer):
    """Broken on purpose: all-reduces the NaN/inf count but not the sum of squares, so each
    rank clips by the norm of its own shard."""

    def _all_reduce(self, tensor):
        flag = tensor[-1:].clone()
        super()._all_reduce(flag)
        tensor[-1:] = flag


class LrOneUlpOnMXFP8(DistributedOptimizer):
    """Broken on purpose: lr one fp32 ULP too large, on MXFP8 buffers only."""

    def __init__(self, ddp, config, *args, **kwargs):
        if isinstance(ddp, MXFP8ParamGradBuffer):
            lr = float(np.nextafter(np.float32(config.lr), np.float32(1.0)))
            config = dataclasses.replace(config, lr=lr)
        super().__init__(ddp, config, *args, **kwargs)


def _quick(candidate=None):
    return check_by_name("optim").execute(CheckContext(quick=True), candidate)


@pytest.mark.dist
def test_fastgrad_passes_quick():
    result = _quick()
    assert result.status == PASS, (result.error, result.failed_labels())
    assert not any("MXFP8" in s for s in result.skipped)
    mxfp8 = [c.label for c in result.comparisons if c.label.startswith("optim MXFP8 DP=2 ")]
    for kind in ("adamw", "sgd"):
        for sharing in ("on", "off"):
            for what in ("masters param 0", "param 0 element bits (rank 1)"):
                assert f"optim MXFP8 DP=2 {kind} sharing {sharing} grads fp32 step 2 {what}" in mxfp8
    assert any("torch.optim.AdamW" in f for f in result.findings)


@pytest.mark.dist
def test_weight_decay_on_biases_fails():
    result = _quick(OptimCandidate(DecaysEverything))
    assert result.status == FAIL, result.error
    failed = result.failed_labels()
    # Every case decays the 2-D weights only; the broken one decays the 1-D params too.
    assert any("adamw" in label and label.endswith("params") for label in failed), failed
    assert any("sgd" in label and label.endswith("master") for label in failed), failed


@pytest.mark.dist
def test_norm_without_all_reduce_fails_where_clipping_at_dp_above_1():
    result = _quick(OptimCandidate(LocalNorm))
    assert result.status == FAIL, result.error
    failed = result.failed_labels()
    assert any(" clip " in label and "DP=1 " not in label for label in failed), failed
    # DP=1 has nothing to all-reduce, and unclipped cases never use the norm: they still pass.
    assert not any("DP=1 " in label or " noclip " in label for label in failed), failed


def _mxfp8_worker(rank: int, world: int, optimizer_cls) -> dict:
    return train_mxfp8(rank, "adamw", True, True, seed=5, optimizer_cls=optimizer_cls)


@pytest.mark.dist
def test_mxfp8_comparisons_catch_lr_one_ulp_off():
    runs = run_distributed(_mxfp8_worker, 2, LrOneUlpOnMXFP8)
    rec = CheckRecorder("optim")
    compare_runs(rec, "optim MXFP8 DP=2 adamw sharing on grads fp32", runs, refgrad_trajectory(runs, "adamw"))
    failed = rec.finish(0.0).failed_labels()
    assert "optim MXFP8 DP=2 adamw sharing on grads fp32 step 1 masters param 0" in failed, failed


def test_candidate_must_be_a_class():
    with pytest.raises(TypeError, match="optimizer_cls must be a class"):
        OptimCandidate("x")


def test_matrix_covers_every_dimension_in_quick_and_default():
    for quick in (True, False):
        cases = case_matrix(quick)
        assert {c.dp for c in cases} == {1, 2, 3, 4}
        assert {c.algorithm for c in cases} == {"adamw", "sgd"}
        assert {c.grads for c in cases} == {"bf16", "fp16"}
        assert {c.main_grads_fp32 for c in cases} == {True, False}
        assert {c.clip is None for c in cases} == {True, False}
        assert {c.overlap for c in cases} == {True, False}


def test_mxfp8_references_are_shared_only_between_runs_with_the_same_inputs():
    """check_mxfp8 computes refgrad's trajectory once per distinct input: the key must see
    one bit of one grad, the dtype, and the buffer layout, and nothing else."""
    import torch

    from verify.checks.optim.entry import _trajectory_inputs

    def runs(grad_value=0.5, dtype=torch.float32, buckets=((0, 4),)):
        step = {"grads": [torch.full((2,), grad_value, dtype=dtype)], "masters": ["ignored"]}
        return [{"initial": [torch.ones(4)], "steps": [step], "param_ranges": [(0, 4)],
                 "buckets": list(buckets), "sharing": r == 0} for r in range(2)]

    base = _trajectory_inputs(runs())
    assert _trajectory_inputs(runs()) == base  # sharing and masters are not inputs
    one_ulp = float(torch.nextafter(torch.tensor(0.5), torch.tensor(1.0)))
    assert _trajectory_inputs(runs(one_ulp)) != base
    assert _trajectory_inputs(runs(dtype=torch.bfloat16)) != base
    assert _trajectory_inputs(runs(buckets=((0, 2), (2, 4)))) != base

"""The ``optim`` check: fastgrad's optimizer passes it; broken optimizers fail it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fastgrad.mxfp8_sharing import MXFP8ParamGradBuffer
from fastgrad.optim import DistributedOptimizer
from tests.distributed_utils import run_distributed
from tests.verify.broken_optimizers import (
    HysteresisOneEarly,
    HysteresisOneLate,
    IgnoresSchedulerChanges,
)
from verify.candidates import FastgradCandidate
from verify.candidates.fastgrad.optimizer import FastgradOptimizer
from verify.check import FAIL, PASS, CheckContext, CheckRecorder
from verify.checks import check_by_name
from verify.checks.optim.cases import OptimCase, case_matrix
from verify.checks.optim.compare import check_case
from verify.checks.optim.entry import _trajectory_inputs
from verify.checks.optim.expectations import case_trajectory
from verify.checks.optim.mxfp8 import compare_runs, refgrad_trajectory, train_mxfp8
from verify.checks.optim.records import CaseResult
from verify.checks.optim.worker import _train
from verify.distributed import RankCrashed


@dataclasses.dataclass(frozen=True)
class BrokenOptimizerCandidate(FastgradCandidate):
    """fastgrad with a broken ``DistributedOptimizer`` subclass behind the same seam."""

    optimizer_cls: type = DistributedOptimizer

    def optimizer(self) -> FastgradOptimizer:
        return FastgradOptimizer(sharded_cls=self.optimizer_cls)


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


class WorldPerCaseOptimizer(FastgradOptimizer):
    """fastgrad's optimizer, run as a candidate whose optimizer cannot share a world is
    (Megatron-Core's, FSDP2's): every case, and each resume, in a world of its own."""

    shares_a_world = False


@dataclasses.dataclass(frozen=True)
class WorldPerCaseCandidate(FastgradCandidate):
    def optimizer(self) -> FastgradOptimizer:
        return WorldPerCaseOptimizer()


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
    assert any("torch.optim.AdamW" in f for f in result.notes)


@pytest.mark.dist
def test_a_candidate_that_cannot_share_a_world_still_resumes_the_checkpoint():
    """The checkpoint case's world runs no resume; the resume worlds after it must still get
    its checkpoint (they were skipped, and failed as steps no run reached, before)."""
    result = _quick(WorldPerCaseCandidate())
    assert result.status == PASS, (result.error, result.failed_labels())
    resumed = [c.label for c in result.comparisons if "resumed" in c.label]
    assert any("resumed after step" in label for label in resumed), resumed
    assert any("resumed from DP=2" in label for label in resumed), resumed


@pytest.mark.dist
def test_weight_decay_on_biases_fails():
    result = _quick(BrokenOptimizerCandidate(optimizer_cls=DecaysEverything))
    assert result.status == FAIL, result.error
    failed = result.failed_labels()
    # Every case decays the 2-D weights only; the broken one decays the 1-D params too.
    assert any("adamw" in label and label.endswith("params") for label in failed), failed
    assert any("sgd" in label and label.endswith("master") for label in failed), failed


@pytest.mark.dist
def test_an_optimizer_that_ignores_the_schedules_changes_fails():
    """Every case of the quick matrix changes its lr and weight decay at every update
    (``cases.SCHEDULES``): an optimizer that keeps its first step's values matches refgrad at
    step 1 and fails at the second update, in every case that makes one (the fp16 cases skip
    step 2 on their inf: their second update would be step 3, beyond the quick matrix)."""
    result = _quick(BrokenOptimizerCandidate(optimizer_cls=IgnoresSchedulerChanges))
    assert result.status == FAIL, result.error
    failed = result.failed_labels()
    for case in case_matrix(quick=True):
        if case.inf_at is None:
            assert f"{case.label} step 2 master" in failed, (case.label, failed)
    assert not any(" step 1 " in label for label in failed), failed


@pytest.mark.dist
def test_norm_without_all_reduce_fails_where_clipping_at_dp_above_1():
    result = _quick(BrokenOptimizerCandidate(optimizer_cls=LocalNorm))
    assert result.status == FAIL, result.error
    failed = result.failed_labels()
    assert any(" clip " in label and "DP=1 " not in label for label in failed), failed
    # DP=1 has nothing to all-reduce; unclipped cases never use the norm for the update, so
    # there only the reported norm (compared with refgrad's) is wrong.
    assert not any("DP=1 " in label for label in failed), failed
    noclip = [label for label in failed if " noclip " in label]
    assert noclip and all("global grad norm" in label for label in noclip), noclip


def _mxfp8_worker(rank: int, world: int, optimizer_cls) -> dict:
    return train_mxfp8(FastgradOptimizer(sharded_cls=optimizer_cls).mxfp8(), rank, "adamw", True, True,
                       seed=5)


@pytest.mark.dist
def test_mxfp8_comparisons_catch_lr_one_ulp_off():
    runs = run_distributed(_mxfp8_worker, 2, LrOneUlpOnMXFP8)
    rec = CheckRecorder("optim")
    compare_runs(rec, "optim MXFP8 DP=2 adamw sharing on grads fp32", runs, refgrad_trajectory(runs, "adamw"))
    failed = rec.finish(0.0).failed_labels()
    assert "optim MXFP8 DP=2 adamw sharing on grads fp32 step 1 masters param 0" in failed, failed


def test_the_optimizer_class_must_be_a_class():
    with pytest.raises(TypeError, match="sharded_cls must be a class"):
        FastgradOptimizer(sharded_cls="x")


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


# --------------------------------------------------------------------------- the check's former blind spots
# Each broken optimizer is held to one case of the matrix (remapped onto ranks 0..DP-1) through
# the check's own rank code (worker._train) and comparisons (entry._check_case): a few seconds
# each instead of the whole check.


class CountsTiedCopyInNorm(DistributedOptimizer):
    """Broken on purpose: ignores the ``shared`` marker, so the tied copy counts twice in the norm."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for shard in self.shards:
            for piece in shard.pieces:
                piece.param.shared = False


class SkipDecidedPerRank(DistributedOptimizer):
    """Broken on purpose: all-reduces the norm limbs but not the NaN/inf count."""

    def _all_reduce(self, tensor):
        local = tensor[-1:].clone()
        super()._all_reduce(tensor)
        tensor[-1:] = local


class WaitsAfterTheForward(DistributedOptimizer):
    """Broken on purpose: waits for a module's param all-gather after its forward, not before."""

    def _register_forward_pre_hooks(self):
        shard_of = {p: s for s in self.shards for p in s.bucket.params}
        hooks = []
        for module in self.ddp.module.modules():
            mine = {id(shard_of[p]): shard_of[p] for p in module.parameters(recurse=False) if p in shard_of}
            if mine:
                shards = list(mine.values())
                hooks.append(module.register_forward_hook(lambda _m, _a, _o, s=shards: self._wait(s)))
        return hooks


class PublishesStaleShard(DistributedOptimizer):
    """Broken on purpose: publishes the masters of the step before (a stale shard)."""

    def _publish_bucket(self, shard, cast=True):
        previous = getattr(shard, "previous_master", None)
        shard.previous_master = shard.master.clone()
        if previous is None:
            return super()._publish_bucket(shard, cast)
        current, shard.master = shard.master, previous
        try:
            return super()._publish_bucket(shard, True)
        finally:
            shard.master = current


def _case_worker(rank: int, world: int, cases, optimizer_cls) -> list[CaseResult]:
    """The check's rank code for each case on this world (ranks 0..DP-1, the whole world)."""
    bookkeeping = dist.new_group(list(range(world)))
    return [_train(case, None, rank, FastgradOptimizer(sharded_cls=optimizer_cls), 0,
                   bookkeeping=bookkeeping if case.overlap and case.dp > 1 else None) for case in cases]


def _failed_labels(cases, optimizer_cls) -> list[list[str]]:
    per_rank = run_distributed(_case_worker, cases[0].dp, cases, optimizer_cls)
    out = []
    for index, case in enumerate(cases):
        rec = CheckRecorder("optim")
        check_case(rec, case, [runs[index] for runs in per_rank], case_trajectory(case, 0)[0])
        out.append(rec.finish(0.0).failed_labels())
    return out


DP2 = (0, 1)
CLIPPED = OptimCase(DP2, "adamw", "bf16", False, 0.5, True, 3)  # the checkpoint case's settings
FP16_SYNC = OptimCase(DP2, "sgd", "fp16", False, None, False, 3)  # the matrix's, hysteresis 1
FP16_OVERLAP = OptimCase(DP2, "adamw", "fp16", False, 0.5, True, 3, hysteresis=2)  # the DP=4 one's
PARAM_LOSS = OptimCase(DP2, "adamw", "bf16", True, 0.5, True, 3, param_loss=True)


@pytest.mark.dist
def test_the_cases_below_pass_with_fastgrad():
    failed = _failed_labels([CLIPPED, FP16_SYNC, FP16_OVERLAP, PARAM_LOSS], DistributedOptimizer)
    assert failed == [[], [], [], []], failed


@pytest.mark.dist
def test_a_norm_counting_the_tied_copy_fails():
    (failed,) = _failed_labels([CLIPPED], CountsTiedCopyInNorm)
    assert any("global grad norm" in label for label in failed), failed
    assert any(label.endswith(" params") for label in failed), failed  # clipped by a wrong norm


@pytest.mark.dist
@pytest.mark.parametrize(("broken", "case"), [(HysteresisOneLate, FP16_SYNC), (HysteresisOneEarly, FP16_OVERLAP)],
                         ids=["hysteresis-1-backs-off-late", "hysteresis-2-backs-off-early"])
def test_a_hysteresis_off_by_one_fails(broken, case):
    (failed,) = _failed_labels([case], broken)
    # unscaling by a power of two is exact: only the scale itself shows the error
    assert failed and all("loss scale" in label for label in failed), failed


@pytest.mark.dist
def test_a_skip_decided_per_rank_fails_instead_of_hanging():
    (failed,) = _failed_labels([FP16_OVERLAP], SkipDecidedPerRank)
    assert any("stepped=False on every rank" in label for label in failed), failed
    assert any(label.endswith(" params") for label in failed), failed


@pytest.mark.dist
def test_a_param_gather_waited_after_the_forward_fails():
    (failed,) = _failed_labels([PARAM_LOSS], WaitsAfterTheForward)
    assert any("read every param after its all-gather arrived" in label for label in failed), failed


@pytest.mark.dist
@pytest.mark.parametrize("case", [CLIPPED, FP16_SYNC], ids=["overlap", "sync"])
def test_a_stale_published_shard_is_a_crash_of_fastgrads_own_guard(case):
    # The stale masters overwrite params the optimizer published: fastgrad's publication
    # guard (fastgrad/optim/publication.py _check_unmodified) refuses at the next gather. The
    # check does not step past an error to compare what it left: the world ends, every rank's
    # root cause named.
    with pytest.raises(RankCrashed) as info:
        _failed_labels([case], PublishesStaleShard)
    for failure in info.value.failures.values():
        assert failure.exception == "LifecycleError", failure
        assert "was modified between the launch of bucket" in failure.message
        assert failure.root.function == "_check_unmodified"

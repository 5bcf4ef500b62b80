"""The ``optim`` check against Megatron-Core: every difference from refgrad classified.

Expected classification (megatron-core 0.16.1, quick matrix; the numbers are refgrad's,
computed by the check: ``refgrad.optim`` for the spec, ``refgrad.optim_torch`` clipped with
Megatron-Core's own norm for its documented AdamW):

* PASS: every AdamW case (DP 1, 2 and 4; bf16 and fp16 params with fp32 main params; fp16's
  dynamic loss scaler with its inf step and hysteresis; overlap_param_gather; a loss that
  depends on the params) is held bitwise to refgrad's model of torch.optim.AdamW's order, its
  params after the all-gather equal on every rank, its scaler states Megatron's rule derived
  by hand;
* documented: its grad norm (fp32 partial sums, within γ(n + k + R + 8) of the exact one),
  the masters and moments where torch.optim.AdamW's order lands away from refgrad's spec, and
  with overlap_param_gather no all-gather in flight after the step (the next forward launches it);
* SKIP with the reason: the SGD cases (DistributedOptimizer asserts Adam), the checkpoint
  resumes (not wired), MXFP8 params (Transformer Engine, CUDA).

A copy of the candidate whose optimizer does not clip fails the clipped case's masters; one
whose ``OptimizerParamScheduler`` holds the lr and weight decay constant (the adapter before
issue 31) fails the check (every case changes both at every update); one that reads masters
through ``model_param_group_index_map`` (REFERENCE_NOTES §12, finding 7) fails the cases whose
param groups mix bf16 and fp32 params; one whose scheduler advances on a skipped step fails
the update after the skip.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch.distributed as dist

from verify.candidates.megatron_core.version import missing_reason
from verify.checks.optim.records import CaseResult

pytestmark = [pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason())),
              pytest.mark.dist]

if missing_reason() is None:
    from verify.candidates.megatron_core.candidate import MegatronCoreCandidate
    from verify.candidates.megatron_core.optimizer import MegatronOptimizer
    from verify.candidates.megatron_core.sharded_optimizer import MegatronShardedOptimizer

    class SkipsClipping(MegatronShardedOptimizer):
        """Broken on purpose: Megatron's optimizer with clipping turned off after it is built
        (``ChainedOptimizer.step`` still takes and returns the norm, and clips nothing)."""

        def __init__(self, model, settings) -> None:
            super().__init__(model, settings)
            for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                inner.config.clip_grad = 0.0

    @dataclass(frozen=True)
    class UnclippedMegatron(MegatronCoreCandidate):
        """Megatron-Core whose optimizer skips clipping (a copy of the candidate, broken)."""

        def optimizer(self) -> MegatronOptimizer:
            return MegatronOptimizer(sharded_cls=SkipsClipping)


def _quick(candidate):
    from verify.check import CheckContext
    from verify.checks import check_by_name

    return check_by_name("optim").execute(CheckContext(quick=True), candidate)


def test_a_megatron_core_whose_scheduler_holds_the_lr_fails_the_check():
    """Planted fault: Megatron's OptimizerParamScheduler built constant (peak lr, final weight
    decay), whatever the settings' schedule asks: every AdamW case's first update already
    used another lr (the schedule's warm-up starts below the peak)."""
    from tests.candidates.megatron_faults import ConstantlyScheduledOptimizer, MegatronWithOptimizer
    from verify.check import FAIL

    result = _quick(MegatronWithOptimizer(sharded=ConstantlyScheduledOptimizer))
    assert result.status == FAIL, (result.error, result.failed_labels())
    failed = result.failed_labels()
    for case in ("DP=1 adamw bf16/fp32 clip sync", "DP=2 adamw bf16/bf16 clip overlap",
                 "DP=4 adamw fp16/fp16 clip overlap", "DP=2 adamw bf16/fp32 clip overlap param-loss"):
        assert any(label.startswith(f"optim {case} step 1 master (documented: ") for label in failed), (
            case, failed)


def test_a_megatron_core_read_through_the_group_index_map_fails_the_mixed_cases():
    """Planted fault: the masters read through ``model_param_group_index_map`` (what the twin's
    adapter did before it shared the ``optim`` check's reader): in the cases whose param groups
    mix bf16 and fp32 params it names another param's master, here one of another size, so
    the case's ranks crash placing it (the case's crash, in the candidate's code: a FAIL);
    the all-fp16 case passes."""
    from tests.candidates.megatron_faults import IndexMapMastersOptimizer, MegatronWithOptimizer
    from verify.check import FAIL

    result = _quick(MegatronWithOptimizer(sharded=IndexMapMastersOptimizer))
    assert result.status == FAIL, (result.error, result.failed_labels())
    failed = result.failed_labels()
    for case in ("DP=1 adamw bf16/fp32 clip sync", "DP=2 adamw bf16/bf16 clip overlap",
                 "DP=2 adamw bf16/fp32 clip overlap param-loss"):
        assert any(label.startswith(f"optim {case}: crashed on rank") for label in failed), (case, failed)
    assert {c.label: c.passed for c in result.cases}["optim DP=4 adamw fp16/fp16 clip overlap"]
    assert not any("fp16/fp16" in label for label in failed), failed


def test_the_twin_and_the_optim_check_read_megatrons_masters_through_one_function():
    """The twin's adapter (over MegatronStages) and the check's (over its module) both gather
    masters with ``gathered_state`` over ``owned_state``, so the check's bf16/fp32 cases (the
    test above) stand for the twin too: the twin's groups never mix fp32 and 16-bit params
    (Float16Module casts every param), where reading through the index map goes wrong."""
    import inspect

    from verify.candidates.megatron_core.optimizer import MegatronTrainingOptimizer
    from verify.candidates.megatron_core.sharded_optimizer import (
        MegatronShardedOptimizer,
        owned_state,
    )

    assert MegatronTrainingOptimizer.owned is MegatronShardedOptimizer.owned is owned_state
    for adapter, method in ((MegatronTrainingOptimizer, "state"),
                            (MegatronShardedOptimizer, "named_state")):
        assert "gathered_state(" in inspect.getsource(getattr(adapter, method)), adapter


@pytest.fixture(scope="module")
def megatron_result():
    from verify.check import CheckContext
    from verify.checks import check_by_name

    return check_by_name("optim").execute(CheckContext(quick=True), MegatronCoreCandidate())


def test_megatron_core_passes_with_its_documented_differences(megatron_result):
    result = megatron_result
    assert result.error is None, result.error
    assert result.status == "PASS", result.failed_labels()
    assert result.candidate == "megatron-core"
    labels = [c.label for c in result.comparisons]
    for case in ("DP=1 adamw bf16/fp32 clip sync", "DP=2 adamw bf16/bf16 clip overlap",
                 "DP=4 adamw fp16/fp16 clip overlap", "DP=2 adamw bf16/fp32 clip overlap param-loss"):
        assert any(label.startswith(f"optim {case} step 2 master (documented: ") for label in labels), case
    by_where = {}
    for d in result.differences:
        by_where.setdefault(d.behaviour.split(" (")[0].split(",")[0], set()).add(d.where)
    norm = next(w for b, w in by_where.items() if b.startswith("global grad norm from fp32 partial sums"))
    assert all("clip_grads.py get_grad_norm_fp32" in w for w in norm)
    gather = next(w for b, w in by_where.items() if b.startswith("with overlap_param_gather"))
    assert gather == {"megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer."
                      "step_with_ready_grads (start_param_sync only without overlap_param_gather); "
                      "megatron/core/distributed/param_and_grad_buffer.py "
                      "_ParamAndGradBucketGroup.finish_param_sync"}
    # every overlapped step that stepped: nothing in flight after it, where the spec expects a
    # gather (DP=2: 3 steps; DP=4: step 1, its step 2 skipped on the inf launches none as the
    # spec says; param-loss: 2 steps)
    gathers = [d for d in result.differences if "all-gather in flight after the step" in d.label]
    assert len(gathers) == 3 + 1 + 2, [d.label for d in gathers]
    # torch.optim.AdamW's order moves real bits (the fp16 case's masters and moments)
    assert any(d.label.startswith("optim DP=4 adamw fp16/fp16 clip overlap step 1 master")
               and "torch.optim.AdamW" in d.behaviour for d in result.differences)


def test_megatron_core_skips_say_why(megatron_result):
    skipped = megatron_result.skipped
    assert sum("SGD: Megatron-Core's DistributedOptimizer steps Adam only" in s
               and "distrib_optimizer.py" in s for s in skipped) == 2, skipped  # the two SGD cases
    assert any("resuming its checkpoint" in s and "get_parameter_state_dp_zero" in s for s in skipped)
    assert any(s.startswith("MXFP8 params: ") and "Transformer Engine" in s for s in skipped)
    assert len(skipped) == 4, skipped


def _case_worker(rank: int, world: int, candidate, case) -> CaseResult:
    from verify.checks.optim.worker import _train

    bookkeeping = dist.new_group(list(range(world)))
    with candidate.optimizer() as optimizer:
        return _train(case, None, rank, optimizer, 0, bookkeeping=bookkeeping)


CLIPPED_ARGS = ((0, 1), "adamw", "bf16", True, 0.5, True, 3)  # the quick matrix's param-free twin


def _failed_labels(candidate, case=None) -> list[str]:
    """One case (default: the clipped one) through the check's rank code and comparisons."""
    from tests.distributed_utils import run_distributed
    from verify.candidates.interfaces import OPTIMIZER_BEHAVIOURS
    from verify.check import CheckRecorder
    from verify.checks.optim.compare import Documented, check_case
    from verify.checks.optim.expectations import ProductionModel, case_trajectory

    case = case or CLIPPED
    runs = run_distributed(_case_worker, case.dp, candidate, case)
    behaviour = candidate.departures(OPTIMIZER_BEHAVIOURS)
    norms = tuple(r.outcome.grad_norm for r in runs[0].steps)
    model = case_trajectory(case, 0, production=ProductionModel(norms))[0]
    rec = CheckRecorder("optim")
    check_case(rec, case, runs, case_trajectory(case, 0)[0], Documented(behaviour, model))
    return rec.finish(0.0).failed_labels()


if missing_reason() is None:
    from verify.checks.optim.cases import OptimCase

    CLIPPED = OptimCase(*CLIPPED_ARGS)
    # the matrix's DP=4 fp16 case at DP 2 with 3 steps: step 2 skipped on its inf, step 3 the
    # second update (its lr and weight decay the schedule's update 1)
    FP16_SKIP = OptimCase((0, 1), "adamw", "fp16", False, 0.5, True, 3, hysteresis=2)


def test_the_clipped_case_passes_with_megatron_core():
    assert _failed_labels(MegatronCoreCandidate()) == []


def test_the_fp16_case_with_a_skip_passes_with_megatron_core():
    assert _failed_labels(MegatronCoreCandidate(), FP16_SKIP) == []


def test_a_scheduler_that_advances_on_a_skipped_step_fails_the_next_update():
    from tests.candidates.megatron_faults import MegatronWithOptimizer, SchedulerStepsOnSkips

    failed = _failed_labels(MegatronWithOptimizer(sharded=SchedulerStepsOnSkips), FP16_SKIP)
    assert any(label.startswith(f"{FP16_SKIP.label} step 3 master") for label in failed), failed
    assert not any(" step 1 " in label or " step 2 " in label for label in failed), failed


def test_a_megatron_core_that_skips_clipping_fails_the_masters():
    failed = _failed_labels(UnclippedMegatron())
    # refgrad's model clips with the norm Megatron-Core reports; the copy did not clip
    assert any(" master (documented: " in label for label in failed), failed
    assert any("params after the gather" in label for label in failed), failed
    assert not any("the global grad norm is refgrad's exact one" in label for label in failed), failed

"""The ``pipeline`` check passes on fastgrad and fails on deliberately broken candidates."""

import pytest

from refgrad.pipeline import LinearStackSpec, StepPlan
from verify.check import CheckContext
from verify.checks import check_by_name
from verify.checks.pipeline import CHECK, PipelineCandidate, PipelineCase


@pytest.mark.dist
def test_pipeline_check_passes_quick():
    result = check_by_name("pipeline").execute(CheckContext(quick=True))
    assert result.passed, (result.error, [c for c in result.comparisons if not c.passed],
                           [e for e in result.expectations if not e.passed])
    labels = [c.label for c in result.comparisons]
    assert any("overlap on: reduced grads vs refgrad" in label for label in labels)
    assert any("overlap off: losses vs refgrad" in label for label in labels)
    assert any(t.title.startswith("simulator vs measured") for t in result.tables)
    for overlap in ("on", "off"):
        tag = f"P2 D2 V2 interleaved all-reduce sum, overlap {overlap}"
        assert f"{tag}: reduced grads vs refgrad" in labels
        assert f"{tag}: params after SGD vs refgrad" in labels
        assert any(e.label.startswith(f"{tag}: chunks enabled") for e in result.expectations)


@pytest.mark.dist
def test_pipeline_check_fails_when_microbatch_accumulation_order_is_wrong():
    # The candidate sums the same microbatches in reverse order: the same math,
    # different fp32 rounding. Only a bitwise comparison catches it.
    result = CHECK.execute(CheckContext(quick=True), PipelineCandidate(fault="reversed_microbatches"))
    assert not result.passed
    assert result.error is None
    failed = [c.label for c in result.comparisons if not c.passed]
    assert any("reduced grads vs refgrad" in label for label in failed), failed
    assert any("losses vs refgrad" in label for label in failed), failed
    # Both schedules: the non-interleaved 1F1B (P4 D1) and the interleaved one (V2).
    for name in ("P4 D1 all-reduce sum", "P2 D2 V2 interleaved all-reduce sum"):
        assert any(label.startswith(f"{name}, overlap on: reduced grads") for label in failed), failed


def test_candidate_validation():
    with pytest.raises(ValueError, match="PipelineCandidate.fault"):
        PipelineCandidate(fault="gremlins")


def test_case_validation():
    spec = LinearStackSpec(num_stages=2)
    with pytest.raises(ValueError, match="reduction"):
        PipelineCase("x", 2, 1, 0, spec, (StepPlan(1),), reduction="max")
    with pytest.raises(ValueError, match="fault"):
        PipelineCase("x", 2, 1, 0, spec, (StepPlan(1),), fault="gremlins")
    with pytest.raises(ValueError, match="dp_size"):
        PipelineCase("x", 2, 0, 0, spec, (StepPlan(1),))
    with pytest.raises(ValueError, match="first_rank"):
        PipelineCase("x", 2, 1, -1, spec, (StepPlan(1),))
    with pytest.raises(ValueError, match="num_stages"):
        PipelineCase("x", 4, 1, 0, spec, (StepPlan(1),))
    with pytest.raises(ValueError, match="plans"):
        PipelineCase("x", 2, 1, 0, spec, ())
    with pytest.raises(ValueError, match="lr"):
        PipelineCase("x", 2, 1, 0, spec, (StepPlan(1),), lr=float("nan"))
    spec4 = LinearStackSpec(num_stages=4)
    with pytest.raises(ValueError, match=r"pp_size \* virtual_stages \(4\)"):
        PipelineCase("x", 2, 1, 0, spec, (StepPlan(2),), virtual_stages=2)
    with pytest.raises(ValueError, match=r"num_microbatches \[3\] must be multiples of pp_size"):
        PipelineCase("x", 2, 1, 0, spec4, (StepPlan(2), StepPlan(3)), virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages"):
        PipelineCase("x", 2, 1, 0, spec, (StepPlan(2),), virtual_stages=0)
    # The interleaved schedule drains an output head on the last virtual stage; no timing case.
    PipelineCase("x", 2, 1, 0, LinearStackSpec(num_stages=4, output_head=True),
                 (StepPlan(2),), virtual_stages=2)
    with pytest.raises(ValueError, match="no timing"):
        PipelineCase("x", 2, 1, 0, spec4, (StepPlan(2),), virtual_stages=2, timing=True)


class _StallingProgress:
    """Passes every marker on; blocks forever when the given event starts (a hung stage)."""

    def __init__(self, progress, stall_on: str) -> None:
        self.progress, self.stall_on = progress, stall_on

    def mark(self, label: str) -> None:
        self.progress.mark(label)

    def timeline_listener(self, prefix: str = ""):
        inner = self.progress.timeline_listener(prefix)

        def listen(kind, microbatch, edge):
            inner(kind, microbatch, edge)
            if f"{prefix}{kind} microbatch {microbatch} {edge}".endswith(self.stall_on):
                import time

                time.sleep(3600)

        return listen


def _pipeline_rank_that_stalls(rank, world_size, case, *, progress):
    """Rank 1 (stage 1 of P2 D1) hangs at the start of step 1's backward of microbatch 1."""
    from fastgrad.pipeline import build_parallel_groups
    from verify.checks.pipeline import run_case_on_rank

    groups = build_parallel_groups(case.pp_size, case.dp_size)
    if rank == 1:
        progress = _StallingProgress(progress, "step 1: backward microbatch 1 start")
    return run_case_on_rank(case, groups, True, progress)


@pytest.mark.dist
def test_a_stalled_stage_is_reported_with_its_case_stage_and_step():
    from verify.distributed import RankTimeout, spawn

    spec = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=8, seed=5)
    case = PipelineCase("P2 D1 stall", 2, 1, 0, spec, (StepPlan(3), StepPlan(3)))
    with pytest.raises(RankTimeout) as info:
        spawn(_pipeline_rank_that_stalls, 2, case, timeout_s=8)
    state = info.value.states[1]
    assert state.marker == "P2 D1 stall overlap on, stage 1, step 1: backward microbatch 1 start"
    assert "stage 1, step 1" in str(info.value)

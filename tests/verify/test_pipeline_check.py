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
    with pytest.raises(ValueError, match="no output head"):
        PipelineCase("x", 2, 1, 0, LinearStackSpec(num_stages=4, output_head=True),
                     (StepPlan(2),), virtual_stages=2)

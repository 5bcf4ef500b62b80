from dataclasses import dataclass

import pytest
import torch

from verify.candidates import (
    Candidate,
    CandidateInfo,
    DocumentedBehaviour,
    FastgradCandidate,
    Technique,
)
from verify.check import Check, CheckContext, CheckRecorder
from verify.metrics import assert_bitwise_equal, bitwise_equal


@dataclass(frozen=True)
class _Candidate:
    value: int = 1


class _OtherCandidate:
    pass


def test_check_that_records_nothing_fails():
    result = Check("empty", "records nothing", lambda ctx, rec, cand: None, _Candidate()).execute(
        CheckContext())
    assert not result.passed


def test_exception_becomes_failure_with_traceback():
    def boom(ctx, rec, cand):
        rec.expect("reached", True)
        raise RuntimeError("kaboom")

    result = Check("boom", "raises", boom, _Candidate()).execute(CheckContext())
    assert not result.passed
    assert "kaboom" in result.error


def test_execute_uses_the_default_candidate_or_the_given_one():
    def run(ctx, rec, cand):
        rec.expect(f"value {cand.value}", cand.value == 1)

    check = Check("c", "candidate", run, _Candidate())
    assert check.execute(CheckContext()).passed
    result = check.execute(CheckContext(), candidate=_Candidate(2))
    assert not result.passed and result.expectations[0].label == "value 2"


def test_execute_refuses_a_candidate_of_another_type():
    check = Check("c", "candidate", lambda ctx, rec, cand: None, _Candidate())
    with pytest.raises(TypeError, match="candidate must be a _Candidate"):
        check.execute(CheckContext(), candidate=_OtherCandidate())


def test_check_needs_a_default_candidate():
    with pytest.raises(ValueError, match="default_candidate"):
        Check("c", "no default", lambda ctx, rec, cand: None, None)


def test_bitwise_comparison_detects_one_ulp():
    rec = CheckRecorder("c")
    a = torch.tensor([1.0, 2.0])
    b = torch.nextafter(a, torch.tensor([10.0, 10.0]))
    assert rec.compare("same", a, a.clone())
    assert not rec.compare("one ulp apart", a, b)
    assert rec.compare("one ulp allowed", a, b, max_ulp=1, reason="hand-derived: adjacent floats")
    result = rec.finish(0.0)
    assert not result.passed
    assert [c.passed for c in result.comparisons] == [True, False, True]


def test_ulp_bound_needs_reason_and_non_negative():
    rec = CheckRecorder("c")
    a = torch.ones(2)
    with pytest.raises(ValueError, match="reason"):
        rec.compare("x", a, a, max_ulp=2)
    with pytest.raises(ValueError, match="max_ulp"):
        rec.compare("x", a, a, max_ulp=-1)


def test_failed_expectation_fails_check():
    rec = CheckRecorder("c")
    rec.expect("true", True)
    rec.expect("false", False, "why")
    assert not rec.finish(0.0).passed


def test_table_row_width_validated():
    rec = CheckRecorder("c")
    with pytest.raises(ValueError, match="row 0 has 1 cells"):
        rec.table("t", ["a", "b"], [[1]])


@pytest.mark.parametrize("kwargs, match", [({"device": "tpu"}, "device"), ({"seed": -1}, "seed")])
def test_context_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CheckContext(**kwargs)


def test_context_generator_is_deterministic():
    ctx = CheckContext(seed=3)
    a = torch.randn(4, generator=ctx.generator(1))
    b = torch.randn(4, generator=ctx.generator(1))
    c = torch.randn(4, generator=ctx.generator(2))
    assert_bitwise_equal(a, b)
    assert not bitwise_equal(a, c)


def test_a_technique_check_runs_fastgrad_by_default_and_refuses_other_candidate_types() -> None:
    seen = []

    def run(ctx, rec, candidate):
        seen.append(candidate)
        rec.expect("ran", True)

    check = Check("t", "technique", run, technique=Technique.LAYOUT)
    assert check.execute(CheckContext()).status == "PASS"
    assert seen == [FastgradCandidate()]
    with pytest.raises(TypeError, match="candidate must be a Candidate"):
        check.execute(CheckContext(), object())
    with pytest.raises(ValueError, match="not a default"):
        Check("t", "technique", run, default_candidate=object(), technique=Technique.LAYOUT)


def test_an_unsupported_technique_is_a_skip_naming_the_candidate_and_the_reason() -> None:
    def run(ctx, rec, candidate):
        candidate.mxfp8()  # fastgrad's adapter does not exist in this test's candidate
        rec.expect("unreachable", True)

    class NoMXFP8(Candidate):
        name = "none"

        def info(self) -> CandidateInfo:
            return CandidateInfo("none", "0", "implements nothing")

    result = Check("m", "mxfp8", run, technique=Technique.MXFP8).execute(CheckContext(), NoMXFP8())
    assert result.status == "SKIP"
    assert result.skipped == ["mxfp8: none does not implement MXFP8"]


def test_a_documented_difference_passes_only_when_the_candidate_matches_its_model() -> None:
    prescale = DocumentedBehaviour("pre-scales by 1/3 in bf16, then sums",
                                   "megatron.core.distributed.param_and_grad_buffer."
                                   "_ParamAndGradBucketGroup.start_grad_sync")
    spec = torch.tensor([1.0, 2.0, 3.0])
    model = torch.tensor([1.0, 2.0, 3.0000002])  # the documented behaviour lands one ULP off
    rec = CheckRecorder("c")
    assert rec.compare_documented("grads", spec, model.clone(), documented=prescale,
                                  documented_reference=model)
    assert not rec.compare_documented("grads again", spec, spec.clone(), documented=prescale,
                                      documented_reference=model)  # not what it documents
    assert rec.compare_documented("plain", spec, spec.clone(), documented=None)
    result = rec.finish(0.0)
    assert result.status == "FAIL"
    assert [c.passed for c in result.comparisons] == [True, False, True]
    assert result.comparisons[0].label == "grads (documented: pre-scales by 1/3 in bf16, then sums)"
    assert [(d.label, d.where.endswith("start_grad_sync"), d.metrics["max_ulp"])
            for d in result.differences] == [("grads", True, 1)]
    with pytest.raises(ValueError, match="documented_reference"):
        CheckRecorder("c").compare_documented("x", spec, spec, documented=prescale)


def test_a_documented_fact_passes_only_when_the_candidate_keeps_its_model() -> None:
    one_bucket = DocumentedBehaviour("one bucket on every pipeline stage after the first",
                                     "megatron.core.distributed.distributed_data_parallel."
                                     "DistributedDataParallel.__init__")
    rec = CheckRecorder("c")
    # Refgrad's layout gives 3 buckets, the documented model 1, the candidate has 1.
    assert rec.expect_documented("stage 1 buckets", 1 == 3, documented=one_bucket,
                                 documented_holds=1 == 1, detail="1 bucket, refgrad's layout 3")
    # The candidate has 2: neither the spec nor the model.
    assert not rec.expect_documented("stage 2 buckets", 2 == 3, documented=one_bucket,
                                     documented_holds=2 == 1, detail="2 buckets")
    # Spec holds: no difference recorded; without a documented behaviour: a plain expectation.
    assert rec.expect_documented("stage 0 buckets", True, documented=one_bucket, documented_holds=False
                                 ) is False
    assert rec.expect_documented("plain", True, documented=None)
    result = rec.finish(0.0)
    assert result.status == "FAIL"
    assert [(e.label, e.passed) for e in result.expectations] == [
        ("stage 1 buckets (documented: one bucket on every pipeline stage after the first)", True),
        ("stage 2 buckets (documented: one bucket on every pipeline stage after the first)", False),
        ("stage 0 buckets (documented: one bucket on every pipeline stage after the first)", False),
        ("plain", True)]
    assert [(d.label, d.metrics) for d in result.differences] == [
        ("stage 1 buckets", {"detail": "1 bucket, refgrad's layout 3"}),
        ("stage 2 buckets", {"detail": "2 buckets"})]
    with pytest.raises(ValueError, match="documented_holds"):
        CheckRecorder("c").expect_documented("x", False, documented=one_bucket)

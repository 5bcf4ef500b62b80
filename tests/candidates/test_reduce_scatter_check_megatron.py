"""The ``reduce_scatter`` check against Megatron-Core: every difference from refgrad classified.

Expected classification (megatron-core 0.16.1; the numbers are refgrad's, computed by the check):

* its ``reduce_scatter_with_fp32_accumulation`` with SUM (sync, async, in place; order-sensitive
  inputs at W = 3) and its local fp32 step (W = 3, 4, 5, 8) equal refgrad's fp32 rank-order
  sum bitwise;
* AVG on that collective and a caller's scratch are skips naming why (Megatron's assert, the
  version's signature);
* its DDP averages by a 1/W pre-scale in the grad dtype, and its plain collectives sum in the
  grad dtype in gloo's reverse-ring order: documented differences naming
  ``param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync``, held bitwise to refgrad's
  model of them;
* FAIL: ``reduce_scatter_with_fp32_accumulation`` with ``average_in_collective`` is accepted by
  ``DistributedDataParallelConfig`` and then fails a bare ``assert op == ReduceOp.SUM``: a crash
  (finding 2), reachable from a launch;
* a hazard, not a FAIL: a plain DDP built, deliberately, after an fp32-accumulating one in the
  same process reduces wrongly (the fp32 DDP rebound
  ``param_and_grad_buffer.dist_reduce_scatter_func`` for the whole process; finding 1, direct
  API use only). Every other case runs in a process of its own and is right.
"""

from __future__ import annotations

import pytest

from verify.candidates.megatron_core.version import missing_reason

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))

AFTER_FP32_CASE = ("DDP bucket reduction W=3 reduce-scatter, pre-scale 1/W (built after an "
                   "fp32-accumulating DDP in the same process)")
AFTER_FP32 = f"{AFTER_FP32_CASE} vs refgrad's DP avg: "
CRASHED = ["DDP bucket reduction W=2 fp32-accumulating reduce-scatter, AVG in the collective",
           "DDP bucket reduction W=3 fp32-accumulating reduce-scatter, AVG in the collective",
           "DDP bucket reduction W=3 fp32-accumulating reduce-scatter, AVG in the collective "
           "average-sensitive inputs",
           "DDP bucket reduction W=5 fp32-accumulating reduce-scatter, AVG in the collective "
           "average-sensitive inputs"]


def _quick(candidate):
    from verify.check import CheckContext
    from verify.checks import check_by_name

    return check_by_name("reduce_scatter").execute(CheckContext(quick=True, timeout_s=120), candidate)


@pytest.fixture(scope="module")
def megatron_result():
    from verify.candidates.megatron_core.candidate import MegatronCoreCandidate

    return _quick(MegatronCoreCandidate())


@pytest.mark.dist
def test_megatron_core_fails_exactly_on_its_two_findings(megatron_result):
    result = megatron_result
    assert result.error is None, result.error
    assert result.status == "FAIL" and result.candidate == "megatron-core"
    # Finding 2: every fp32-accumulating case averaging in the collective crashes at its first
    # sync, in reduce_scatter_with_fp32_accumulation's `assert op == ReduceOp.SUM`.
    assert sorted(c.label for c in result.crashes) == sorted(CRASHED)
    for crash in result.crashes:
        assert (crash.exception, crash.function) == ("AssertionError",
                                                     "reduce_scatter_with_fp32_accumulation")
        assert crash.where.startswith("megatron/core/distributed/"
                                      "reduce_scatter_with_fp32_accumulation.py:")
    # Finding 1 (a hazard): the plain reduce-scatter built after an fp32-accumulating DDP in
    # its own process reduces nothing: nearly every element differs, not a rounding.
    failed = [c for c in result.comparisons if not c.passed]
    assert [c.label for c in failed if not c.label.startswith(AFTER_FP32)] == []
    assert len(failed) == 4  # bf16 and fp16, two iterations: every one
    for comparison in failed:
        assert 4 * comparison.metrics["n_mismatch"] > 3 * comparison.metrics["n"], comparison
    findings = {c.label: c.finding for c in result.cases if not c.passed}
    assert findings == {**dict.fromkeys(CRASHED, "megatron-core-2"),
                        AFTER_FP32_CASE: "megatron-core-1"}
    assert [c.label for c in result.hazards] == [AFTER_FP32_CASE]


@pytest.mark.dist
def test_megatron_core_fp32_reduce_scatter_sum_is_refgrads(megatron_result):
    passed = {c.label for c in megatron_result.comparisons if c.passed}
    for size in (2, 3):
        for mode in ("sync", "async", "in_place"):
            assert f"megatron-core vs refgrad fp32/rank: W={size} bfloat16 it=1 op=sum {mode}" in passed
    assert "order-sensitive reduce-scatter vs refgrad fp32/rank: W=3 float16 it=1 op=sum" in passed
    for size in (3, 4, 5, 8):
        assert (f"order-sensitive local reduction vs refgrad fp32/rank: W={size} bfloat16 sum"
                in passed)
    skipped = "\n".join(megatron_result.skipped)
    assert "op=avg (every mode" in skipped and "assert op == torch.distributed.ReduceOp.SUM" in skipped
    assert "through a caller's scratch" in skipped and "all_to_all_output_tensor" in skipped


@pytest.mark.dist
def test_megatron_core_averaging_is_documented_where_it_lives(megatron_result):
    differences = {d.label: d for d in megatron_result.differences}
    prescaled = differences["DDP bucket reduction W=3 fp32-accumulating reduce-scatter, pre-scale "
                            "1/W average-sensitive inputs vs refgrad's DP avg: bfloat16 it=0"]
    assert "multiplied by 1/W in the grad dtype" in prescaled.behaviour
    assert prescaled.where.startswith("megatron.core.distributed.param_and_grad_buffer."
                                      "_ParamAndGradBucketGroup.start_grad_sync")
    # most elements: the average-sensitive inputs make the pre-scale visible
    assert 2 * prescaled.metrics["n_mismatch"] > prescaled.metrics["n"]
    wire = differences["DDP bucket reduction W=3 reduce-scatter, AVG in the collective vs "
                       "refgrad's DP avg: bfloat16 it=0"]
    assert "gloo's reverse-ring order" in wire.behaviour and "pre-scale" not in wire.behaviour
    # W = 2: 1/2 is exact and one addition commutes; bf16 has no subnormals here
    assert not any(label.startswith("DDP bucket reduction W=2 fp32-accumulating reduce-scatter, "
                                    "pre-scale 1/W vs refgrad's DP avg: bfloat16")
                   for label in differences)


@pytest.mark.dist
def test_a_copy_whose_bucket_prescale_is_wrong_fails_the_check():
    from tests.candidates.megatron_faults import MegatronWithPrescaleInBf16

    result = _quick(MegatronWithPrescaleInBf16())
    assert result.error is None, result.error
    failed = [label for label in result.failed_labels()
              if not label.startswith(AFTER_FP32) and not label.startswith(tuple(CRASHED))]
    # 1/3 and 1/5 rounded to bf16 before the multiply: every pre-scaled case at W = 3 and 5
    # misses refgrad's model of the documented pre-scale; W = 2 (1/2 exact) still passes
    assert failed and all("pre-scale 1/W" in label and "(documented: " in label
                          for label in failed), failed
    assert any("W=3 fp32-accumulating reduce-scatter, pre-scale 1/W vs" in label for label in failed)
    assert any("W=5 fp32-accumulating reduce-scatter, pre-scale 1/W average-sensitive" in label
               for label in failed)
    assert not any("W=2 " in label for label in failed), failed


def test_without_megatron_core_the_check_is_a_skip_naming_the_install(monkeypatch):
    from verify.candidates.megatron_core import candidate as module
    from verify.check import CheckContext
    from verify.checks import check_by_name

    reason = "megatron-core is not installed: pip install -e '.[megatron]' (in the gradverify checkout)"
    monkeypatch.setattr(module, "missing_reason", lambda: reason)
    result = check_by_name("reduce_scatter").execute(CheckContext(quick=True),
                                                     module.MegatronCoreCandidate())
    assert result.status == "SKIP" and result.skipped == [f"reduce_scatter: {reason}"]
    assert not result.comparisons and not result.expectations

"""The layout, deferred_wgrad, pipeline and mxfp8 checks run against MegatronCoreCandidate.

Each test asserts the exact classification: which labels PASS, which FAIL (Megatron-Core's
own bugs), which differences are documented production behaviour, what is skipped. Every
expected value comes from refgrad, a hand derivation, or the cited megatron-core 0.16.1
source (file and function), never from a run. A copy of the candidate with a planted bug
fails the pipeline check. Skips, naming the reason, without megatron-core.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch

from verify.candidates.megatron_core.version import missing_reason

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))

if missing_reason() is None:
    from tests.candidates.megatron_faults import WronglyScaledBucketDDP
    from verify.candidates import Behaviour
    from verify.candidates.megatron_core.bucket_layout import MegatronLayout
    from verify.candidates.megatron_core.candidate import DOCUMENTED, MegatronCoreCandidate
    from verify.candidates.megatron_core.pipeline_training import MegatronPipeline
    from verify.check import CheckContext

    @dataclass(frozen=True)
    class ScaledBucketPipeline(MegatronPipeline):
        """Megatron's pipeline training with each chunk's last bucket scaled twice over."""

        def ddp_class(self) -> type:
            return WronglyScaledBucketDDP

    @dataclass(frozen=True)
    class ScaledBucketLayout(MegatronLayout):
        """Megatron's buffers with the last bucket scaled twice over."""

        def ddp_class(self) -> type:
            return WronglyScaledBucketDDP

    @dataclass(frozen=True)
    class ScaledBucketCandidate(MegatronCoreCandidate):
        """A copy of the Megatron-Core candidate whose DDP scales one bucket wrongly."""

        def pipeline(self) -> MegatronPipeline:
            return ScaledBucketPipeline()

        def layout(self) -> MegatronLayout:
            return ScaledBucketLayout()

QUICK = CheckContext(quick=True, timeout_s=300.0)  # Megatron's import costs seconds per rank
ALIGNMENT = "ParamAndGradBuffer param views 64-element aligned in memory on cpu"


def _check(name: str):
    from verify.checks import check_by_name

    return check_by_name(name)


def test_documented_behaviours_name_their_megatron_core_module_and_function():
    candidate = MegatronCoreCandidate()
    assert set(DOCUMENTED) == set(Behaviour)
    for behaviour in Behaviour:
        documented = candidate.documented(behaviour)
        assert documented.where.startswith("megatron.core.distributed."), documented.where


def test_the_scopes_undo_their_process_setup():
    import logging

    import torch.distributed as dist
    from megatron.core import parallel_state

    from verify.candidates.megatron_core.scope import DDP_LOGGER, SELF_COMPUTED_LAYOUT

    ddp_logger = logging.getLogger(DDP_LOGGER)

    def logged(message: str) -> bool:
        return bool(ddp_logger.filter(logging.LogRecord(DDP_LOGGER, logging.WARNING, __file__, 0,
                                                        message, None, None)))

    candidate = MegatronCoreCandidate()
    cpu = not torch.cuda.is_available()
    noise = f"{SELF_COMPUTED_LAYOUT} with use_distributed_optimizer=True. Auto-computing ..."
    for accessor in (candidate.layout, candidate.deferred_wgrad):
        with accessor() as interface:
            assert dist.is_initialized()  # Megatron's buffer logging asserts it
            assert torch.cuda.current_device() == "cpu" if cpu else True
            assert not logged(noise) and logged("Setting up DistributedDataParallel")
            with interface:  # re-entered: finds everything made
                assert dist.is_initialized()
            assert dist.is_initialized()
            assert not logged(noise)  # the inner scope left the outer one's filter
        assert not dist.is_initialized()
        assert logged(noise)
        assert parallel_state._GLOBAL_MEMORY_BUFFER is None
        if cpu:  # the redirect is gone again
            with pytest.raises((AssertionError, RuntimeError)):
                torch.cuda.current_device()


def test_layout_check_quick_is_refgrads_layout_and_reports_alignment_apart():
    result = _check("layout").execute(QUICK, MegatronCoreCandidate())
    assert result.status == "PASS", (result.error, result.failed_labels())
    labels = [e.label for e in result.expectations]
    # Hand-derived layouts, 300 random ones and 10^4 params: Megatron's _ParamAndGradBuffer is
    # refgrad's layout, bit for bit (refgrad.layout models param_and_grad_buffer.py).
    assert "300 random layouts: candidate == refgrad" in labels
    assert "10000 params: candidate == refgrad" in labels
    assert sum(label.startswith("hand-derived (candidate)") for label in labels) == 9
    # _ParamAndGradBuffer.__init__ pads param starts to 64 elements from the buffer's start and
    # takes the start from torch.zeros: held to that model, the memory alignment apart.
    documented = DOCUMENTED[Behaviour.BUFFER_ALIGNMENT_FROM_ALLOCATOR]
    assert f"{ALIGNMENT} (documented: {documented.summary})" in labels
    assert {d.label for d in result.differences} <= {ALIGNMENT}  # torch's CPU allocator decides
    assert result.skipped == [
        "buffer helpers: layout: megatron-core has no padding test on its grad buffer",
        "buffer helpers: layout: megatron-core computes the grad norm in its optimizer "
        "(megatron.core.optimizer.clip_grads.get_grad_norm_fp32), not its buffer",
        "multi-rank reduce-scatter through the buffers runs only without --quick",
    ]


@pytest.mark.dist
def test_layout_reductions_show_the_fp32_reduce_scatter_rebinding_a_module_global():
    from verify.checks.layout import default_scenarios, run_reduce_scenarios

    scenarios = default_scenarios(2)
    outcomes = run_reduce_scenarios(2, scenarios, MegatronCoreCandidate(), timeout_s=300.0)
    failed = sorted(label for label, passed, _ in outcomes if not passed)
    # param_and_grad_buffer.py _ParamAndGradBucketGroup.__init__: a bucket group built with
    # reduce_scatter_with_fp32_accumulation rebinds the module global dist_reduce_scatter_func
    # for the process. Every reduce-scatter built after scenario 3 (in this rank process) calls
    # it: with ReduceOp.AVG its bare `assert op == SUM` fails (reduce_scatter_with_fp32_
    # accumulation.py:63); overlapped with SUM, start_grad_sync keeps the coalescing manager's
    # handle, so the fp32 function's wait() (which sums) never runs. Synchronous (no overlap)
    # and fp32-accumulating scenarios are unaffected; nothing before scenario 3 is.
    assert [s.name for s in scenarios][2] == "reduce-scatter with fp32 accumulation"
    after = " (built after an fp32-accumulating DDP in the same process)"
    assert failed == [
        f"dp=2: fp32 grads of bf16 params, pre-scaled by 1/dp{after}, iteration 0",
        f"dp=2: fp32 grads of bf16 params, pre-scaled by 1/dp{after}, iteration 1",
        f"dp=2: reduce-scatter AVG in the collective{after}: runs",
    ]
    detail = dict((label, d) for label, _, d in outcomes)[
        f"dp=2: reduce-scatter AVG in the collective{after}: runs"]
    assert "AssertionError" in detail and "reduce_scatter_with_fp32_accumulation.py:63" in detail
    # The same two scenarios in processes of their own are right: the rebinding is the cause.
    alone = [s for s in scenarios if s.name in ("reduce-scatter AVG in the collective",
                                                 "fp32 grads of bf16 params, pre-scaled by 1/dp")]
    outcomes = run_reduce_scenarios(2, alone, MegatronCoreCandidate(), timeout_s=300.0)
    assert not any(after in label for label, _, _ in outcomes)
    assert [passed for _, passed, d in outcomes if not d.startswith("skipped")] == [True] * 4
    # The copy whose last bucket is scaled twice over fails the averaged scenarios.
    outcomes = run_reduce_scenarios(2, alone, ScaledBucketCandidate(), timeout_s=300.0)
    assert [passed for _, passed, d in outcomes if not d.startswith("skipped")] == [False] * 4


def _one_deferred_entry(case) -> bool:
    """megatron/core/utils.py drain_embedding_wgrad_compute pops the first entry, then loops
    over the rest: with exactly one deferred (input, grad_output) the loop never binds
    ``drain_idx`` and the last GEMM raises UnboundLocalError, after both buffers were emptied."""
    deferred = case.num_microbatches if case.limit == 0 else min(case.limit, case.num_microbatches)
    return deferred == 1


@pytest.mark.dist
def test_deferred_wgrad_check_fails_exactly_megatrons_one_entry_drain_and_stale_grad_output():
    from refgrad.deferred_wgrad import fastgrad_error_factor
    from verify.checks.deferred_wgrad.cases import (
        BATCH,
        ITERATIONS,
        SEQ,
        build_cases,
        compared_with_refgrad,
    )

    result = _check("deferred_wgrad").execute(QUICK, MegatronCoreCandidate())
    assert result.error is None, result.error
    expected = set()
    for case in build_cases(quick=True):
        if not _one_deferred_entry(case):
            continue
        for r in (0, 1):
            tag = f"{case.label}/rank{r}"
            expected |= {f"{tag}: drain runs", f"{tag}: drain count"}
            for it in range(ITERATIONS):
                expected.add(f"{tag}/iter{it}: deferred == immediate in drain order (bitwise)")
                expected.add(f"{tag}/iter{it}: deferred vs immediate"
                             + (" within the reorder bound" if case.reorders and case.lane == "random"
                                else ""))
        for data_rank in ((0, 1) if case.tp == 1 else (0,)) if compared_with_refgrad(case, True) else ():
            tag = f"{case.label}/data{data_rank}"
            factor = fastgrad_error_factor(SEQ * BATCH, ITERATIONS * case.num_microbatches,
                                           main_grad_dtype=getattr(torch, case.main_grad_dtype))
            expected.add(f"{tag}: megatron-core vs refgrad (exact grid)" if case.lane == "grid"
                         else f"{tag}: |megatron-core - refgrad| <= {float(factor):.3g}·A")
    # pipeline_parallel/schedules.py clear_embedding_activation_buffer clears the activation
    # buffer only: an abandoned step's grad_output is paired with the next step's first input.
    expected.add("stale step: start_step clears both buffers (bitwise equal to a fresh layer)")
    assert set(result.failed_labels()) == expected
    # Every other case ran and was compared (and passed, by the equality above).
    counted = {e.label for e in result.expectations if e.label.endswith(": drain count")}
    assert counted == {f"{c.label}/rank{r}: drain count" for c in build_cases(quick=True)
                       for r in (0, 1)}
    raised = [e for e in result.expectations if e.label.endswith(": drain runs")]
    assert raised and all("UnboundLocalError" in e.detail and "drain_embedding_wgrad_compute"
                          in e.detail for e in raised)
    assert all(e.passed for e in result.expectations if e.label.startswith("tied/"))
    assert all(c.passed for c in result.comparisons if c.label.startswith("tied/"))
    assert result.skipped == [
        "deferred_wgrad: megatron-core has no in-flight guard on its drain "
        "(megatron.core.utils.drain_embedding_wgrad_compute cannot refuse)",
        "CUDA wgrad GEMM (cuBLAS, fp32 output) vs refgrad: run `verify run --device cuda`",
    ]
    assert not result.differences


TIED = "P2 D2 all-reduce avg-in-collective, tied head"
UNTIED = ("P4 D1 all-reduce sum", "P2 D2 V2 interleaved all-reduce sum")


def _pipeline_expected_failures() -> set[str]:
    """The quick pipeline check's tied-head case is the only one with a deferred head; its
    plans have M = 1 in steps 1 and 3 (default_plans(2): 5, 1, 2, 1)."""
    failed = set()
    for overlap in ("on", "off"):
        tag = f"{TIED}, overlap {overlap}"
        # One deferred entry at M = 1: the drain raises (utils.drain_embedding_wgrad_compute)
        # and the wgrad is lost, so that step and every later one differ from refgrad.
        failed |= {f"{tag}: every step runs", f"{tag}: losses vs refgrad",
                   f"{tag}: reduced grads vs refgrad", f"{tag}: params after SGD vs refgrad"}
    # schedules.py forward_backward_pipelining_without_interleaving calls config.grad_sync_func
    # (Megatron-LM's align_grad_reduce) after the cooldown, then finish_embedding_wgrad_compute:
    # with overlap the head's bucket is reducing while its deferred wgrads are drained into it.
    failed.add(f"{TIED}, overlap on: the deferred output-layer wgrads were drained before "
               "their bucket's reduction was launched")
    return failed


@pytest.mark.dist
def test_pipeline_check_classifies_every_megatron_difference():
    result = _check("pipeline").execute(QUICK, MegatronCoreCandidate())
    assert result.error is None, result.error
    assert set(result.failed_labels()) == _pipeline_expected_failures()
    passed = {c.label for c in result.comparisons if c.passed}
    for case in UNTIED:  # bitwise refgrad through Megatron's DDP and schedules
        for overlap in ("on", "off"):
            assert {f"{case}, overlap {overlap}: {what} vs refgrad"
                    for what in ("losses", "reduced grads", "params after SGD")} <= passed
    assert "timing P2 D2: grads overlap on vs off" in passed
    # Without overlap the head is drained before the reduction: step 0 (M = 5) is right; the
    # first M = 1 step loses its wgrad.
    assert f"{TIED}, overlap off: reduced grads differ from refgrad at step 1: " \
           "stage0.layers.0.weight, stage1.head.weight; step 2" in " ".join(result.findings)
    # One bucket on every stage after the first (DistributedDataParallel.__init__). Hand-
    # derived with refgrad.layout at bucket_size 80: a stage of two 8x8 Linear layers, reversed
    # (bias 8, weight 64, bias 8: 80 >= 80 closes), is 2 buckets; the last tied stage with its
    # head (64, 8, 64: 136 closes; 8, 64) also 2; Megatron: 1. Pipeline rank 0 keeps 2. The
    # interleaved chunks (72 elements, bucket size 40) are 1 bucket either way; without overlap
    # every rank is one bucket.
    documented = DOCUMENTED[Behaviour.ONE_BUCKET_AFTER_FIRST_STAGE]
    bucket_labels = [e for e in result.expectations if "buckets per rank" in e.label]
    assert len(bucket_labels) == 6 and all(e.passed for e in bucket_labels)
    assert all(e.label.endswith(f"(documented: {documented.summary})") for e in bucket_labels)
    assert sorted(d.label for d in result.differences) == [
        f"{TIED}, overlap on: buckets per rank vs refgrad's layout",
        "P4 D1 all-reduce sum, overlap on: buckets per rank vs refgrad's layout"]
    assert "(1, 0): 1, 2, 1" in result.differences[0].metrics["detail"]
    assert all(d.where == documented.where for d in result.differences)
    # Megatron has no timeline, no per-chunk enable log and no relearn count: skips.
    assert sorted(result.skipped) == sorted(
        [f"{case}, overlap {o}: megatron-core reports no count of relearning which params each "
         "bucket waits for" for case in (TIED, *UNTIED) for o in ("on", "off")]
        + [f"{UNTIED[1]}, overlap {o}: the candidate recorded no per-chunk grad-sync enables"
           for o in ("on", "off")]
        + ["timing P2 D2: megatron-core recorded no timelines (no simulator comparison)"])


@pytest.mark.dist
def test_a_copy_with_a_wrongly_scaled_bucket_fails_the_pipeline_check():
    result = _check("pipeline").execute(QUICK, ScaledBucketCandidate())
    assert result.error is None, result.error
    failed = set(result.failed_labels())
    # WronglyScaledBucketDDP doubles the last bucket's gradient_scaling_factor: every case's
    # reduced grads are wrong where the published candidate's are refgrad's bit for bit.
    for case in UNTIED:
        for overlap in ("on", "off"):
            assert f"{case}, overlap {overlap}: reduced grads vs refgrad" in failed
    assert _pipeline_expected_failures() <= failed


@pytest.mark.dist
def test_launch_sites_count_a_reduction_an_earlier_launch_already_finished():
    """P2 D2, distributed optimizer, fp32-accumulating reduce-scatter, overlap on (a small
    copy of the full pipeline check's P2 D4 case). Expected, from param_and_grad_buffer.py
    in both releases: after the first batch (_ParamAndGradBucketGroup.reset records the
    golden grad-ready counts) register_grad_ready launches a group from the backward hooks
    once all its grads are in; pipeline rank 0 enables grad sync for its last backward
    (schedules.py forward_backward_pipelining_without_interleaving), so its groups launch
    there ("hook"); the other stage launches in grad_sync_func after the cooldown
    ("dispatch"). Pipeline rank 0 has two groups (bucket size 80, hand-derived in
    test_pipeline_check_classifies_every_megatron_difference). From 0.17 on each group's
    start_grad_sync first finishes its predecessor's (previous_grad_reduce_bucket_group), so
    a launched reduction may be over by the time the schedule's hooks look: it still counts
    as launched (pipeline_training.reduction_launched), never as left for finish_grad_sync."""
    from refgrad.pipeline import LinearStackSpec, stage_param_name
    from tests.distributed_utils import run_distributed
    from verify.candidates.api.pipeline import ParallelDims, PipelineCase
    from verify.checks.pipeline.cases import default_plans
    from verify.checks.pipeline.worker import pipeline_worker

    spec = LinearStackSpec(num_stages=2, layers_per_stage=2, hidden=8, microbatch_size=4,
                           seed=0)
    case = PipelineCase("P2 D2 reduce-scatter fp32-accumulation sum",
                        ParallelDims(pp_size=2, dp_size=2), spec,
                        default_plans(2, stage_param_name(1, "layers.0.weight")),
                        use_distributed_optimizer=True,
                        reduce_scatter_with_fp32_accumulation=True)
    ranks = run_distributed(pipeline_worker, 4, MegatronCoreCandidate(), [[case]],
                            timeout_s=300)
    results = [r[case.name][True] for r in ranks]
    assert sorted((res.stage, len(res.launch_sites[0])) for res in results) == [
        (0, 2), (0, 2), (1, 1), (1, 1)]
    for res in results:
        site = "hook" if res.stage == 0 else "dispatch"
        assert all(step == (site,) * len(step) for step in res.launch_sites[1:]), (
            res.stage, res.launch_sites)


def test_mxfp8_check_is_a_skip_with_the_reason():
    result = _check("mxfp8").execute(QUICK, MegatronCoreCandidate())
    assert result.status == "SKIP" and not result.comparisons and not result.expectations
    if not torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is None:
        assert result.skipped == [
            "mxfp8: megatron-core cannot run MXFP8 here: Megatron-Core's MXFP8 params are "
            "Transformer Engine's "
            "MXFP8Tensor (megatron.core.fp8_utils.HAVE_TE_MXFP8TENSOR is False: "
            "transformer_engine is not importable); Transformer Engine needs CUDA"]

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
from verify.check import CheckContext

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))

if missing_reason() is None:
    from tests.candidates.megatron_faults import WronglyScaledBucketDDP
    from verify.candidates import Behaviour
    from verify.candidates.megatron_core.bucket_layout import MegatronLayout
    from verify.candidates.megatron_core.candidate import DOCUMENTED, MegatronCoreCandidate
    from verify.candidates.megatron_core.pipeline_training import MegatronPipeline

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
    # Megatron-Core's _ParamAndGradBuffer takes its start from the allocator, and its
    # DistributedDataParallel gives every stage after the first one bucket; it has neither
    # torch's byte-sized DDP buckets nor FSDP2's per-parameter shards. Its DDP pre-scales by
    # 1/W and reduces on the wire (neither a compress hook nor FSDP2's divide factors); its
    # optimizer is torch's AdamW (not torch's SGD) with no decay on 1-D params, its own
    # partial-sum norm clipped with its own coefficient, and the gather in the forward.
    buffers = {Behaviour.BUFFER_ALIGNMENT_FROM_ALLOCATOR, Behaviour.ONE_BUCKET_AFTER_FIRST_STAGE,
               Behaviour.PRESCALE, Behaviour.WIRE_COLLECTIVE}
    optimizer = {Behaviour.TORCH_ADAMW_ORDER, Behaviour.NO_DECAY_ON_1D_PARAMS,
                 Behaviour.PARTIAL_SUM_GRAD_NORM, Behaviour.PARAM_GATHER_IN_FORWARD}
    assert set(DOCUMENTED) == buffers | optimizer
    for behaviour in Behaviour:
        documented = candidate.documented(behaviour)
        if behaviour not in buffers | optimizer:
            assert documented is None, behaviour
            continue
        prefix = "megatron.core.distributed." if behaviour in buffers else "megatron/core/"
        assert documented.where.startswith(prefix), documented.where


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


@pytest.mark.dist  # Megatron-Core's single-process parts run in a 1-rank world of their own
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
        # The parts for torch's DDP Reducer and FSDP2's per-parameter shards (api.layout's
        # defaults: Megatron-Core has neither).
        "DDP buckets watched while training: layout: is not torch's DDP (no Reducer whose "
        "buckets a hook can watch)",
        "parameters sharded one by one: layout: does not shard parameters one by one",
        "multi-rank reduce-scatter through the buffers runs only without --quick",
    ]


@pytest.mark.dist
def test_layout_reductions_pass_each_in_a_process_of_its_own():
    from verify.checks.layout import default_scenarios, run_reduce_scenarios

    # param_and_grad_buffer.py _ParamAndGradBucketGroup.__init__: a bucket group built with
    # reduce_scatter_with_fp32_accumulation rebinds the module global dist_reduce_scatter_func
    # for the process (finding 1). Each scenario runs in fresh rank processes, so none sees what
    # an earlier one left, and Megatron's buffers reduce every scenario exactly (integer grads:
    # every sum is exact; refgrad's layout and the exact sums decide).
    scenarios = default_scenarios(2)
    assert [s.name for s in scenarios][2] == "reduce-scatter with fp32 accumulation"
    results = run_reduce_scenarios(2, scenarios, MegatronCoreCandidate(), timeout_s=300.0)
    assert all(r.crash is None and r.skipped is None for r in results), [
        (r.label, r.crash) for r in results if r.crash is not None]
    assert [label for r in results for label, passed, _ in r.checks if not passed] == []
    assert len([c for r in results for c in r.checks]) == 2 * len(scenarios)
    # The copy whose last bucket is scaled twice over fails the averaged scenarios.
    averaged = [s for s in scenarios if s.averaging.averages]
    results = run_reduce_scenarios(2, averaged, ScaledBucketCandidate(), timeout_s=300.0)
    assert [passed for r in results for _, passed, _ in r.checks] == [False] * 2 * len(averaged)


def _one_deferred_entry(case) -> bool:
    """megatron/core/utils.py drain_embedding_wgrad_compute pops the first entry, then loops
    over the rest: with exactly one deferred (input, grad_output) the loop never binds
    ``drain_idx`` and the last GEMM raises UnboundLocalError, after both buffers were emptied."""
    deferred = case.num_microbatches if case.limit == 0 else min(case.limit, case.num_microbatches)
    return deferred == 1


@pytest.mark.dist
def test_deferred_wgrad_check_fails_exactly_megatrons_one_entry_drain_and_stale_grad_output():
    from verify.checks.deferred_wgrad.cases import ITERATIONS, build_cases

    result = _check("deferred_wgrad").execute(QUICK, MegatronCoreCandidate())
    assert result.error is None, result.error
    cases = build_cases(quick=True)
    one_entry = {c.label for c in cases if _one_deferred_entry(c)}
    # Every case whose drain holds one entry crashed there (finding 3), on both ranks, and is
    # reported as that crash: no drain count, no ULP distance of the wgrad it lost.
    assert {c.label for c in result.crashes} == one_entry
    for crash in result.crashes:
        assert (crash.exception, crash.function, crash.ranks) == (
            "UnboundLocalError", "drain_embedding_wgrad_compute", [0, 1])
        assert crash.where.startswith("megatron/core/utils.py:")
    assert not any(r.label.startswith(tuple(one_entry)) for r in
                   (*result.comparisons, *result.expectations))
    # pipeline_parallel/schedules.py clear_embedding_activation_buffer clears the activation
    # buffer only: an abandoned step's grad_output is paired with the next step's first input
    # (finding 6: direct API use only, a hazard).
    failed = [*(c.label for c in result.comparisons if not c.passed),
              *(e.label for e in result.expectations if not e.passed)]
    assert failed == ["stale step: start_step clears both buffers (bitwise equal to a fresh layer)"]
    by_case = {c.label: c for c in result.cases}
    assert all(by_case[label].finding == "megatron-core-3" for label in one_entry)
    assert by_case["stale step"].finding == "megatron-core-6"
    assert [c.label for c in result.hazards] == ["stale step"]
    assert set(result.known_findings) == {"megatron-core-3", "megatron-core-6"}
    # Finding 3 is reachable from a launch (--wgrad-deferral-limit 1): the check FAILs.
    assert result.status == "FAIL"
    # Every other case ran and was compared (and passed, by the equality above).
    counted = {e.label for e in result.expectations if e.label.endswith(": drain count")}
    assert counted == {f"{c.label}/rank{r}: drain count" for c in cases
                       if c.label not in one_entry for r in (0, 1)}
    drain_order = {e.label for e in result.expectations
                   if e.label.endswith("deferred == immediate in drain order (bitwise)")}
    assert len(drain_order) == ITERATIONS * 2 * (len(cases) - len(one_entry))
    assert all(e.passed for e in result.expectations if e.label.startswith("tied/"))
    assert all(c.passed for c in result.comparisons if c.label.startswith("tied/"))
    assert result.skipped == [
        "guard: deferred_wgrad: megatron-core has no in-flight guard on its drain "
        "(megatron.core.utils.drain_embedding_wgrad_compute cannot refuse)",
        "CUDA wgrad GEMM (cuBLAS, fp32 output) vs refgrad: run `verify run --device cuda`",
    ]
    assert not result.differences


TIED = "P2 D2 all-reduce avg-in-collective, tied head"
EVERY_STEP = "P2 D2 all-reduce avg-in-collective, tied head, M >= 2"
UNTIED = ("P4 D1 all-reduce sum", "P2 D2 V2 interleaved all-reduce sum")


@pytest.mark.dist
def test_pipeline_check_classifies_every_megatron_difference():
    result = _check("pipeline").execute(QUICK, MegatronCoreCandidate())
    assert result.error is None, result.error
    # The tied head deferred with M = 1 in steps 1 and 3 (default_plans(2): 5, 1, 2, 1): the
    # drain of one entry raises (utils.drain_embedding_wgrad_compute, finding 3) on the last
    # stage's ranks, with overlap and without; a crash, not numbers.
    assert sorted(c.label for c in result.crashes) == [f"{TIED}, overlap off", f"{TIED}, overlap on"]
    assert all((c.exception, c.function, c.ranks) == (
        "UnboundLocalError", "drain_embedding_wgrad_compute", [2, 3]) for c in result.crashes)
    # With M >= 2 every step and overlap on: schedules.py
    # forward_backward_pipelining_without_interleaving calls config.grad_sync_func
    # (Megatron-LM's align_grad_reduce) after the cooldown, then finish_embedding_wgrad_compute:
    # the head's bucket is reducing while its deferred wgrads are drained into it (finding 4).
    # Without overlap the head is drained before the reduction: bitwise refgrad.
    tag = f"{EVERY_STEP}, overlap on"
    drained_late = (f"{tag}: the deferred output-layer wgrads were drained before their bucket's "
                    "reduction was launched")
    crashed = {f"{c.label}: {c.summary()}" for c in result.crashes}
    # The drain into a reducing bucket is always seen (the expectation fails every run). How
    # wrong the drained-late head comes out depends on when gloo's async all-reduce thread read
    # the bucket (a race): usually before the drain, so the reduced grads and params differ
    # from refgrad (and maybe the later losses); on a starved machine (load ~30 on 2 cores) it
    # read it after, and they matched.
    racy = {f"{tag}: {what} vs refgrad" for what in ("reduced grads", "params after SGD", "losses")}
    failed = set(result.failed_labels())
    assert {drained_late} | crashed <= failed <= {drained_late} | crashed | racy
    findings = {c.label: c.finding for c in result.cases if not c.passed}
    assert findings == {f"{TIED}, overlap on": "megatron-core-3",
                        f"{TIED}, overlap off": "megatron-core-3",
                        tag: "megatron-core-4"}
    assert result.status == "FAIL" and not result.hazards
    passed = {c.label for c in result.comparisons if c.passed}
    for case in (*UNTIED, EVERY_STEP):  # bitwise refgrad through Megatron's DDP and schedules
        for overlap in ("on", "off"):
            if (case, overlap) == (EVERY_STEP, "on"):
                continue
            assert {f"{case}, overlap {overlap}: {what} vs refgrad"
                    for what in ("losses", "reduced grads", "params after SGD")} <= passed
    assert "timing P2 D2: grads overlap on vs off" in passed
    # The head's grad is among those that differ (and, tied, the first stage's weight); at
    # which step first depends on the race with gloo's async all-reduce.
    if f"{tag}: reduced grads vs refgrad" in failed:
        note = next(n for n in result.notes if n.startswith(f"{tag}: reduced grads differ"))
        assert "stage1.head.weight" in note and "stage0.layers.0.weight" in note, note
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
        f"{EVERY_STEP}, overlap on: buckets per rank vs refgrad's layout",
        "P4 D1 all-reduce sum, overlap on: buckets per rank vs refgrad's layout"]
    assert all(d.where == documented.where for d in result.differences)
    # Megatron has no timeline, no per-chunk enable log and no relearn count: skips.
    assert sorted(result.skipped) == sorted(
        [f"{case}, overlap {o}: megatron-core reports no count of relearning which params each "
         "bucket waits for" for case in (EVERY_STEP, *UNTIED) for o in ("on", "off")]
        + [f"{UNTIED[1]}, overlap {o}: the candidate recorded no per-chunk grad-sync enables"
           for o in ("on", "off")]
        + ["timing P2 D2: megatron-core recorded no timelines (no simulator comparison)"])


@pytest.mark.dist
def test_a_copy_with_a_wrongly_scaled_bucket_fails_the_pipeline_check():
    result = _check("pipeline").execute(QUICK, ScaledBucketCandidate())
    assert result.error is None, result.error
    failed = set(result.failed_labels())
    # WronglyScaledBucketDDP doubles the last bucket's gradient_scaling_factor: every case's
    # reduced grads are wrong where the published candidate's are refgrad's bit for bit, and
    # no known finding explains them (their settings reach none).
    for case in UNTIED:
        for overlap in ("on", "off"):
            assert f"{case}, overlap {overlap}: reduced grads vs refgrad" in failed
    unexplained = {c.label for c in result.cases if not c.passed and c.finding is None}
    assert {f"{case}, overlap {o}" for case in UNTIED for o in ("on", "off")} <= unexplained
    assert result.status == "FAIL"


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
    from gradvocab import ParallelDims
    from refgrad.pipeline import LinearStackSpec, stage_param_name
    from verify.candidates.interfaces import PipelineCase
    from verify.checks.pipeline.cases import default_plans
    from verify.checks.pipeline.worker import PipelineRun, pipeline_worker
    from verify.distributed import spawn_each

    spec = LinearStackSpec(num_stages=2, layers_per_stage=2, hidden=8, microbatch_size=4,
                           seed=0)
    case = PipelineCase("P2 D2 reduce-scatter fp32-accumulation sum",
                        ParallelDims(pp_size=2, dp_size=2), spec,
                        default_plans(2, stage_param_name(1, "layers.0.weight")),
                        use_distributed_optimizer=True,
                        reduce_scatter_with_fp32_accumulation=True)
    (outcome,) = spawn_each(pipeline_worker, 4, [PipelineRun(case, True)],
                            MegatronCoreCandidate(), isolate=True, timeout_s=300)
    assert outcome.crash is None, outcome.crash
    results = outcome.results
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

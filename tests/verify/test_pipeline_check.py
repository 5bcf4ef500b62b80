"""The ``pipeline`` check passes on fastgrad and fails on deliberately broken candidates."""

import time
from dataclasses import dataclass, replace

import pytest

from gradvocab import ParallelDims
from refgrad.pipeline import LinearStackSpec, StepPlan
from tests.candidates.fastgrad_faults import Fault, FaultyFastgrad
from verify.candidates import FastgradCandidate, Technique, Unsupported
from verify.candidates.fastgrad.pipeline import FastgradPipeline
from verify.candidates.interfaces import PipelineCase
from verify.check import CheckContext
from verify.checks import check_by_name
from verify.checks.pipeline import CHECK
from verify.checks.pipeline.worker import PipelineRun, pipeline_worker
from verify.distributed import RankTimeout, spawn, spawn_each


def _case(pp, dp, first, spec, plans, vpp=1, **kw):
    return PipelineCase("x", ParallelDims(pp_size=pp, dp_size=dp, first_rank=first, vpp_size=vpp),
                        spec, plans, **kw)


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
    result = CHECK.execute(CheckContext(quick=True),
                           FaultyFastgrad(Fault.REVERSED_MICROBATCHES))
    assert not result.passed
    assert result.error is None
    failed = [c.label for c in result.comparisons if not c.passed]
    assert any("reduced grads vs refgrad" in label for label in failed), failed
    assert any("losses vs refgrad" in label for label in failed), failed
    # Both schedules: the non-interleaved 1F1B (P4 D1) and the interleaved one (V2).
    for name in ("P4 D1 all-reduce sum", "P2 D2 V2 interleaved all-reduce sum"):
        assert any(label.startswith(f"{name}, overlap on: reduced grads") for label in failed), failed


@pytest.mark.dist
def test_pipeline_check_fails_when_the_deferred_wgrad_drain_runs_newest_first():
    # Fault.LIFO_DRAIN: the last stage's output layer drains its deferred GEMMs in reverse,
    # another fp32 sum order of the same products; only the tied-head case has a head.
    result = CHECK.execute(CheckContext(quick=True), FaultyFastgrad(Fault.LIFO_DRAIN))
    assert not result.passed and result.error is None
    failed = [c.label for c in result.comparisons if not c.passed]
    head = "P2 D2 all-reduce avg-in-collective, tied head"
    assert f"{head}, overlap on: reduced grads vs refgrad" in failed, failed
    assert all(label.startswith(head) for label in failed), failed  # the headless cases pass


@dataclass(frozen=True)
class _PlainPipeline(FastgradPipeline):
    """fastgrad without the interleaved schedule, timelines or learned bucket readiness: what a
    candidate that lacks them reports."""

    def grid(self, dims):
        if dims.vpp_size > 1:
            raise Unsupported(Technique.PIPELINE, "has no interleaved schedule here")
        return super().grid(dims)

    def train(self, case, grid, *, overlap, progress=None):
        result = super().train(case, grid, overlap=overlap, progress=progress)
        return replace(result, events=[], relearn_count=None)


@dataclass(frozen=True)
class _PlainCandidate(FastgradCandidate):
    def pipeline(self):
        return _PlainPipeline()


@pytest.mark.dist
def test_what_a_candidate_cannot_run_or_report_is_skipped_and_the_rest_still_runs():
    result = CHECK.execute(CheckContext(quick=True), _PlainCandidate())
    assert result.passed, ([c.label for c in result.comparisons if not c.passed],
                           [e.label for e in result.expectations if not e.passed], result.error)
    assert "P2 D2 V2 interleaved all-reduce sum: pipeline: has no interleaved schedule here" \
        in result.skipped
    assert "timing P2 D2: fastgrad recorded no timelines (no simulator comparison)" in result.skipped
    assert any("reports no count of relearning which params each bucket waits for" in s
               for s in result.skipped)
    labels = [c.label for c in result.comparisons]
    assert "P4 D1 all-reduce sum, overlap on: reduced grads vs refgrad" in labels
    assert not any("interleaved" in label for label in labels)
    assert not any(t.title.startswith("simulator vs measured") for t in result.tables)


class _ScopedPipeline(FastgradPipeline):
    """fastgrad's pipeline that refuses grids and training outside its ``with`` scope, as a
    candidate whose per-process setup (Megatron-Core's CUDA redirects) must hold there."""

    def __enter__(self):
        object.__setattr__(self, "inside", True)
        return self

    def __exit__(self, *exc_info):
        object.__setattr__(self, "inside", False)

    def _require_scope(self, what: str) -> None:
        if not getattr(self, "inside", False):
            raise RuntimeError(f"PipelineTraining.{what} used outside 'with candidate.pipeline()'")

    def grid(self, dims):
        self._require_scope("grid")
        return super().grid(dims)

    def train(self, case, grid, *, overlap, progress=None):
        self._require_scope("train")
        return super().train(case, grid, overlap=overlap, progress=progress)


@dataclass(frozen=True)
class _ScopedCandidate(FastgradCandidate):
    def pipeline(self):
        return _ScopedPipeline()


@pytest.mark.dist
def test_the_check_uses_the_pipeline_interface_inside_its_scope():
    spec = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=8, seed=5)
    case = PipelineCase("P2 D1 scoped", ParallelDims(pp_size=2), spec, (StepPlan(2), StepPlan(2)))
    runs = [PipelineRun(case, overlap) for overlap in (True, False)]
    for outcome in spawn_each(pipeline_worker, 2, runs, _ScopedCandidate(), isolate=False):
        assert outcome.crash is None, outcome.crash
        assert all(not isinstance(r, str) and len(r.losses) == 2 for r in outcome.results)


@dataclass(frozen=True)
class _RaisingPipeline(FastgradPipeline):
    """fastgrad's pipeline whose rank 1 raises in its second step while its peer waits in a
    collective of the schedule."""

    def train(self, case, grid, *, overlap, progress=None):
        if grid.rank == 1 and case.name.startswith("P2 D2 all-reduce avg-in-collective, tied head"):
            raise ValueError("planted fault on rank 1")
        return super().train(case, grid, overlap=overlap, progress=progress)


@dataclass(frozen=True)
class _RaisingCandidate(FastgradCandidate):
    def pipeline(self):
        return _RaisingPipeline()


@pytest.mark.dist
def test_a_rank_raising_ends_its_case_in_seconds_as_a_crash_and_the_other_cases_run():
    started = time.monotonic()
    result = CHECK.execute(CheckContext(quick=True, timeout_s=60), _RaisingCandidate())
    elapsed = time.monotonic() - started
    assert result.status == "FAIL" and result.error is None
    crashed = {c.label for c in result.crashes}
    head = "P2 D2 all-reduce avg-in-collective, tied head"
    assert crashed == {f"{head}, overlap {o}" for o in ("on", "off")} | {
        f"{head}, M >= 2, overlap {o}" for o in ("on", "off")}
    for crash in result.crashes:
        assert (crash.exception, crash.message, crash.ranks) == (
            "ValueError", "planted fault on rank 1", [1])
        assert crash.where.endswith("train")
    # Nothing of a crashed run is compared; the other cases ran and passed.
    assert not any(c.label.startswith(head) for c in result.comparisons)
    assert "P4 D1 all-reduce sum, overlap on: reduced grads vs refgrad" in [
        c.label for c in result.comparisons if c.passed]
    # Each crash ended its world within FAILURE_GRACE_S, never at the 60 s stall timeout.
    assert elapsed < 60 * 2, elapsed


def test_candidate_validation():
    with pytest.raises(TypeError, match="FaultyFastgrad.fault must be a Fault"):
        FaultyFastgrad("gremlins")


def test_case_validation():
    spec = LinearStackSpec(num_stages=2)
    with pytest.raises(ValueError, match="reduction"):
        _case(2, 1, 0, spec, (StepPlan(1),), reduction="max")
    with pytest.raises(ValueError, match="dp_size"):
        _case(2, 0, 0, spec, (StepPlan(1),))
    with pytest.raises(ValueError, match="first_rank"):
        _case(2, 1, -1, spec, (StepPlan(1),))
    with pytest.raises(ValueError, match="num_stages"):
        _case(4, 1, 0, spec, (StepPlan(1),))
    with pytest.raises(ValueError, match="plans"):
        _case(2, 1, 0, spec, ())
    with pytest.raises(ValueError, match="lr"):
        _case(2, 1, 0, spec, (StepPlan(1),), lr=float("nan"))
    spec4 = LinearStackSpec(num_stages=4)
    with pytest.raises(ValueError, match=r"pp_size \* virtual_stages \(4\)"):
        _case(2, 1, 0, spec, (StepPlan(2),), vpp=2)
    with pytest.raises(ValueError, match=r"num_microbatches \[3\] must be multiples of pp_size"):
        _case(2, 1, 0, spec4, (StepPlan(2), StepPlan(3)), vpp=2)
    with pytest.raises(ValueError, match="vpp_size"):
        _case(2, 1, 0, spec, (StepPlan(2),), vpp=0)
    # The interleaved schedule drains an output head on the last virtual stage; no timing case.
    _case(2, 1, 0, LinearStackSpec(num_stages=4, output_head=True), (StepPlan(2),), vpp=2)
    with pytest.raises(ValueError, match="no timing"):
        _case(2, 1, 0, spec4, (StepPlan(2),), vpp=2, timing=True)
    # The grid splits the model as its spec does; a case carries sizes, never process groups.
    with pytest.raises(ValueError, match="must split the model as its spec does"):
        PipelineCase("x", ParallelDims(tp_size=2, pp_size=2), spec, (StepPlan(1),))
    with pytest.raises(TypeError, match="dims must be a ParallelDims"):
        PipelineCase("x", (2, 1, 0), spec, (StepPlan(1),))
    case = _case(2, 1, 0, spec, (StepPlan(1),))
    assert case.at(4).dims == ParallelDims(pp_size=2, first_rank=4) and case.at(4).spec is spec


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
    with FastgradCandidate().pipeline() as training, training.grid(case.dims) as grid:
        if rank == 1:
            progress = _StallingProgress(progress, "step 1: backward microbatch 1 start")
        return training.train(case, grid, overlap=True, progress=progress)


@pytest.mark.dist
def test_a_stalled_stage_is_reported_with_its_case_stage_and_step():
    spec = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=8, seed=5)
    case = PipelineCase("P2 D1 stall", ParallelDims(pp_size=2), spec, (StepPlan(3), StepPlan(3)))
    with pytest.raises(RankTimeout) as info:
        spawn(_pipeline_rank_that_stalls, 2, case, timeout_s=8)
    state = info.value.states[1]
    assert state.marker == "P2 D1 stall overlap on, stage 1, step 1: backward microbatch 1 start"
    assert "stage 1, step 1" in str(info.value)

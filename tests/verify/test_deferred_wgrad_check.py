"""The deferred_wgrad check passes on fastgrad and fails on deliberately broken candidates."""

from dataclasses import dataclass

import pytest
import torch.distributed as dist

from fastgrad.deferred_wgrad import ColumnParallelOutputLayer
from gradvocab import ParallelDims
from tests.candidates.fastgrad_faults import Fault, FaultyFastgrad
from verify.candidates import FastgradCandidate, Technique, Unsupported
from verify.candidates.fastgrad.deferred_wgrad import (
    FastgradDeferredWgrad,
    FastgradOutputLayer,
    FastgradWgradGemm,
)
from verify.candidates.interfaces import DeferredWgrad, OutputLayerConfig, WgradGemm
from verify.check import CheckContext, CheckRecorder
from verify.checks import CHECK_MODULES
from verify.checks.deferred_wgrad import CHECK, WgradCase, build_cases, compare_wgrad_gemms_on


class ClearsOnlyActivationsLayer(ColumnParallelOutputLayer):
    """Production's start-of-step bug: the grad_output buffer survives an abandoned step."""

    def start_step(self):
        self.activation_buffer.clear()
        return 0


@dataclass(frozen=True)
class ClearsOnlyActivationsCandidate(FastgradCandidate):
    """fastgrad whose output layers clear only the activations at step start (pickles into ranks)."""

    def deferred_wgrad(self) -> DeferredWgrad:
        return FastgradDeferredWgrad(layer_cls=ClearsOnlyActivationsLayer)



def test_registered():
    assert "deferred_wgrad" in CHECK_MODULES
    assert CHECK.name == "deferred_wgrad"


def test_case_matrix_covers_the_issue():
    cases = build_cases(quick=False)
    assert {c.num_microbatches for c in cases} == {1, 3, 8}
    assert {(c.tp, c.sequence_parallel) for c in cases} == {(1, False), (2, False), (2, True)}
    assert {c.main_grad_dtype for c in cases} == {"float32", "bfloat16"}
    for m in (1, 3, 8):
        assert {c.limit for c in cases if c.num_microbatches == m} == {0, 1, 2, m}


@pytest.mark.dist
def test_check_passes_quick():
    result = CHECK.execute(CheckContext(quick=True))
    assert result.error is None, result.error
    assert result.passed, result.failed_labels()[:10]
    assert len(result.comparisons) > 50 and len(result.expectations) > 100
    labels = " ".join(c.label for c in result.comparisons)
    assert "tied/bfloat16/iter1" in labels and "tp2-sp-" in labels


def test_fastgrad_satisfies_the_interface():
    assert isinstance(FastgradCandidate().deferred_wgrad(), DeferredWgrad)


@pytest.mark.dist
@pytest.mark.parametrize(
    "candidate, symptom",
    [(FaultyFastgrad(Fault.LIFO_DRAIN), "deferred == immediate in drain order"),
     (ClearsOnlyActivationsCandidate(), "stale step")],
)
def test_check_fails_on_a_broken_candidate(candidate, symptom):
    result = CHECK.execute(CheckContext(quick=True), candidate)
    assert result.error is None, result.error
    assert not result.passed
    assert any(symptom in label for label in result.failed_labels()), result.failed_labels()


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"tp": 0}, ValueError, r"WgradCase.tp must be an int >= 1"),
        ({"num_microbatches": 0}, ValueError, r"WgradCase.num_microbatches must be an int >= 1"),
        ({"limit": -1}, ValueError, r"WgradCase.limit must be an int >= 0"),
        ({"sequence_parallel": 1}, TypeError, r"WgradCase.sequence_parallel must be a bool"),
        ({"main_grad_dtype": "float16"}, ValueError, r"WgradCase.main_grad_dtype"),
        ({"lane": "zeros"}, ValueError, r"WgradCase.lane must be one of"),
    ],
)
def test_case_validates_itself(fields, error, match):
    good = {"tp": 1, "sequence_parallel": False, "num_microbatches": 3, "limit": 1,
            "main_grad_dtype": "float32", "lane": "grid"}
    WgradCase(**good)
    with pytest.raises(error, match=match):
        WgradCase(**{**good, **fields})


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"defer_embedding_wgrad_compute": 1}, TypeError, "defer_embedding_wgrad_compute must be a bool"),
        ({"wgrad_deferral_limit": -1}, ValueError, "wgrad_deferral_limit must be >= 0"),
        ({"wgrad_deferral_limit": 1.5}, TypeError, "wgrad_deferral_limit must be an int"),
        ({"dims": ParallelDims(pp_size=1)}, ValueError, "needs dims.pp_size > 1"),
        ({"dims": (2, 2)}, TypeError, "dims must be a ParallelDims"),
        ({"dims": ParallelDims(tp_size=2, pp_size=2)}, ValueError, "must carry the layer's TP group"),
    ],
)
def test_output_layer_config_validates_itself(fields, error, match):
    good = {"defer_embedding_wgrad_compute": True, "wgrad_deferral_limit": 2,
            "dims": ParallelDims(pp_size=2)}
    OutputLayerConfig(**good)
    with pytest.raises(error, match=match):
        OutputLayerConfig(**{**good, **fields})


def test_wgrad_gemm_comparison_logic_on_cpu():
    # The CUDA section's comparison, run on the CPU path (fastgrad's one CPU GEMM).
    gemms = FastgradCandidate().deferred_wgrad().wgrad_gemms("cpu")
    assert [g.name for g in gemms] == ["fp32_upcast"]
    rec = CheckRecorder("wgrad")
    compare_wgrad_gemms_on("cpu", rec, 0, gemms)
    result = rec.finish(0.0)
    assert result.passed and len(result.comparisons) == 2


class DropsFirstMicrobatch(WgradGemm):
    """fastgrad's GEMM, but every first microbatch of a run (of 3) is lost."""

    name = "fp32_upcast"

    def __init__(self) -> None:
        self.calls = 0
        self.gemm = FastgradWgradGemm(self.name)

    def __call__(self, main_grad, grad_output, total_input) -> None:
        self.calls += 1
        if self.calls % 3 != 1:
            self.gemm(main_grad, grad_output, total_input)


def test_wgrad_gemm_comparison_catches_a_dropped_microbatch():
    rec = CheckRecorder("wgrad")
    compare_wgrad_gemms_on("cpu", rec, 0, (DropsFirstMicrobatch(),))
    result = rec.finish(0.0)
    assert not result.passed
    assert result.failed_labels() == ["cpu wgrad fp32_upcast: main_grad float32 (exact grid)",
                                      "cpu wgrad fp32_upcast: main_grad bfloat16 (exact grid)"]


class SingleEntryDrainRaises(ColumnParallelOutputLayer):
    """As Megatron-Core 0.16.1's drain_embedding_wgrad_compute, which raises with exactly
    one deferred entry (its loop never binds ``drain_idx``)."""

    def drain_deferred_wgrad(self, reduce_in_flight=None):
        if len(self.grad_output_buffer) == 1:
            raise UnboundLocalError("cannot access local variable 'drain_idx'")
        return super().drain_deferred_wgrad(reduce_in_flight)


class NoGuardOutputLayer(FastgradOutputLayer):
    """A drain without an in-flight guard (as Megatron-Core's)."""

    def drain(self, reduce_in_flight=None):
        if reduce_in_flight is not None:
            raise Unsupported(Technique.DEFERRED_WGRAD, "this drain has no in-flight guard")
        return super().drain()


class MegatronLikeDeferredWgrad(FastgradDeferredWgrad):
    def output_layer(self, weight, config, **kwargs):
        return NoGuardOutputLayer(super().output_layer(weight, config, **kwargs).layer)


@dataclass(frozen=True)
class MegatronLikeCandidate(FastgradCandidate):
    def deferred_wgrad(self) -> DeferredWgrad:
        return MegatronLikeDeferredWgrad(layer_cls=SingleEntryDrainRaises)


@pytest.mark.dist
def test_a_case_the_candidate_raises_in_fails_alone_and_a_missing_guard_is_a_skip():
    result = CHECK.execute(CheckContext(quick=True), MegatronLikeCandidate())
    assert result.error is None, result.error
    assert result.status == "FAIL"
    # Exactly the cases that defer one microbatch per step (M = 1, or limit 1): the drain
    # raises on both ranks, and the case is that crash (its root cause and where), never the
    # numbers the failed drain left. No other case fails.
    single = {c.label for c in build_cases(quick=True)
              if min(c.limit or c.num_microbatches, c.num_microbatches) == 1}
    assert {c.label for c in result.crashes} == single
    for crash in result.crashes:
        assert (crash.exception, crash.ranks) == ("UnboundLocalError", [0, 1])
        assert crash.function == "drain_deferred_wgrad"
    assert [r.label for r in (*result.comparisons, *result.expectations)
            if not r.passed] == []
    assert not any(r.case in single for r in (*result.comparisons, *result.expectations))
    # fastgrad has no known findings: every crash is a failure of its own.
    assert all(c.finding is None for c in result.cases if not c.passed)
    assert "guard: deferred_wgrad: this drain has no in-flight guard" in result.skipped
    assert not any(e.label.startswith("guard:") for e in result.expectations)
    assert any(e.label.startswith("stale step") and e.passed for e in result.expectations)


def test_output_layer_config_at_tp_2_needs_the_tp_group_itself():
    """Dims given groups, but not the TP one, are refused: the layer would be built at TP 2
    over no group (Megatron's adapter then fails with a shape error instead)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        without_tp = ParallelDims(tp_size=2, pp_size=2).with_groups()
        with pytest.raises(ValueError, match="must carry the layer's TP group"):
            OutputLayerConfig(dims=without_tp)
    finally:
        dist.destroy_process_group()

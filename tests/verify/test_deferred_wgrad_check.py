"""The deferred_wgrad check passes on fastgrad and fails on deliberately broken candidates."""

import pytest

from fastgrad.deferred_wgrad import ColumnParallelOutputLayer
from verify.check import CheckContext, CheckRecorder
from verify.checks import CHECK_MODULES
from verify.checks.deferred_wgrad import CHECK, DeferredWgradCandidate, WgradCase, build_cases


class ReversedDrainLayer(ColumnParallelOutputLayer):
    """Drains LIFO instead of FIFO: right pairs, wrong order of the fp32 adds."""

    def drain_deferred_wgrad(self, reduce_in_flight=None):
        self.activation_buffer.reverse()
        self.grad_output_buffer.reverse()
        return super().drain_deferred_wgrad(reduce_in_flight)


class ClearsOnlyActivationsLayer(ColumnParallelOutputLayer):
    """Production's start-of-step bug: the grad_output buffer survives an abandoned step."""

    def start_step(self):
        self.activation_buffer.clear()
        return 0



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


@pytest.mark.dist
@pytest.mark.parametrize(
    "layer_cls, symptom",
    [(ReversedDrainLayer, "deferred == immediate in drain order"), (ClearsOnlyActivationsLayer, "stale step")],
)
def test_check_fails_on_a_broken_candidate(layer_cls, symptom):
    result = CHECK.execute(CheckContext(quick=True), DeferredWgradCandidate(layer_cls=layer_cls))
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


def test_wgrad_method_comparison_logic_on_cpu():
    # The CUDA section's comparison, run on the CPU path (cuda_method is ignored there).
    from verify.checks.deferred_wgrad import compare_wgrad_methods_on

    rec = CheckRecorder("wgrad")
    compare_wgrad_methods_on("cpu", rec, 0, ("fp32_upcast",))
    result = rec.finish(0.0)
    assert result.passed and len(result.comparisons) == 2


def test_wgrad_method_comparison_catches_a_dropped_microbatch():
    from fastgrad.deferred_wgrad import accumulate_wgrad_
    from verify.checks.deferred_wgrad import compare_wgrad_methods_on

    calls = []

    def drops_first(main_grad, go, x, *, cuda_method):
        calls.append(1)
        if len(calls) % 3 != 1:  # every first microbatch of a run is lost
            accumulate_wgrad_(main_grad, go, x, cuda_method=cuda_method)

    rec = CheckRecorder("wgrad")
    compare_wgrad_methods_on("cpu", rec, 0, ("fp32_upcast",),
                             DeferredWgradCandidate(accumulate=drops_first).accumulate)
    assert not rec.finish(0.0).passed

"""A rank that raises ends its configuration's world at once, in every multi-rank check and in
preflight's twin: the report leads with that rank's exception as a crash.

Each test plants a fault on ONE rank (rank 1) of fastgrad's adapters, where its peers then wait
in a collective for it. The stall timeout is long (60 s): had the peers been left waiting,
the check would end in a stall (an ERROR naming no exception, ``RankTimeout``), not in the
crash asserted here. How fast a crash is reported is measured by ``bench/bench_fail_fast.py``,
not here. A crash whose root cause is not the candidate's code is the harness's: the check
ERRORs, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch.distributed as dist

from gradvocab import Averaging
from tests.verify.preflight_launch import preflight_args
from verify.candidates import FastgradCandidate
from verify.candidates.fastgrad.deferred_wgrad import FastgradDeferredWgrad
from verify.candidates.fastgrad.grad_reduction import FastgradBucketReduction, FastgradGradReduction
from verify.candidates.fastgrad.layout import FastgradLayout
from verify.candidates.fastgrad.optimizer import FastgradOptimizer
from verify.candidates.fastgrad.pipeline import FastgradPipeline
from verify.check import CheckContext
from verify.checks import check_by_name
from verify.checks.layout import default_scenarios, run_reduce_scenarios
from verify.preflight.cli import main as preflight_main

CONTEXT = CheckContext(quick=True, timeout_s=60.0)
FAULT = "planted fault on rank 1"


def _on_rank_one() -> None:
    if dist.is_initialized() and dist.get_rank() == 1:
        raise ValueError(FAULT)


@dataclass(frozen=True)
class _RaisingLayout(FastgradLayout):
    def build_buffer(self, params, config, *, dp_size, dp_group=None, averaging=Averaging.SUM):
        _on_rank_one()
        return super().build_buffer(params, config, dp_size=dp_size, dp_group=dp_group,
                                    averaging=averaging)


@dataclass(frozen=True)
class _RaisingBucketReduction(FastgradBucketReduction):
    def __call__(self, grads, *, group):
        _on_rank_one()
        return super().__call__(grads, group=group)


@dataclass(frozen=True)
class _RaisingGradReduction(FastgradGradReduction):
    def bucket_reduction(self, config):
        return _RaisingBucketReduction(config)


@dataclass(frozen=True)
class _RaisingDeferredWgrad(FastgradDeferredWgrad):
    def output_layer(self, weight, config, *, main_grad_dtype=None, **kwargs):
        if config.dims.tp_size > 1:  # rank 0 then waits in the layer's TP collectives
            _on_rank_one()
        return super().output_layer(weight, config, **(
            {} if main_grad_dtype is None else {"main_grad_dtype": main_grad_dtype}))


@dataclass(frozen=True)
class _RaisingOptimizer(FastgradOptimizer):
    def build(self, model, settings):
        _on_rank_one()
        return super().build(model, settings)


@dataclass(frozen=True)
class _RaisingStages(FastgradPipeline):
    def model(self, case, grid, settings):
        _on_rank_one()
        return super().model(case, grid, settings)


@dataclass(frozen=True)
class RaisingCandidate(FastgradCandidate):
    """fastgrad whose rank 1 raises in every technique's first call of the candidate."""

    def layout(self):
        return _RaisingLayout()

    def grad_reduction(self):
        return _RaisingGradReduction()

    def deferred_wgrad(self):
        return _RaisingDeferredWgrad()

    def optimizer(self):
        return _RaisingOptimizer()

    def pipeline(self):
        return _RaisingStages()


@dataclass(frozen=True)
class HarnessFaultCandidate(RaisingCandidate):
    """The same fault, claimed by no code of the candidate: as a bug of the harness's own."""

    @property
    def own_modules(self) -> tuple[str, ...]:
        return ("no.such.package",)


def _assert_crashed_on_rank_one(result, check: str) -> None:
    assert result.error is None, result.error
    assert result.status == "FAIL", (check, result.status)
    assert result.crashes, check
    for crash in result.crashes:
        assert (crash.exception, crash.message, crash.ranks) == ("ValueError", FAULT, [1]), crash
        assert crash.where.endswith("_on_rank_one")
    # A crashed case is a crash, never numbers: nothing of it was compared.
    crashed = {c.label for c in result.crashes}
    assert not any(r.case in crashed for r in (*result.comparisons, *result.expectations))


@pytest.mark.dist
@pytest.mark.parametrize("check", ["reduce_scatter", "deferred_wgrad", "optim"])
def test_a_raising_rank_is_the_crash_of_its_configuration(check):
    result = check_by_name(check).execute(CONTEXT, RaisingCandidate())
    _assert_crashed_on_rank_one(result, check)


@pytest.mark.dist
def test_a_raising_rank_in_the_layout_reductions_is_their_crash():
    # The layout check's reductions run only in the full mode (quick skips them).
    results = run_reduce_scenarios(2, default_scenarios(2), RaisingCandidate(), timeout_s=60.0)
    assert results and all(r.crash is not None for r in results)
    for r in results:
        failure = r.crash.first
        assert (failure.exception, failure.message, r.crash.ranks) == ("ValueError", FAULT, (1,))


@pytest.mark.dist
def test_a_raising_rank_of_the_twin_is_named_as_the_twin_crash(tmp_path):
    args = preflight_args(["--world-size", "4", "--pipeline-model-parallel-size", "2",
                           "--global-batch-size", "8", "--micro-batch-size", "1",
                           "--num-layers", "4", "--hidden-size", "64",
                           "--num-attention-heads", "4", "--seq-length", "16",
                           "--max-position-embeddings", "16", "--padded-vocab-size", "128",
                           "--use-distributed-optimizer", "--twin-steps", "2", "--no-progress",
                           "--timeout", "60", "--json", str(tmp_path / "r.json")])
    assert preflight_main(args, environ={}, candidates=(RaisingCandidate(),)) == 1
    import json

    report = json.loads((tmp_path / "r.json").read_text())
    section = report["twin"]
    assert section["crashed"].startswith("rank 1: ValueError: planted fault on rank 1")
    assert "crashed: rank 1: ValueError" in report["verdict"]


@pytest.mark.dist
def test_a_crash_outside_the_candidates_code_is_an_error_naming_it():
    result = check_by_name("reduce_scatter").execute(CONTEXT, HarnessFaultCandidate())
    assert result.status == "ERROR"
    assert "rank 1 failed: ValueError: planted fault on rank 1" in result.error

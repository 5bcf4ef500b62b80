"""``verify preflight``'s twin with MXFP8 params (``--fp8-recipe mxfp8 --fp8-param-gather``).

The twin's weights are fastgrad MXFP8 params in one ``MXFP8ParamGradBuffer`` per rank
under ``DistributedOptimizer`` (``verify.candidates.fastgrad.stages``); refgrad quantizes its
exact masters with ``refgrad.mxfp8``. Three grids share one spawned world: DP 2, and
PP 2 x DP 2 and DP 2 with the grad buffer reused for the param all-gather. Two
deliberately broken fastgrads, installed in their ranks' processes only, must make the
twin FAIL naming the step and the parameter: scales rounded up (``ceil``) instead of the
spec's floor, and a param all-gather that runs over the shared bytes while the grads are
still there (before their reduce-scatter). The same late all-gather on a twin without
the reuse is harmless, which shows the reusing twin really shares the buffer. Each is a
fastgrad candidate whose stages build a broken subclass of its MXFP8 param or buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch

from fastgrad.comm import all_gather_into
from fastgrad.mxfp8 import MXFP8Parameter, quantize
from fastgrad.mxfp8_sharing import MXFP8ParamGradBuffer
from gradvocab import OptimizerRecord, RankResult
from tests.verify.preflight_launch import parsed_launch, preflight_config
from tests.verify.twin_world import plan_layout, train_and_compare
from verify.candidates import FastgradCandidate
from verify.candidates.fastgrad.pipeline import FastgradPipeline
from verify.candidates.fastgrad.stages import FastgradStages
from verify.preflight.cli import build_report
from verify.preflight.render import render_markdown
from verify.preflight.timing import CostInputs
from verify.preflight.twin import AdamWTwin, MXFP8Twin, TwinOptions, plan_twin
from verify.preflight.twin.adamw import adamw_twin_for
from verify.preflight.twin.compare import StepRow, compare_mxfp8_params
from verify.preflight.twin.mxfp8 import BLOCK

MODEL = ["--micro-batch-size", "1", "--num-layers", "8", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
         "--padded-vocab-size", "128", "--use-distributed-optimizer", "--bf16",
         "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather"]
STEPS = TwinOptions(hidden_size=8, layers=1, steps=3)  # hidden 8 -> 32: one MXFP8 block

DP2 = ["--pipeline-model-parallel-size", "1", "--world-size", "2",
       "--global-batch-size", "8"]
REUSE = ["--overlap-grad-reduce", "--overlap-param-gather", "--reuse-grad-buf-for-mxfp8-param-ag"]
# PP2 DP2 M4: tied embedding (own bucket in the MXFP8 buffer), stage 0 in three buckets.
PP2_DP2_REUSE = ["--pipeline-model-parallel-size", "2", "--world-size", "4",
                 "--global-batch-size", "8"] + REUSE
DP2_REUSE = DP2 + REUSE


def _config(flags: list[str], base: list[str] = MODEL):
    parsed = parsed_launch(base + flags)
    config = preflight_config(base + flags)
    return config, build_report(config, parsed, CostInputs())


def _plans(layout: dict, options: TwinOptions = STEPS) -> dict:
    return plan_layout(layout, _config, options)


# --------------------------------------------------------------------------- plan


def test_mxfp8_params_are_twinned_and_left_out_only_where_not_reproduced():
    plan = plan_twin(_config(PP2_DP2_REUSE)[0], STEPS)
    assert isinstance(plan.training, MXFP8Twin) and plan.training.reuse_grad_buffer
    assert plan.case.spec.hidden % BLOCK == 0  # every weight row is whole MXFP8 blocks
    assert not any("checked by `verify run --check mxfp8`" in g or "see the hazards" in g
                   for g in plan.not_twinned)
    assert any(g.startswith("FP8 compute") for g in plan.not_twinned)
    # --bf16 beside MXFP8: the MXFP8 twin's own fp32 compute, not the 16-bit twin's.
    assert not plan.training.adamw.precision.mixed
    assert any(g.startswith("bf16 params and compute with MXFP8 params") for g in plan.not_twinned)
    rows = {m[0]: m[1:] for m in plan.mapping}
    assert rows["param all-gather buffer"] == ("the grad buffer's bytes",) * 2
    assert "no forward pre-hooks" in rows["param all-gather"][1]
    # Reuse without both overlaps: production's NaN (a hazard); fastgrad refuses it, so the
    # twin gathers into its own buffer and says so.
    config = _config(DP2 + ["--reuse-grad-buf-for-mxfp8-param-ag"])[0]
    plan = plan_twin(config, STEPS)
    assert not plan.training.reuse_grad_buffer
    assert any("without both overlaps" in g for g in plan.not_twinned)
    assert dict((m[0], m[2]) for m in plan.mapping)["param all-gather buffer"] == "its own buffer"
    # Another FP8 recipe, or MXFP8 compute without --fp8-param-gather: not twinned, listed.
    other_recipe = [f if f != "mxfp8" else "delayed" for f in MODEL]
    no_param_gather = [f for f in MODEL if f != "--fp8-param-gather"]
    for base in (other_recipe, no_param_gather):
        plan = plan_twin(_config(DP2, base)[0], STEPS)
        assert isinstance(plan.training, AdamWTwin)
        assert any("--check mxfp8" in g for g in plan.not_twinned)
    # The MXFP8 buffer reduce-scatters in the backend's order: at DP 3 the twin runs DP 2
    # (bitwise; listed), and fastgrad's fp32-accumulating reduce-scatter is listed too.
    plan = plan_twin(_config(["--world-size", "3", "--global-batch-size", "12",
                              "--ddp-reduce-scatter-with-fp32-accumulation",
                              "--grad-reduce-in-bf16"])[0], STEPS)  # (fp32 grads turn it off)
    assert isinstance(plan.training, MXFP8Twin)
    assert not plan.case.reduce_scatter_with_fp32_accumulation
    assert plan.case.dp_size == 2 and plan.bitwise
    assert any(g.startswith("data parallelism DP 3 scaled to DP 2 for the MXFP8 twin")
               for g in plan.not_twinned)
    assert any(g.startswith("--ddp-reduce-scatter-with-fp32-accumulation with MXFP8 params")
               for g in plan.not_twinned)
    # fp16's loss scale: the MXFP8 buffer takes no loss scaler, so the twin steps unscaled.
    fp16 = _config(DP2, [f if f != "--bf16" else "--fp16" for f in MODEL])[0]
    plan = plan_twin(fp16, STEPS)
    assert adamw_twin_for(fp16)[0].loss_scale == 2.0**32 and plan.training.adamw.loss_scale is None
    assert any(g.startswith("loss scale 4.29497e+09: fastgrad's MXFP8 buffer takes no loss scaler")
               for g in plan.not_twinned)


# --------------------------------------------------------------------------- multi-rank


LAYOUT = {"dp2": (DP2, 0), "pp2_dp2_reuse": (PP2_DP2_REUSE, 2), "dp2_reuse": (DP2_REUSE, 6)}


@pytest.fixture(scope="module")
def twins():
    plans = _plans(LAYOUT)
    return train_and_compare(plans, 8)


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_mxfp8_twin_matches_refgrad_bitwise(twins, name):
    report, plan, passed, results = twins[name]
    assert passed, report["twin"]["failures"][:3]
    assert report["verdict"].startswith("PASS") and plan.bitwise
    steps = report["twin"]["steps"]
    assert len(steps) == 3
    for s in steps:
        assert s["grads_bitwise"] == s["grads_total"] > 0
        assert s["params_bitwise"] == s["params_total"]
        assert s["state_bitwise"] == s["state_total"] == 3 * s["params_total"]
        # scale and element bits of every param on every rank
        assert s["mxfp8_bitwise"] == s["mxfp8_total"] == 2 * sum(len(r.optimizer.mxfp8[0]) for r in results)
    # The reusing twins really all-gathered through the grad buffer's bytes; dp2 did not.
    assert all(r.optimizer.buffer_shared == ("reuse" in name) for r in results)
    total = steps[0]["mxfp8_total"]
    assert f"| 2 | {total}/{total} |" in render_markdown(report)  # the per-step bits table


@pytest.mark.dist
def test_the_forward_runs_on_quantized_weights(twins):
    # Not vacuous: MXFP8 moves the weights off the fp32 masters (one E4M3 element keeps
    # 4 significant bits), so the dequantized params the forward uses differ from them.
    for name in LAYOUT:
        results = twins[name][3]
        moved = sum(int((r.params[step][n] != r.optimizer.state[step][n]["master"]).sum())
                    for r in results for step in range(3) for n in r.params[step])
        assert moved > 0, name


# --------------------------------------------------------------------------- broken fastgrads


class _CeilScales(MXFP8Parameter):
    """An MXFP8 param whose scales round up (``ceil``) instead of the spec's floor."""

    def copy_from(self, values):
        quantize(values.reshape(self.shape), scale_mode="ceil", block_size=self.block_size,
                 out=(self.scale_bits, self.element_bits))


class _GatherOverGrads(MXFP8ParamGradBuffer):
    """A param all-gather that lands before the grads' reduce-scatter (production's ordering
    hazard, unguarded): with the reuse its bytes are the grads' bytes."""

    def reduce_grads(self):
        for bucket in self.buckets:
            all_gather_into(bucket.param_data, bucket.local_param_shard.clone(), group=self.dp_group)
        return super().reduce_grads()


class _CeilStages(FastgradStages):
    mxfp8_param_class = _CeilScales


class _LateGatherStages(FastgradStages):
    mxfp8_buffer_class = _GatherOverGrads


@dataclass(frozen=True)
class _BrokenPipeline(FastgradPipeline):
    stages: type[FastgradStages] = FastgradStages

    def model(self, case, grid, settings):
        return self.stages(case, self.rank_grid(case, grid), settings)


@dataclass(frozen=True)
class _BrokenMXFP8Candidate(FastgradCandidate):
    """fastgrad whose stages build a broken MXFP8 param or buffer class."""

    name = "fastgrad (broken MXFP8)"
    stages: type[FastgradStages] = FastgradStages

    def pipeline(self):
        return _BrokenPipeline(stages=self.stages)


@pytest.mark.dist
def test_wrong_scale_rounding_or_a_gather_over_live_grads_fails_naming_step_and_parameter():
    plans = _plans({"ceil_scales": (DP2, 0), "gather_over_grads": (PP2_DP2_REUSE, 2),
                    "gather_without_reuse": (DP2, 6)}, replace(STEPS, steps=2))
    late = _BrokenMXFP8Candidate(stages=_LateGatherStages)
    out = train_and_compare(plans, 8, {"ceil_scales": _BrokenMXFP8Candidate(stages=_CeilStages),
                                       "gather_over_grads": late, "gather_without_reuse": late})
    for name in ("ceil_scales", "gather_over_grads"):
        report, _, passed, _ = out[name]
        assert not passed and report["verdict"].startswith("FAIL"), name
    ceil = out["ceil_scales"][0]["twin"]["failures"]
    assert any(f.startswith("step 0: MXFP8 scale bits of stage0.layers.0.weight (replica 0)")
               for f in ceil)
    gather = out["gather_over_grads"][0]["twin"]["failures"]
    assert any(f.startswith("step 0: reduced gradient stage0.") for f in gather), gather[:3]
    # Without the reuse the late gather writes the params' own buffer: nothing to corrupt.
    report, _, passed, results = out["gather_without_reuse"]
    assert passed, report["twin"]["failures"][:3]
    assert not any(r.optimizer.buffer_shared for r in results)


def test_an_mxfp8_param_a_rank_did_not_report_fails():
    """Names come from refgrad: a replica whose ranks report only some MXFP8 params fails,
    naming the missing one (matching bits on the reported ones are not enough)."""

    bits = (torch.tensor([127], dtype=torch.uint8), torch.tensor([1, 2], dtype=torch.uint8))
    reference = SimpleNamespace(mxfp8=[{"stage0.layers.0.weight": bits, "stage0.layers.0.bias": bits}])
    case = SimpleNamespace(tp_size=1, spec=SimpleNamespace(tensor_parallel=1))
    rank = RankResult(stage=0, dp_rank=0,
                      optimizer=OptimizerRecord(mxfp8=[{"stage0.layers.0.weight": bits}]))
    row = StepRow(step=0, microbatches=1, loss_max_ulp=0, grads_bitwise=1, grads_total=1,
                  grad_max_ulp=0, params_bitwise=1, params_total=1, param_max_ulp=0)
    compare_mxfp8_params(case, row, reference, [rank])
    assert row.mxfp8_bitwise == row.mxfp8_total == 2  # the reported param matched
    assert row.failures == ["step 0: MXFP8 param stage0.layers.0.bias (replica 0) was not "
                            "reported by its rank"]

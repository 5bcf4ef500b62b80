"""``verify preflight``'s twin with 16-bit params: bf16/fp16 compute, fp32 or 16-bit grad buffers.

Multi-rank twins run in one spawned 8-rank world (grids side by side) and are
compared with refgrad (``refgrad.pipeline_mixed`` + ``refgrad.optim``) through
the CLI's own code. The fp16 twin starts from a loss scale at which its fp16
grads overflow, so the scaler's skip, hysteresis and backoff run on the ranks.
A deliberately broken fastgrad (grads accumulated through the param dtype into
the fp32 main-grad buffer) must make the twin FAIL naming step and parameter.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed_utils import run_distributed
from tests.verify.test_preflight_twin_optim import STEPS, _config, _finish, _phases, _plans
from verify.preflight.twin import plan_twin, reference_for
from verify.preflight.twin_precision import TwinPrecision, precision_for
from verify.preflight.twin_worker import TwinCandidate, twin_phases_worker

# PP2 DP2 M4, tied embedding, distributed optimizer, both overlaps: bf16 params with
# Megatron's default fp32 main grads (the usual production setup).
BF16 = ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2", "--global-batch-size", "8",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--bf16"]
# PP2 DP2 M4, bf16 grad buffer (--grad-reduce-in-bf16), deferred output wgrad (limit 2).
BF16_GRADS = ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2",
              "--global-batch-size", "8", "--use-distributed-optimizer", "--bf16",
              "--grad-reduce-in-bf16", "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "2"]
# PP2 DP2 M4, fp16 params and grads from a loss scale of 2^19: refgrad's fp16 grads overflow at
# 2^19 on steps 0 and 1 and not at 2^18 on step 2 (see the test below).
FP16_OVERFLOW = ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2",
                 "--global-batch-size", "8", "--use-distributed-optimizer", "--fp16",
                 "--initial-loss-scale", str(2**19)]

LAYOUT = {"bf16": (BF16, 0, 0), "bf16_grads": (BF16_GRADS, 4, 0), "fp16_overflow": (FP16_OVERFLOW, 0, 1)}


# --------------------------------------------------------------------------- planning


@pytest.mark.parametrize("flags, params, grads", [
    (["--bf16"], "bf16", "fp32"),  # arguments.py: --bf16 accumulates in fp32 by default
    (["--bf16", "--grad-reduce-in-bf16"], "bf16", "bf16"),
    (["--fp16"], "fp16", "fp16"),
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], "fp16", "fp32"),
    ([], "fp32", "fp32"),
])
def test_the_twin_takes_the_configurations_param_and_grad_dtypes(flags, params, grads):
    config, _ = _config(["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2",
                         "--global-batch-size", "8"] + flags)
    plan = plan_twin(config, STEPS)
    assert plan.adamw.precision == TwinPrecision(params, grads)
    assert plan.case.dp_size == 2 and plan.bitwise
    assert not any("computes in fp32" in g or "reduces fp32 grads" in g for g in plan.not_twinned)
    rows = {m[0]: m[1:] for m in plan.mapping}
    assert rows["main-grad buffer and DP wire dtype"] == (grads, grads)


def test_where_the_twin_keeps_fp32_or_scales_dp_it_says_so():
    tp2, _ = _config(["--tensor-model-parallel-size", "2", "--data-parallel-size", "2",
                      "--global-batch-size", "2", "--bf16", "--grad-reduce-in-bf16"])
    precision, dp, left_out = precision_for(tp2, 2)
    assert precision == TwinPrecision() and dp == 2
    assert [g.split(":")[0] for g in left_out] == ["bf16 params and compute at TP > 1",
                                                   "bf16 grad buffer and wire dtype at TP > 1"]
    # DP 4 with a backend-ordered 16-bit sum: DP 2, listed; the fp32-accumulating
    # reduce-scatter fixes the order, so DP 4 stays.
    dp4 = ["--data-parallel-size", "4", "--global-batch-size", "8", "--use-distributed-optimizer",
           "--bf16", "--grad-reduce-in-bf16"]
    plan = plan_twin(_config(dp4)[0], STEPS)
    assert plan.case.dp_size == 2 and plan.world_size == 2 and plan.bitwise
    assert any(g.startswith("data parallelism DP 4 scaled to DP 2") for g in plan.not_twinned)
    assert dict((m[0], m[1:]) for m in plan.mapping)["TP x PP x VPP x DP"] == ("1 x 1 x 1 x 4",
                                                                              "1 x 1 x 1 x 2")
    plan = plan_twin(_config(dp4 + ["--ddp-reduce-scatter-with-fp32-accumulation"])[0], STEPS)
    assert plan.case.dp_size == 4 and plan.bitwise
    with pytest.raises(ValueError, match="TwinPrecision.grads must be fp32 or the param dtype"):
        TwinPrecision("bf16", "fp16")


# --------------------------------------------------------------------------- multi-rank


@pytest.fixture(scope="module")
def twins():
    plans = _plans(LAYOUT)
    return _finish(plans, run_distributed(twin_phases_worker, 8, _phases(plans), timeout_s=300),
                   TwinCandidate())


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_16_bit_twin_matches_refgrad_bitwise(twins, name):
    report, plan, passed, results = twins[name]
    assert passed, report["twin"]["failures"][:3]
    steps = report["twin"]["steps"]
    assert plan.bitwise and len(steps) == 3
    for s in steps:
        assert s["grads_bitwise"] == s["grads_total"] > 0
        assert s["params_bitwise"] == s["params_total"]
        assert s["state_bitwise"] == s["state_total"] == 3 * s["params_total"]
    precision = plan.adamw.precision
    for res in (r for r in results if r is not None):  # the ranks really ran 16 bits
        assert {p.dtype for p in res.params[0].values()} == {precision.param_dtype}
        assert {g.dtype for g in res.grads[0].values()} == {precision.grad_dtype}


@pytest.mark.dist
def test_fp16_overflow_skips_the_step_backs_off_after_the_hysteresis_and_keeps_the_params(twins):
    report, plan, passed, results = twins["fp16_overflow"]
    assert passed, report["twin"]["failures"][:3]
    reference = reference_for(plan)
    # refgrad's fp16 grads: non-finite at 2^19 (steps 0 and 1), finite at 2^18 (step 2).
    finite = [all(bool(g.isfinite().all()) for g in step.values()) for step in reference.grads]
    assert finite == [False, False, True]
    # Megatron's DynamicGradScaler, by hand: overflow -> hysteresis 2 -> 1 (scale kept);
    # overflow -> 0, scale x 0.5; a clean step keeps it (window 1000).
    assert [s["loss_scale"] for s in report["twin"]["steps"]] == [2.0**19, 2.0**19, 2.0**18]
    for res in (r for r in results if r is not None):
        assert [stepped for stepped, *_ in res.steps] == [False, False, True]
    # A skipped step leaves the params at the fp16-rounded initial values, on every rank.
    initial = {n: p.detach().to(torch.float16) for n, p in _initial_params(plan).items()}
    for step in (0, 1):
        for res in (r for r in results if r is not None):
            for name, value in res.params[step].items():
                assert torch.equal(value, initial[name]), (step, name)
    assert any(not torch.equal(v, initial[n]) for r in results if r is not None
               for n, v in r.params[2].items())


def _initial_params(plan) -> dict:
    from refgrad.pipeline import HEAD_PARAM, StageModule, head_weight_init, stage_param_name

    spec = plan.case.spec
    named = {stage_param_name(s, n): p for s in range(spec.num_stages)
             for n, p in StageModule(spec, s).named_parameters()}
    named[stage_param_name(spec.num_stages - 1, HEAD_PARAM)] = head_weight_init(spec)
    return named


# --------------------------------------------------------------------------- broken fastgrad


def _accumulate_through_the_param_dtype() -> None:
    """Break fastgrad's DDP in this process only: before each add, the fp32 main grad is
    rounded to the (16-bit) grad's dtype, i.e. grads accumulate in the wrong dtype."""
    from fastgrad.ddp import DistributedDataParallel

    add = DistributedDataParallel._on_grad_accumulated

    def wrong(self, param):
        if param.grad is not None and param.main_grad.dtype != param.grad.dtype:
            param.main_grad.copy_(param.main_grad.to(param.grad.dtype))
        return add(self, param)

    DistributedDataParallel._on_grad_accumulated = wrong


def _faulty_worker(rank: int, world_size: int, phases: list) -> list:
    _accumulate_through_the_param_dtype()
    return twin_phases_worker(rank, world_size, phases)


@pytest.mark.dist
def test_grads_accumulated_in_the_param_dtype_fail_naming_step_and_parameter():
    plans = _plans({"bf16": (BF16, 0)})
    ranks = run_distributed(_faulty_worker, 4, _phases(plans), timeout_s=300)
    report, _, passed, _ = _finish(plans, ranks, TwinCandidate("bf16-accumulating DDP"))["bf16"]
    assert not passed and report["verdict"].startswith("FAIL: ")
    failures = report["twin"]["failures"]
    assert any(f.startswith("step 0: reduced gradient stage0.layers.0.weight (replica 0) differs")
               for f in failures), failures[:3]

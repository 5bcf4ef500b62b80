"""``verify preflight``'s AdamW twin: clipping, loss scaling, overlapped param all-gather.

The optimizer flags are parsed and validated as Megatron does (defaults from
megatron/training/arguments.py). Multi-rank twins run in one spawned world
(grids side by side) and are compared with refgrad.optim through the CLI's own
code (:func:`finish_twin_report`). Deliberately broken optimizers (clipping
skipped, the wrong loss-scale inverse) are installed in the ranks' processes
only, and the twin must fail naming the step and the parameter.
"""

from __future__ import annotations

import pytest

from tests.verify.preflight_launch import parsed_launch, preflight_config
from tests.verify.twin_world import plan_layout, train_and_compare
from verify.preflight.cli import build_report
from verify.preflight.config import ConfigError
from verify.preflight.flags import FlagError, parse_megatron_flags
from verify.preflight.timing import CostInputs
from verify.preflight.twin import TwinOptions, plan_twin
from verify.preflight.twin_optim import AdamWTwin, adamw_twin_for
from verify.preflight.twin_precision import TwinPrecision
from verify.preflight.twin_worker import TwinCandidate, twin_phases_worker

MODEL = ["--micro-batch-size", "1", "--num-layers", "8", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
         "--padded-vocab-size", "128"]
STEPS = TwinOptions(hidden_size=8, layers=1, steps=3)

# PP2 DP2 M4, tied embedding, both overlaps, fp16 params and grads, dynamic scale from 2^10
# (the twin's fp16 grads overflow from 2^19 on: refgrad). The twin's global grad norm is
# 0.34-0.42 over its 3 steps (refgrad), so --clip-grad 0.3 clips every step.
CLIPPED_FP16 = ["--pipeline-model-parallel-size", "2", "--world-size", "4",
                "--global-batch-size", "8", "--use-distributed-optimizer", "--overlap-grad-reduce",
                "--overlap-param-gather", "--clip-grad", "0.3", "--fp16", "--initial-loss-scale", "1024"]
# PP2 DP1 M4, bf16 with a constant --loss-scale and clipping off.
CONSTANT_SCALE = ["--pipeline-model-parallel-size", "2", "--world-size", "2",
                  "--global-batch-size", "4", "--use-distributed-optimizer", "--bf16",
                  "--loss-scale", "1024", "--clip-grad", "0", "--untie-embeddings-and-output-weights"]
# PP1 DP2 M4, fp16: the dynamic scale doubles after every clean step (window 1).
GROWING_SCALE = ["--pipeline-model-parallel-size", "1", "--world-size", "2",
                 "--global-batch-size", "8", "--use-distributed-optimizer", "--fp16",
                 "--initial-loss-scale", "256", "--loss-scale-window", "1", "--overlap-grad-reduce",
                 "--overlap-param-gather"]

# PP2 VPP2 DP2 M4, interleaved: one AdamW over both model chunks, both overlaps, clipped
# (the global grad norm is 0.15-0.25 over its 3 steps (refgrad), so --clip-grad 0.1 clips).
INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
               "--world-size", "4", "--global-batch-size", "8", "--use-distributed-optimizer",
               "--overlap-grad-reduce", "--overlap-param-gather", "--clip-grad", "0.1"]

# PP2 DP2 M4 without --use-distributed-optimizer: all-reduced grads, ReplicatedOptimizer, tied
# embedding with the deferred output layer, clipped at 0.3 (the norm is 0.34-0.42).
REPLICATED = ["--pipeline-model-parallel-size", "2", "--world-size", "4",
              "--global-batch-size", "8", "--defer-embedding-wgrad-compute", "--overlap-grad-reduce",
              "--clip-grad", "0.3"]


def _config(flags: list[str]):
    parsed = parsed_launch(MODEL + flags)
    config = preflight_config(MODEL + flags)
    return config, build_report(config, parsed, CostInputs())


# --------------------------------------------------------------------------- flags


def test_optimizer_flags_default_to_megatrons_and_parse_as_numbers():
    config, _ = _config(["--world-size", "1"])
    # arguments.py: --clip-grad 1.0, --loss-scale None, --initial-loss-scale 2**32,
    # --min-loss-scale 1.0, --loss-scale-window 1000, --hysteresis 2.
    assert (config.clip_grad, config.loss_scale, config.initial_loss_scale) == (1.0, None, 2.0**32)
    assert (config.min_loss_scale, config.loss_scale_window, config.hysteresis) == (1.0, 1000, 2)
    config, _ = _config(["--world-size", "1", "--clip-grad=0.5", "--loss-scale", "64",
                         "--loss-scale-window", "500.0", "--hysteresis", "3", "--fp16"])
    assert (config.clip_grad, config.loss_scale, config.loss_scale_window, config.hysteresis) == (
        0.5, 64.0, 500, 3)
    # Megatron-LM's parse_args: --clip-grad is type=float.
    with pytest.raises(FlagError, match="argument --clip-grad: invalid float value: 'x'"):
        parse_megatron_flags(["--clip-grad", "x"])


@pytest.mark.parametrize("flags, message", [
    (["--clip-grad", "-1"], "--clip-grad must be a finite number >= 0"),
    (["--clip-grad", "inf"], "--clip-grad must be a finite number >= 0"),
    (["--loss-scale", "0"], "--loss-scale must be a finite number > 0"),
    (["--initial-loss-scale", "nan"], "--initial-loss-scale must be a finite number > 0"),
    (["--min-loss-scale", "8", "--initial-loss-scale", "4"],
     r"--min-loss-scale \(8\) must be <= --initial-loss-scale \(4\)"),
    (["--loss-scale-window", "1.5"], "--loss-scale-window must be a whole number"),
    (["--loss-scale-window", "0"], "--loss-scale-window must be a positive integer"),
    (["--hysteresis", "0"], "--hysteresis must be a positive integer"),
])
def test_bad_optimizer_flags_are_refused_naming_the_flag(flags, message):
    with pytest.raises(ConfigError, match=message):
        _config(["--world-size", "1"] + flags)


def test_which_grad_scaler_production_builds():
    # megatron/core/optimizer/__init__.py: a given --loss-scale is a ConstantGradScaler under
    # fp16, bf16 or the distributed optimizer; otherwise fp16 gets the dynamic one; else none.
    cases = [([], None), (["--fp16"], "dynamic"), (["--fp16", "--loss-scale", "8"], "constant"),
             (["--bf16", "--loss-scale", "8"], "constant"), (["--loss-scale", "8"], None),
             (["--loss-scale", "8", "--use-distributed-optimizer"], "constant"), (["--bf16"], None)]
    for flags, kind in cases:
        assert _config(["--world-size", "1"] + flags)[0].loss_scaling == kind, flags


def test_twin_settings_follow_the_configuration():
    twin, gaps = adamw_twin_for(_config(CLIPPED_FP16)[0])
    assert twin == AdamWTwin(max_grad_norm=0.3, loss_scale=1024, dynamic=True,
                             overlap_param_gather=True)
    assert len(gaps) == 1 and gaps[0].startswith("loss-scale backoff")  # fp32 grads never overflow
    # fp16 params: real fp16 grads, which may overflow: the backoff is reproduced.
    twin, gaps = adamw_twin_for(_config(CLIPPED_FP16)[0], TwinPrecision("fp16", "fp16"))
    assert twin.precision == TwinPrecision("fp16", "fp16") and twin.loss_scale == 1024 and gaps == []
    twin, _ = adamw_twin_for(_config(CONSTANT_SCALE)[0])
    assert twin.max_grad_norm is None and twin.loss_scale == 1024 and not twin.dynamic
    assert twin.scaler().min_scale == 1024  # a constant scale never backs off
    # A scale that is not a power of two would round when unscaled: listed, twin unscaled.
    twin, gaps = adamw_twin_for(_config(CONSTANT_SCALE + ["--loss-scale", "1000"])[0])
    assert twin.loss_scale is None and "not a power of two" in gaps[0]
    plan = plan_twin(_config(CLIPPED_FP16)[0], STEPS)
    assert plan.rank_optimizer is plan.adamw
    assert not any("clipping" in g or "param-gather" in g or "SGD" in g for g in plan.not_twinned)
    rows = {m[0]: m[1:] for m in plan.mapping}
    assert rows["gradient clipping"][0] == "global norm <= 0.3"
    assert rows["param all-gather"] == ("waited in forward pre-hooks",) * 2


# --------------------------------------------------------------------------- multi-rank


# name -> (flags, first rank, phase); two phases of an 8-rank world.
LAYOUT = {"clipped_fp16": (CLIPPED_FP16, 0, 0), "constant_scale": (CONSTANT_SCALE, 4, 0),
          "growing_scale": (GROWING_SCALE, 6, 0), "interleaved": (INTERLEAVED, 0, 1),
          "replicated": (REPLICATED, 4, 1)}


def _plans(layout: dict) -> dict:
    return plan_layout(layout, _config, STEPS)


@pytest.fixture(scope="module")
def twins():
    plans = _plans(LAYOUT)
    return train_and_compare(plans, 8)


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_adamw_twin_with_clipping_and_loss_scaling_matches_refgrad_bitwise(twins, name):
    report, plan, passed, _ = twins[name]
    assert passed, report["twin"]["failures"][:3]
    steps = report["twin"]["steps"]
    assert plan.bitwise and len(steps) == 3
    for s in steps:
        assert s["grads_bitwise"] == s["grads_total"] > 0
        assert s["params_bitwise"] == s["params_total"]
        assert s["state_bitwise"] == s["state_total"] == 3 * s["params_total"]
        assert s["grad_norm"] > 0


@pytest.mark.dist
def test_clipping_triggered_and_the_scale_followed_megatrons_scaler(twins):
    clipped = twins["clipped_fp16"][0]["twin"]["steps"]
    assert all(s["clipped"] and s["clip_coefficient"] < 1 for s in clipped)
    assert all(s["loss_scale"] == 1024 for s in clipped)
    constant = twins["constant_scale"][0]["twin"]["steps"]
    assert all(s["clip_coefficient"] is None and not s["clipped"] for s in constant)
    assert [s["loss_scale"] for s in constant] == [1024.0] * 3
    # VPP 2: one norm over both chunks (one optimizer), clipped every step at 0.1.
    inter = twins["interleaved"]
    assert inter[1].optimizer == "adamw" and inter[1].case.virtual_stages == 2
    assert all(s["clipped"] for s in inter[0]["twin"]["steps"])
    # No distributed optimizer: every rank steps every param over the all-reduced grads.
    replicated = twins["replicated"]
    assert not replicated[1].case.use_distributed_optimizer and replicated[1].optimizer == "adamw"
    assert "ReplicatedOptimizer" in dict((m[0], m[2]) for m in replicated[1].mapping)["optimizer"]
    assert all(s["clipped"] for s in replicated[0]["twin"]["steps"])
    assert not any("SGD" in g for name in twins for g in twins[name][1].not_twinned)
    # window 1: x2 after each clean step, from 256.
    assert [s["loss_scale"] for s in twins["growing_scale"][0]["twin"]["steps"]] == [256.0, 512.0, 1024.0]


@pytest.mark.dist
def test_overlapped_param_gather_is_waited_in_the_forward_pre_hooks(twins):
    for name in ("clipped_fp16", "growing_scale", "interleaved"):
        results = [r for r in twins[name][3] if r is not None]
        # steps 1 and 2: the gather launched by the previous step, finished by the forward
        assert all(r.gathers_waited_in_hooks == [(True, True)] * 2 for r in results), name
    for name in ("constant_scale", "replicated"):  # DP 1; no param all-gather
        assert all(r.gathers_waited_in_hooks == [] for r in twins[name][3] if r is not None)


# --------------------------------------------------------------------------- broken optimizers


def _install_fault(fault: str) -> None:
    """Break fastgrad's DistributedOptimizer in this process only."""
    from fastgrad.optim.distributed import DistributedOptimizer

    if fault == "skip_clip":
        step = DistributedOptimizer.step

        def unclipped(self):
            self.max_grad_norm = None
            return step(self)

        DistributedOptimizer.step = unclipped
    elif fault == "double_unscale":
        from fastgrad.optim.step_paths import FusedCpuPath, TorchOpsPath

        for path in (FusedCpuPath, TorchOpsPath):  # whichever this rank's optimizer takes
            def wrong_inverse(self, configs, steps, inv_scale, clip, update=path.update):
                return update(self, configs, steps, None if inv_scale is None else inv_scale * 2, clip)

            def wrong_norm(self, inv_scale, local_norm=path.local_norm):
                return local_norm(self, None if inv_scale is None else inv_scale * 2)

            path.update, path.local_norm = wrong_inverse, wrong_norm


def _faulty_worker(rank: int, world_size: int, phases: list, faults: dict) -> list:
    for (lo, hi), fault in faults.items():
        if lo <= rank < hi:
            _install_fault(fault)
    return twin_phases_worker(rank, world_size, phases)


@pytest.mark.dist
def test_a_skipped_clip_or_a_wrong_loss_scale_inverse_fails_naming_step_and_parameter():
    plans = _plans({"skip_clip": (CLIPPED_FP16, 0), "double_unscale": (GROWING_SCALE, 4)})
    out = train_and_compare(plans, 6, TwinCandidate("broken optimizer"), _faulty_worker,
                            {(0, 4): "skip_clip", (4, 6): "double_unscale"})
    for name in plans:
        report, _, passed, _ = out[name]
        assert not passed and report["verdict"].startswith("FAIL"), name
    skip = out["skip_clip"][0]["twin"]["failures"]
    # AdamW's first update is sign(g) x lr (nearly): the unclipped grads show in the moments
    # (the fp16 params may round the masters' small difference away).
    assert any(f.startswith("step 0: optimizer exp_avg of stage0.") for f in skip)
    assert any("step 0: optimizer on stage 0 (replica 0): not clipped" in f for f in skip)
    wrong = out["double_unscale"][0]["twin"]["failures"]
    assert any(f.startswith("step 0: optimizer exp_avg of stage0.") for f in wrong)
    assert any("step 0: optimizer on stage 0 (replica 0): global grad norm" in f for f in wrong)

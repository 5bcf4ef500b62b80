"""``verify preflight``'s AdamW twin: clipping, loss scaling, overlapped param all-gather.

The optimizer flags are parsed and validated as Megatron does (defaults from
megatron/training/arguments.py). Multi-rank twins run in one spawned world
(grids side by side) and are compared with refgrad.optim through the CLI's own
code (:func:`finish_twin_report`). Deliberately broken optimizers (clipping
skipped, the wrong loss-scale inverse) are fastgrad candidates whose optimizer adapter
builds a broken subclass of fastgrad's ``DistributedOptimizer`` (through the same seam as
production), and the twin must fail naming the step and the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fastgrad.optim import DistributedOptimizer
from tests.verify.broken_optimizers import IgnoresSchedulerChanges
from tests.verify.preflight_launch import parsed_launch, preflight_config
from tests.verify.twin_world import plan_layout, train_and_compare
from verify.candidates import FastgradCandidate
from verify.candidates.fastgrad.optimizer import FastgradOptimizer
from verify.preflight.cli import build_report
from verify.preflight.config import ConfigError
from verify.preflight.flags import FlagError, parse_megatron_flags
from verify.preflight.timing import CostInputs
from verify.preflight.twin import AdamWTwin, TwinOptions, TwinPrecision, plan_twin
from verify.preflight.twin.adamw import adamw_twin_for

MODEL = ["--micro-batch-size", "1", "--num-layers", "8", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
         "--padded-vocab-size", "128"]
STEPS = TwinOptions(hidden_size=8, layers=1, steps=3)

# PP2 DP2 M4, tied embedding, both overlaps, fp16 params and grads, dynamic scale from 2^10
# (the twin's fp16 grads overflow from 2^19 on: refgrad): two updates, then step 2's deliberate
# loss spike (skipped). The twin's global grad norm is 0.34 over its two updates (refgrad), so
# --clip-grad 0.3 clips both.
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
    assert twin.loss_scaling.min_scale == 1024 and not twin.loss_scaling.dynamic  # never backs off
    # A scale that is not a power of two would round when unscaled: listed, twin unscaled.
    twin, gaps = adamw_twin_for(_config(CONSTANT_SCALE + ["--loss-scale", "1000"])[0])
    assert twin.loss_scale is None and "not a power of two" in gaps[0]
    plan = plan_twin(_config(CLIPPED_FP16)[0], STEPS)
    # the ranks step the AdamW settings of the configuration at its precision (fp16)
    assert plan.training == adamw_twin_for(_config(CLIPPED_FP16)[0], TwinPrecision("fp16", "fp16"))[0]
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
        assert s["grad_norm"] > 0 or not s["stepped"]  # an fp16 twin's loss spike: NaN, skipped


@pytest.mark.dist
def test_clipping_triggered_and_the_scale_followed_megatrons_scaler(twins):
    clipped = twins["clipped_fp16"][0]["twin"]["steps"]
    # fp16: two updates, then the deliberate loss spike (skipped, so nothing to clip)
    assert [s["stepped"] for s in clipped] == [True, True, False]
    assert all(s["clipped"] and s["clip_coefficient"] < 1 for s in clipped[:2])
    assert all(s["loss_scale"] == 1024 for s in clipped)
    constant = twins["constant_scale"][0]["twin"]["steps"]
    assert all(s["clip_coefficient"] is None and not s["clipped"] for s in constant)
    assert [s["loss_scale"] for s in constant] == [1024.0] * 3
    # VPP 2: one norm over both chunks (one optimizer), clipped every step at 0.1.
    inter = twins["interleaved"]
    assert isinstance(inter[1].training, AdamWTwin) and inter[1].case.virtual_stages == 2
    assert all(s["clipped"] for s in inter[0]["twin"]["steps"])
    # No distributed optimizer: every rank steps every param over the all-reduced grads.
    replicated = twins["replicated"]
    assert not replicated[1].case.use_distributed_optimizer
    assert isinstance(replicated[1].training, AdamWTwin)
    assert "replicated optimizer" in dict((m[0], m[2]) for m in replicated[1].mapping)["optimizer"]
    assert all(s["clipped"] for s in replicated[0]["twin"]["steps"])
    assert not any("SGD" in g for name in twins for g in twins[name][1].not_twinned)
    # window 1: x2 after each clean step, from 256.
    assert [s["loss_scale"] for s in twins["growing_scale"][0]["twin"]["steps"]] == [256.0, 512.0, 1024.0]


@pytest.mark.dist
def test_overlapped_param_gather_is_waited_in_the_forward_pre_hooks(twins):
    for name in ("clipped_fp16", "growing_scale", "interleaved"):
        results = [r for r in twins[name][3] if r is not None]
        # steps 1 and 2: the gather launched by the previous step, finished by the forward
        assert all(r.optimizer.gathers_waited_in_hooks == [(True, True)] * 2 for r in results), name
    for name in ("constant_scale", "replicated"):  # DP 1; no param all-gather
        assert all(r.optimizer.gathers_waited_in_hooks == [] for r in twins[name][3] if r is not None)


# --------------------------------------------------------------------------- broken optimizers


class _UnclippedOptimizer(DistributedOptimizer):
    """fastgrad's DistributedOptimizer with its clip dropped at every step."""

    def step(self, closure=None):
        self.max_grad_norm = None
        return super().step(closure)


class _DoubledInverse:
    """A step path (fused CPU kernels or torch ops) unscaling by 2/S instead of 1/S, in the
    update and in the norm."""

    def __init__(self, path) -> None:
        self._path = path

    def update(self, configs, steps, inv_scale, clip):
        return self._path.update(configs, steps, None if inv_scale is None else inv_scale * 2, clip)

    def local_norm(self, inv_scale):
        return self._path.local_norm(None if inv_scale is None else inv_scale * 2)

    def __getattr__(self, name):
        return getattr(self._path, name)


class _WrongInverseOptimizer(DistributedOptimizer):
    """fastgrad's DistributedOptimizer over a path with the wrong loss-scale inverse."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.path = _DoubledInverse(self.path)


@dataclass(frozen=True)
class _BrokenOptimizer(FastgradOptimizer):
    broken: type[DistributedOptimizer] = _UnclippedOptimizer

    def optimizer_class(self, stages):
        return self.broken


@dataclass(frozen=True)
class _BrokenOptimizerCandidate(FastgradCandidate):
    """fastgrad whose optimizer is ``broken`` (a subclass of its DistributedOptimizer)."""

    name = "fastgrad (broken optimizer)"
    broken: type[DistributedOptimizer] = _UnclippedOptimizer

    def optimizer(self):
        return _BrokenOptimizer(self.broken)


@pytest.mark.dist
def test_a_skipped_clip_or_a_wrong_loss_scale_inverse_fails_naming_step_and_parameter():
    out = {}
    for name, flags, broken in (("skip_clip", CLIPPED_FP16, _UnclippedOptimizer),
                                ("double_unscale", GROWING_SCALE, _WrongInverseOptimizer)):
        out |= train_and_compare(_plans({name: (flags, 0)}), 4 if name == "skip_clip" else 2,
                                 _BrokenOptimizerCandidate(broken=broken))
    for name in out:
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


@pytest.mark.dist
def test_an_optimizer_that_ignores_the_schedules_changes_fails_from_the_second_update():
    """The twin's lr and weight decay change at every update (``TWIN_SCHEDULE``): an optimizer
    that keeps its first step's values matches refgrad at step 0 and fails from step 1 on."""
    out = train_and_compare(_plans({"ignores_schedule": (CONSTANT_SCALE, 0)}), 2,
                            _BrokenOptimizerCandidate(broken=IgnoresSchedulerChanges))
    report, _, passed, _ = out["ignores_schedule"]
    assert not passed and report["verdict"].startswith("FAIL"), report["verdict"]
    failures = report["twin"]["failures"]
    assert any(f.startswith("step 1: optimizer master of stage0.") for f in failures), failures[:5]
    assert any(f.startswith("step 2: updated parameter ") for f in failures), failures[:5]
    assert not any(f.startswith("step 0:") for f in failures), failures[:5]

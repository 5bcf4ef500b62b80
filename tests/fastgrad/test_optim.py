"""fastgrad.optim on one process (DP=1): bitwise equal to refgrad.optim, and its input rules.

The model, the rank-specific grads and the refgrad trajectory live in
``verify.checks.optim`` (the ``optim`` check uses them too); the multi-rank tests
in test_optim_dist.py import them from there or from here.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from fastgrad.ddp import DistributedDataParallel
from fastgrad.optim import (
    AdamWConfig,
    DistributedOptimizer,
    DynamicLossScaler,
    SGDConfig,
    param_groups_without_decay_for,
)
from fastgrad.optim.norm import limbs_to_fraction, local_square_limbs
from fastgrad.optim.step_paths import TorchOpsPath
from fastgrad.optim.update import adamw_scalars
from gradvocab import Averaging, DDPConfig, LifecycleError, LossScaling
from refgrad import optim as R
from tests.fastgrad.optim_model import build, snapshot, train_step  # noqa: F401 - re-exported
from verify.checks.optim.cases import (  # noqa: F401 - re-exported for test_optim_dist
    FP16,
    FP32,
    INF_AT,
    MIXED,
    NAMES,
    SHARED,
    TIED,
    Model,
    bits,
    coefficient,
)
from verify.checks.optim.expectations import reduced_grads, reference_trajectory  # noqa: F401
from verify.metrics import assert_bitwise_equal


def assert_matches(got: dict, want: dict, where: str) -> None:
    """Bitwise: params, masters, and every optimizer state tensor refgrad has."""
    for n in NAMES:
        assert_bitwise_equal(bits(got["params"][n]), bits(want["params"][n]), msg=f"{where}: param {n}")
        for key, tensor in want["state"][n].items():
            mine = got["state"]["params"][n][key]
            assert_bitwise_equal(bits(mine), bits(tensor), msg=f"{where}: {key} of {n}")


# --------------------------------------------------------------------------- DP=1 tests



@pytest.mark.parametrize(
    ("algorithm", "dtypes", "clip"),
    [("adamw", FP32, 0.5), ("adamw", MIXED, None), ("sgd", FP32, None), ("sgd", MIXED, 0.5)],
    ids=["adamw-fp32-clip", "adamw-bf16+fp32", "sgd-fp32", "sgd-bf16+fp32-clip"],
)
def test_dp1_bitwise_equal_to_refgrad(algorithm, dtypes, clip):
    model, ddp, opt = build(dtypes, algorithm, clip=clip)
    want, _ = reference_trajectory([1, 1, 1], dtypes, algorithm, clip=clip)
    for step in range(3):
        result = train_step(model, ddp, opt, 0, step)
        assert result.stepped and math.isfinite(result.grad_norm)
        if clip is not None:
            assert result.clip_coefficient < 1  # the grads here have norm > 0.5
        assert_matches(snapshot(model, opt), want[step], f"step {step}")


def test_dp1_grad_norm_is_refgrads_exact_norm():
    model, ddp, opt = build(MIXED, "adamw")
    result = train_step(model, ddp, opt, 0, 0)
    grads = [R.values(g) for g in reduced_grads(1, 0, MIXED, averaging=Averaging.PRESCALE)]
    counted = [g for g, shared in zip(grads, SHARED) if not shared]  # the tied copy: once
    assert result.grad_norm == float(R.global_norm(counted))


def _without_nonfinite_check(opt: DistributedOptimizer, torch_ops: bool) -> DistributedOptimizer:
    opt.check_nonfinite = False
    if torch_ops:
        opt.path = TorchOpsPath(opt.shards)
    return opt


@pytest.mark.parametrize("torch_ops", [False, True], ids=["fused", "torch-ops"])
def test_without_nonfinite_check_the_update_is_refgrads_and_takes_no_norm(torch_ops, monkeypatch):
    # Megatron-Core without clipping or loss scaling takes no norm: the same update bits.
    model, ddp, opt = build(MIXED, "adamw")
    _without_nonfinite_check(opt, torch_ops)
    monkeypatch.setattr(opt.path, "local_norm", lambda *_: pytest.fail("a norm was taken"))
    want, _ = reference_trajectory([1, 1], MIXED, "adamw")
    for step in range(2):
        result = train_step(model, ddp, opt, 0, step)
        assert result.stepped and result.grad_norm is None
        assert_matches(snapshot(model, opt), want[step], f"step {step}")


@pytest.mark.parametrize("torch_ops", [False, True], ids=["fused", "torch-ops"])
def test_without_nonfinite_check_an_inf_grad_reaches_the_masters(torch_ops):
    # The documented cost of check_nonfinite=False; the default skips that step.
    checked = build(FP32, "sgd")
    model, ddp, opt = build(FP32, "sgd")
    _without_nonfinite_check(opt, torch_ops)
    assert not train_step(*checked, 1, 1, inf_at=INF_AT).stepped
    assert train_step(model, ddp, opt, 1, 1, inf_at=INF_AT).stepped
    masters = opt.named_state_dict()["params"]
    assert not all(bool(torch.isfinite(masters[n]["master"]).all()) for n in NAMES)


def test_without_nonfinite_check_clipping_still_takes_the_norm_and_skips_inf():
    model, ddp, opt = build(FP32, "sgd", clip=0.5)
    opt.check_nonfinite = False
    result = train_step(model, ddp, opt, 1, 1, inf_at=INF_AT)
    assert not result.stepped and "NaN/inf" in result.reason


def test_checkpoint_round_trip_and_resume_dp1():
    model, ddp, opt = build(MIXED, "sgd")
    for step in range(2):
        train_step(model, ddp, opt, 0, step)
    state = opt.named_state_dict()
    model2, ddp2, opt2 = build(MIXED, "sgd")
    opt2.load_state_dict(state)
    for n, p in model2.named_parameters():
        assert_bitwise_equal(bits(p.detach()), bits(state["params"][n]["master"].to(p.dtype)))
    train_step(model, ddp, opt, 0, 2)
    train_step(model2, ddp2, opt2, 0, 2)
    assert_matches(snapshot(model2, opt2), {"params": dict(model.named_parameters()),
                                            "state": opt.named_state_dict()["params"]}, "resume")


# --------------------------------------------------------------------------- input rules


def test_param_group_mixing_buffers_is_refused():
    model, ddp, _ = build(MIXED, "adamw")
    with pytest.raises(ValueError, match="mixes buffers"):
        DistributedOptimizer(ddp, AdamWConfig(lr=0.1), [{"params": list(model.parameters())}])


def test_param_in_no_group_or_two_groups_is_refused():
    model, ddp, _ = build(FP32, "adamw")
    params = list(model.parameters())
    with pytest.raises(ValueError, match="in no param group"):
        DistributedOptimizer(ddp, AdamWConfig(lr=0.1), [{"params": params[:2]}])
    with pytest.raises(ValueError, match="belongs to one group"):
        DistributedOptimizer(ddp, AdamWConfig(lr=0.1), [{"params": params}, {"params": params[:1]}])


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_non_positive_max_norm_is_refused(bad):
    _, ddp, _ = build(FP32, "adamw")
    with pytest.raises(ValueError, match="max_grad_norm must be finite and > 0"):
        DistributedOptimizer(ddp, AdamWConfig(lr=0.1), max_grad_norm=bad)


def test_bad_hyper_parameters_are_refused():
    with pytest.raises(ValueError, match="AdamWConfig.beta1"):
        AdamWConfig(lr=0.1, beta1=1.0)
    with pytest.raises(ValueError, match="SGDConfig.lr"):
        SGDConfig(lr=-1.0)  # lr 0 is allowed, as torch's (a warmup starts there)
    with pytest.raises(ValueError, match="LossScaling.initial_scale must be a power of two"):
        LossScaling(initial_scale=3.0)
    with pytest.raises(TypeError, match="DynamicLossScaler.settings must be a gradvocab.LossScaling"):
        DynamicLossScaler(2.0**16)  # the old first parameter, initial_scale


def test_checkpoint_name_or_shape_mismatch_is_refused():
    model, ddp, opt = build(FP32, "adamw")
    train_step(model, ddp, opt, 0, 0)
    state = opt.named_state_dict()
    renamed = {**state, "params": {("x" + k if k == "layer.bias" else k): v for k, v in state["params"].items()}}
    with pytest.raises(ValueError, match="names do not match"):
        opt.load_state_dict(renamed)
    reshaped = {**state, "params": {**state["params"], "layer.bias": {
        k: v.reshape(1, -1) for k, v in state["params"]["layer.bias"].items()}}}
    with pytest.raises(ValueError, match="has shape"):
        opt.load_state_dict(reshaped)
    _, _, sgd = build(FP32, "sgd")
    with pytest.raises(ValueError, match="holds AdamWConfig state"):
        sgd.load_state_dict(state)


def test_step_before_grad_sync_is_refused():
    model, ddp, opt = build(FP32, "adamw")
    with pytest.raises(LifecycleError, match="before the grad sync"):
        opt.step()
    train_step(model, ddp, opt, 0, 0)
    with pytest.raises(LifecycleError, match="before the grad sync"):
        opt.step()  # the same reduced grads must not be applied twice


def test_fp16_needs_a_loss_scaler_and_bf16_refuses_one():
    with pytest.raises(ValueError, match="fp16 grads need a loss_scaler"):
        build(dict.fromkeys(NAMES, torch.float16), "adamw")
    with pytest.raises(ValueError, match="only for fp16"):
        build(MIXED, "adamw", scaler=DynamicLossScaler())


def test_fp32_grads_take_a_loss_scale_and_unscale_it_exactly():
    """Megatron's --loss-scale (or fp16 params with fp32 main grads): a scaled fp32 backward."""
    scaler = DynamicLossScaler(LossScaling(initial_scale=2.0**10, growth_interval=2))
    model, ddp, opt = build(FP32, "adamw", clip=0.5, scaler=scaler)
    scales = [2.0**10, 2.0**10, 2.0**11]  # x2 after 2 clean steps
    want, _ = reference_trajectory([1, 1, 1], FP32, "adamw", clip=0.5, scales=scales)
    for step, scale in enumerate(scales):
        assert opt.loss_scaler.scale == scale
        result = train_step(model, ddp, opt, 0, step, loss_scale=scale)
        assert result.stepped and result.loss_scale == scale and result.clip_coefficient < 1
        assert_matches(snapshot(model, opt), want[step], f"step {step}")


def test_dynamic_loss_scaler_by_hand():
    s = DynamicLossScaler(LossScaling(initial_scale=8.0, min_scale=2.0, growth_interval=2, hysteresis=2))
    s.update(True)
    assert s.scale == 8.0 and s.hysteresis_tracker == 1  # hysteresis absorbs the first inf
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    s.update(True)
    assert s.scale == 2.0  # floor at min_scale
    s.update(False)
    s.update(False)
    assert s.scale == 4.0 and s.hysteresis_tracker == 2  # two clean steps: grow, hysteresis restored


def test_wrong_ddp_config_is_refused():
    model = Model(FP32)
    ddp = DistributedDataParallel(model, config=DDPConfig())
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        DistributedOptimizer(ddp, AdamWConfig(lr=0.1))


# --------------------------------------------------------------------------- exact norm, groups


def test_square_limbs_are_exact_and_partition_independent():
    torch.manual_seed(0)
    x = torch.randn(5000) * torch.logspace(-30, 30, 5000)
    x[:4] = torch.tensor([1e-45, -3e38, 2.0**-149, 0.0])  # subnormal, near max, tiny, zero
    exact = sum((Fraction(v) ** 2 for v in x.tolist()), Fraction(0))
    whole, _ = local_square_limbs([x])
    assert limbs_to_fraction(whole) == exact
    for cuts in ([1, 77, 4000], [2500], [13, 14, 15, 4999]):
        parts = torch.tensor_split(x, cuts)
        per_rank = [local_square_limbs([p])[0] for p in parts]
        summed = [sum(limbs) for limbs in zip(*per_rank)]  # what all_reduce(SUM) computes
        assert limbs_to_fraction(summed) == exact


def test_square_limbs_count_nonfinite():
    _, nonfinite = local_square_limbs([torch.tensor([1.0, math.inf, -math.nan, 2.0])])
    assert nonfinite == 2


def test_groups_without_decay_split_by_buffer_group_and_by_rule():
    model, ddp, opt = build(MIXED, "adamw")
    groups = param_groups_without_decay_for(ddp)
    names = [sorted(ddp.name_of(p) for p in g["params"]) for g in groups]
    assert names == [["embed.weight", "head.weight"], ["norm.weight"], ["layer.weight"], ["layer.bias"]]
    assert [g.get("weight_decay") for g in groups] == [None, 0.0, None, 0.0]
    assert [c.weight_decay for c in opt.groups] == [0.1, 0.0, 0.1, 0.0]


def test_check_nonfinite_must_be_a_bool():
    _, ddp, _ = build(FP32, "adamw")
    with pytest.raises(TypeError, match="check_nonfinite must be a bool"):
        DistributedOptimizer(ddp, AdamWConfig(lr=0.1), check_nonfinite="no")


@pytest.mark.parametrize("step", [1, 63, 64, 65, 1000, 3001])
def test_adamw_bias_corrections_are_refgrads_at_any_step(step):
    """The running fp32 products beta^t (numba from 64 steps on) round as refgrad's, at every
    length: a scheduler moving the betas every step (OneCycleLR) restarts them at step 1."""
    for beta1, beta2 in ((0.9, 0.999), (0.85, 0.95), (0.5, 0.99999)):
        mine = adamw_scalars(AdamWConfig(lr=0.1, beta1=beta1, beta2=beta2), step)
        spec = R.adamw_scalars(R.AdamW(lr=0.1, beta1=beta1, beta2=beta2), step)
        assert (Fraction(mine["bc1"]), Fraction(mine["bc2"])) == (spec["bc1"], spec["bc2"]), (beta1, beta2)
        # the powers themselves (a bias correction near 1 would hide a last-bit error in them)
        b1, b2 = R.r32(beta1), R.r32(beta2)
        p1, p2 = b1, b2
        for _ in range(step - 1):
            p1, p2 = R.r32(p1 * b1), R.r32(p2 * b2)
        assert (Fraction(mine["beta1_power"]), Fraction(mine["beta2_power"])) == (p1, p2), (beta1, beta2)


def test_reference_grads_take_an_averaging_not_a_bool():
    """The optim check's reference reduction says how it averages with an ``Averaging``: a
    bool (the old ``average=``) is a TypeError, and an averaging it does not model (AVG in the
    collective) a ValueError naming it, rather than a silent sum."""
    with pytest.raises(TypeError, match="averaging must be an Averaging"):
        reduced_grads(2, 0, MIXED, averaging=True)
    with pytest.raises(ValueError, match="averaging AVG is not modelled"):
        reduced_grads(2, 0, MIXED, averaging=Averaging.AVG)
    # DP 2: the pre-scale halves every reduced grad exactly (power of two)
    summed = reduced_grads(2, 0, MIXED, averaging=Averaging.SUM)
    halved = reduced_grads(2, 0, MIXED, averaging=Averaging.PRESCALE)
    for s, h in zip(summed, halved):
        assert torch.equal(h, s / 2)

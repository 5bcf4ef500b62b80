"""refgrad.optim against values derived by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from refgrad import formats
from refgrad import optim as R


def step_one(p, g, hyper, step=1, state=None, **kw):
    state = state or R.ParamState(master=[Fraction(p)])
    stepped, norm = R.optimizer_step([state], [torch.tensor([g], dtype=torch.float32)], [hyper], [step], **kw)
    return state, stepped, norm


def test_sgd_momentum_two_steps_by_hand():
    h = R.SGD(lr=0.5, momentum=0.5)
    # step 1: buf = g = 1; p = 1 - 0.5*1 = 0.5
    state, stepped, _ = step_one(1.0, 1.0, h)
    assert stepped and state.master == [Fraction(1, 2)] and state.momentum == [Fraction(1)]
    # step 2: buf = 0.5*1 + 1 = 1.5; p = 0.5 - 0.5*1.5 = -0.25
    state, _, _ = step_one(None, 1.0, h, step=2, state=state)
    assert state.momentum == [Fraction(3, 2)] and state.master == [Fraction(-1, 4)]


def test_sgd_weight_decay_is_coupled_by_hand():
    # g' = 1 + 0.25*1 = 1.25; buf = 1.25; p = 1 - 0.5*1.25 = 0.375
    state, _, _ = step_one(1.0, 1.0, R.SGD(lr=0.5, momentum=0.5, weight_decay=0.25))
    assert state.master == [Fraction(3, 8)] and state.momentum == [Fraction(5, 4)]


ADAM = {"lr": 0.5, "beta1": 0.5, "beta2": 0.75, "eps": 0.5}


def test_adamw_first_step_by_hand_rounds_a_tie_to_even():
    # m = 0.5*0 + 0.5*2 = 1; v = 0.75*0 + 0.25*(2*2) = 1; bc1 = 1 - 0.5 = 0.5; bc2 = 1 - 0.75 = 0.25
    # m_hat = 2; v_hat = 4; denom = sqrt(4) + 0.5 = 2.5
    # u = r32(2 / 2.5) = r32(0.8) = 13421773 * 2^-24
    # lr*u = 13421773 * 2^-25 (exact)
    # p = 1 - 13421773 * 2^-25 = 20132659 * 2^-25: 25 bits, odd -> a tie between
    #     10066329 * 2^-24 and 10066330 * 2^-24; ties to even -> 10066330 * 2^-24
    state, _, _ = step_one(1.0, 2.0, R.AdamW(**ADAM))
    assert state.exp_avg == [Fraction(1)] and state.exp_avg_sq == [Fraction(1)]
    assert state.master == [Fraction(10066330, 2**24)]


def test_adamw_decoupled_weight_decay_and_its_skipping_by_hand():
    # decay = 1 - 0.5*0.5 = 0.75: p = 0.75, then p = 0.75 - 13421773 * 2^-25
    #   = (25165824 - 13421773) * 2^-25 = 11744051 * 2^-25 (24 bits: exact)
    decayed, _, _ = step_one(1.0, 2.0, R.AdamW(**ADAM, weight_decay=0.5))
    assert decayed.master == [Fraction(11744051, 2**25)]
    # A no-decay group (weight_decay 0, e.g. a bias or a norm weight) gets the plain step.
    plain, _, _ = step_one(1.0, 2.0, R.AdamW(**ADAM, weight_decay=0.0))
    assert plain.master == [Fraction(10066330, 2**24)]


def test_adamw_scalars_are_running_fp32_products():
    s = R.adamw_scalars(R.AdamW(lr=0.5, beta1=0.5, beta2=0.75), 3)
    # beta1^3 = 1/8, beta2^3 = 27/64 (exact in fp32): bc1 = 7/8, bc2 = 37/64
    assert s["bc1"] == Fraction(7, 8) and s["bc2"] == Fraction(37, 64)


def test_clip_coefficient_by_hand():
    grads = [[Fraction(3), Fraction(4)]]
    assert R.global_norm(grads) == 5  # sqrt(9 + 16), exact
    # fp64 arithmetic by definition: max_norm / (norm + 1e-6), each op rounded once
    assert R.clip_coefficient(Fraction(5), 1.0) == Fraction(1.0 / (5.0 + 1e-6))
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        R.clip_coefficient(Fraction(5), 0.0)


def test_clipping_scales_grads_only_when_the_coefficient_is_below_one():
    h = R.SGD(lr=1.0)
    grads = [torch.tensor([3.0, 4.0])]
    state = R.ParamState(master=[Fraction(0), Fraction(0)])
    stepped, norm = R.optimizer_step([state], grads, [h], [1], max_norm=10.0)
    assert norm == 5 and state.master == [-3, -4]  # coefficient ~2 >= 1: no clipping
    state = R.ParamState(master=[Fraction(0), Fraction(0)])
    R.optimizer_step([state], grads, [h], [1], max_norm=1.0)
    c32 = R.r32(Fraction(1.0 / (5.0 + 1e-6)))
    assert state.master == [-R.r32(3 * c32), -R.r32(4 * c32)]


def test_norm_leaves_out_shared_params_and_nonfinite_skips():
    state = [R.ParamState(master=[Fraction(0)]), R.ParamState(master=[Fraction(0)])]
    grads = [torch.tensor([3.0]), torch.tensor([4.0])]
    _, norm = R.optimizer_step(state, grads, [R.SGD(lr=1.0)] * 2, [1, 1], shared=[False, True])
    assert norm == 3
    stepped, norm = R.optimizer_step(state, [torch.tensor([math.inf]), grads[1]], [R.SGD(lr=1.0)] * 2, [1, 1])
    assert not stepped and norm is None and state[0].master == [-3]


def test_loss_scale_unscales_before_everything():
    # g = 8 / 4 = 2; SGD lr 0.5: p = 1 - 1 = 0
    state, _, norm = step_one(1.0, 8.0, R.SGD(lr=0.5), loss_scale=4.0)
    assert norm == 2 and state.master == [0]


def test_sqrt_rounded_matches_correctly_rounded_fp64_sqrt():
    rng = random.Random(0)
    for _ in range(300):
        x = rng.uniform(0, 2.0) * 2.0 ** rng.randint(-300, 300)
        assert R.sqrt_rounded(R.FLOAT64, Fraction(x)) == Fraction(math.sqrt(x))
    assert R.sqrt_rounded(formats.FLOAT32, Fraction(9, 4)) == Fraction(3, 2)


def test_ulp_distance_by_hand():
    one = torch.tensor([1.0])
    assert R.ulp_distance_fp32(one, torch.nextafter(one, torch.tensor([2.0]))) == 1
    assert R.ulp_distance_fp32(torch.tensor([0.0]), torch.tensor([-0.0])) == 0
    tiny = torch.tensor([1e-45])  # smallest subnormal: one ulp on each side of zero
    assert R.ulp_distance_fp32(tiny, -tiny) == 2


def test_torch_adamw_distance_is_measured():
    torch.manual_seed(0)
    p = torch.randn(16)
    grads = [torch.randn(16) for _ in range(3)]
    distance = R.torch_adamw_ulp_distance(p, grads, R.AdamW(lr=1e-3, weight_decay=0.1))
    assert 0 <= distance < 1 << 20  # different operation order: small, not necessarily 0

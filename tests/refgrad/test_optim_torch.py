"""refgrad.optim_torch (AdamW in torch.optim.AdamW's CPU order) against hand-derived values and
against torch.optim.AdamW itself on this CPU."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from refgrad import optim as R
from refgrad.optim_torch import (
    torch_adamw_element,
    torch_adamw_scalars,
    torch_clip_coefficient,
    torch_order_step,
    torch_sgd_element,
    torch_sgd_scalars,
)
from verify.metrics import assert_bitwise_equal, bitwise_equal

U = Fraction(1, 2**23)  # one fp32 ulp in [1, 2)


def torch_cpu_sqrt(v: Fraction) -> Fraction:
    return Fraction(float(torch.tensor(float(v), dtype=torch.float32).sqrt()))


def test_lerp_is_one_fused_rounding_by_hand():
    # beta1 = 0.75: w = 0.25 (< 0.5, so m + w*(g - m)); m = 1 + u, g = 1.5 + 2u.
    # torch: g - m = 0.5 + u; w*(g - m) = 0.125 + u/4; m + that = 1.125 + 1.25u, rounded once
    #   -> 1.125 + u.
    # refgrad.optim: r32(0.75*(1 + u)) = r32(0.75 + 0.75u): a tie between 0.75 + u/2 (odd) and
    #   0.75 + u (even) -> 0.75 + u; r32(0.25*g) = 0.375 + u/2 (exact); the sum 1.125 + 1.5u is a
    #   tie between 1.125 + u (odd) and 1.125 + 2u (even) -> 1.125 + 2u.
    h = R.AdamW(lr=0.5, beta1=0.75, beta2=0.5, eps=0.5)
    g, m = Fraction(3, 2) + 2 * U, 1 + U
    _, m_torch, _ = torch_adamw_element(Fraction(0), g, m, Fraction(0), torch_adamw_scalars(h, 1))
    _, m_ref, _ = R.adamw_element(Fraction(0), g, m, Fraction(0), R.adamw_scalars(h, 1))
    assert m_torch == Fraction(9, 8) + U
    assert m_ref == Fraction(9, 8) + 2 * U
    got = torch.tensor([float(m)]).lerp_(torch.tensor([float(g)]), 1 - 0.75)
    assert Fraction(float(got)) == m_torch  # this CPU's lerp is the fused one


def test_lerp_large_weight_branch_by_hand():
    # beta1 = 0.5: w = 0.5 (not < 0.5): g + (w - 1)*(g - m) = g - 0.5*(3u) with m = 1, g = 1 + 3u:
    # 1 + 1.5u exactly, a tie between 1 + u (odd) and 1 + 2u (even) -> 1 + 2u.
    h = R.AdamW(lr=0.5, beta1=0.5, beta2=0.5, eps=0.5)
    _, m, _ = torch_adamw_element(Fraction(0), 1 + 3 * U, Fraction(1), Fraction(0),
                                  torch_adamw_scalars(h, 1))
    assert m == 1 + 2 * U
    got = torch.tensor([1.0]).lerp_(torch.tensor([float(1 + 3 * U)]), 0.5)
    assert Fraction(float(got)) == m


def test_addcmul_is_one_fused_rounding_by_hand():
    # beta2 = 0.5, v = 1 + u, g = 1 + 2^-12:
    #   v*beta2 = 0.5 + u/2 (exact); (0.5*g)*g = 0.5 + 2^-12 + 2^-25 exactly;
    #   torch adds that exact product: 1 + 2^-12 + u/2 + 2^-25 -> above the tie -> 1 + 2^-12 + u.
    #   refgrad.optim rounds g*g = 1 + 2^-11 + 2^-24 (a tie) to 1 + 2^-11, halves it, adds:
    #   1 + 2^-12 + u/2, a tie -> 1 + 2^-12 (even).
    h = R.AdamW(lr=0.5, beta1=0.5, beta2=0.5, eps=0.5)
    g, v = 1 + Fraction(1, 2**12), 1 + U
    _, _, v_torch = torch_adamw_element(Fraction(0), g, Fraction(0), v, torch_adamw_scalars(h, 1))
    _, _, v_ref = R.adamw_element(Fraction(0), g, Fraction(0), v, R.adamw_scalars(h, 1))
    assert v_torch == 1 + Fraction(1, 2**12) + U
    assert v_ref == 1 + Fraction(1, 2**12)
    t = torch.tensor([float(v)]).mul_(0.5).addcmul_(torch.tensor([float(g)]),
                                                   torch.tensor([float(g)]), value=0.5)
    assert Fraction(float(t)) == v_torch


@pytest.mark.parametrize("hyper", [
    R.AdamW(lr=1e-3, weight_decay=0.1),
    R.AdamW(lr=0.05, beta1=0.3, beta2=0.9, eps=1e-6, weight_decay=0.01),
    R.AdamW(lr=0.01, beta1=0.6),
])
def test_matches_torch_adamw_bitwise_on_this_cpu(hyper):
    """Five steps on 257 elements (a vector tail included) against torch.optim.AdamW,
    with torch's own fp32 square root, and refgrad.optim's order differs on the same inputs."""
    g = torch.Generator().manual_seed(7)
    p0 = torch.randn(257, generator=g)
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([param], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                            weight_decay=hyper.weight_decay)
    model = R.ParamState(master=R.values(p0))
    spec = R.ParamState(master=R.values(p0))
    differs = False
    for step in range(1, 6):
        grad = torch.randn(257, generator=g) * torch.pow(2.0, torch.randint(-10, 3, (257,), generator=g).float())
        param.grad = grad.clone()
        opt.step()
        torch_order_step([model], [grad], [hyper], [step], norm=None, sqrt32=torch_cpu_sqrt)
        R.optimizer_step([spec], [grad], [hyper], [step])
        assert_bitwise_equal(R.to_tensor(model.master, (257,)), param.detach(), msg=f"step {step}")
        differs |= not bitwise_equal(R.to_tensor(spec.master, (257,)), param.detach())
    assert differs, "refgrad.optim's order should give other bits somewhere on these inputs"


def test_clipping_uses_the_given_norm_and_refuses_none():
    h = R.AdamW(lr=0.5, beta1=0.5, beta2=0.5, eps=0.5)
    state = R.ParamState(master=[Fraction(1)])
    with pytest.raises(ValueError, match="norm"):
        torch_order_step([state], [torch.tensor([4.0])], [h], [1], norm=None, max_norm=1.0)
    # norm 4 with max_norm 1: coefficient 1/(4 + 1e-6) < 1 scales the grad before the update.
    clipped = R.ParamState(master=[Fraction(1)])
    plain = R.ParamState(master=[Fraction(1)])
    torch_order_step([clipped], [torch.tensor([4.0])], [h], [1], norm=Fraction(4), max_norm=1.0)
    torch_order_step([plain], [torch.tensor([4.0])], [h], [1], norm=Fraction(4), max_norm=100.0)
    assert clipped.exp_avg != plain.exp_avg


def test_non_finite_grad_skips_the_step():
    h = R.AdamW(lr=0.5)
    state = R.ParamState(master=[Fraction(1)])
    assert not torch_order_step([state], [torch.tensor([float("inf")])], [h], [1], norm=None)
    assert state.master == [Fraction(1)] and state.exp_avg is None


def test_sgd_update_is_one_fused_rounding_by_hand():
    # p = 1, g = 1 + u, lr = 1 - 2^-24 (an fp32 value), no momentum, no weight decay:
    #   torch: p + (-lr)*g = 1 - (1 + u - 2^-24 - 2^-47) = -2^-24 + 2^-47 exactly, which fp32
    #   holds (24 significant bits): one rounding changes nothing.
    #   refgrad.optim: r32(lr*g) = r32(1 + 2^-24 - 2^-47) = 1 (below the tie at 1 + 2^-24),
    #   and p - 1 = 0.
    lr = float(1 - Fraction(1, 2**24))
    h = R.SGD(lr=lr, momentum=0.0, weight_decay=0.0)
    p, g = Fraction(1), 1 + U
    assert Fraction(lr) == 1 - Fraction(1, 2**24)  # an fp32 value: f32(-lr) is exact
    p_torch, _ = torch_sgd_element(p, g, None, torch_sgd_scalars(h))
    p_ref, _ = R.sgd_element(p, g, None, R.sgd_scalars(h))
    assert p_torch == -Fraction(1, 2**24) + Fraction(1, 2**47)
    assert p_ref == 0
    param = torch.nn.Parameter(torch.tensor([1.0]))
    param.grad = torch.tensor([float(g)])
    torch.optim.SGD([param], lr=lr).step()
    assert Fraction(float(param.detach())) == p_torch  # this CPU's add(alpha=) is the fused one


@pytest.mark.parametrize("hyper", [
    R.SGD(lr=0.05, momentum=0.9, weight_decay=0.01),
    R.SGD(lr=0.3, momentum=0.0, weight_decay=0.1),
    R.SGD(lr=1e-3, momentum=0.5),
])
def test_matches_torch_sgd_bitwise_on_this_cpu(hyper):
    """Five steps on 257 elements (a vector tail included) against torch.optim.SGD; refgrad.optim's
    order gives other bits on the same inputs."""
    g = torch.Generator().manual_seed(11)
    p0 = torch.randn(257, generator=g)
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([param], lr=hyper.lr, momentum=hyper.momentum,
                          weight_decay=hyper.weight_decay)
    model = R.ParamState(master=R.values(p0))
    spec = R.ParamState(master=R.values(p0))
    differs = False
    for step in range(1, 6):
        grad = torch.randn(257, generator=g) * torch.pow(2.0, torch.randint(-10, 3, (257,), generator=g).float())
        param.grad = grad.clone()
        opt.step()
        torch_order_step([model], [grad], [hyper], [step], norm=None)
        R.optimizer_step([spec], [grad], [hyper], [step])
        assert_bitwise_equal(R.to_tensor(model.master, (257,)), param.detach(), msg=f"step {step}")
        if hyper.momentum:
            assert_bitwise_equal(R.to_tensor(model.momentum, (257,)),
                                 opt.state[param]["momentum_buffer"], msg=f"step {step}")
        differs |= not bitwise_equal(R.to_tensor(spec.master, (257,)), param.detach())
    assert differs, "refgrad.optim's order should give other bits somewhere on these inputs"


def test_torch_clip_coefficient_is_clip_grads_with_norm():
    """refgrad's model of torch.nn.utils.clip_grads_with_norm_'s coefficient: the grad it
    scales is torch's, bitwise, over norms around and away from max_norm."""

    g = torch.Generator().manual_seed(3)
    grads = torch.randn(64, generator=g)
    for norm in [0.5, 0.5000001, 0.49999997, 1.7, 3.0, 10.3, 1e-3, 123.456]:
        for max_norm in (0.5, 1.0, 0.3):
            param = torch.nn.Parameter(torch.zeros(64))
            param.grad = grads.clone()
            total = torch.tensor(norm, dtype=torch.float32)
            torch.nn.utils.clip_grads_with_norm_([param], max_norm, total)
            c = torch_clip_coefficient(Fraction(float(total)), max_norm)
            want = grads * torch.tensor(float(c), dtype=torch.float32)
            assert_bitwise_equal(param.grad, want, msg=str((norm, max_norm)))


def test_torch_clip_coefficient_hand_derived():

    # below max_norm the clamp makes the coefficient exactly 1
    assert torch_clip_coefficient(Fraction(1, 4), 1.0) == 1
    # N = 64: fp32's spacing there is 2^-17 > 2 * 1e-6, so N + 1e-6 rounds to 64; 1/64 is
    # exact, and so is 1/64 * 0.5
    assert torch_clip_coefficient(Fraction(64), 0.5) == Fraction(1, 128)
    # N = 4: spacing 2^-21, 1e-6 is 2.1 of them: N + 1e-6 rounds to 4 + 2^-20, not 4
    assert torch_clip_coefficient(Fraction(4), 0.5) < Fraction(1, 8)

"""The elementwise optimizer updates, in ``refgrad.optim``'s operation order.

Only separately rounded fp32 torch ops: no ``lerp``/``addcmul``/``addcdiv``/
``foreach``/``alpha=`` forms (they may be computed with a fused multiply-add).
Scalars are passed as fp32-exact Python floats, so whether torch converts a
scalar to fp32 first or not cannot matter. Divisors are full tensors, not
scalars: CUDA turns a division by a scalar into a multiplication by its
reciprocal (a second rounding).

``torch.sqrt`` is not used on fp32 tensors: torch 2.13's vectorized CPU
kernel (AVX512) is not correctly rounded (about 1 in 5 random inputs differs
by one ulp). :func:`sqrt_fp32` computes it in fp64 and then corrects the fp32
candidate with an exact midpoint test.
"""

from __future__ import annotations

import torch

from fastgrad.optim.config import AdamWConfig, SGDConfig, fp32


def sqrt_fp32(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root of a non-negative fp32 tensor.

    ``s = fp32(sqrt64(x))`` is within one fp32 ulp of the answer. The midpoints
    ``(s + neighbour) / 2`` have 25 significant bits, so their squares are
    exact in fp64 and comparing them with ``x`` (exact in fp64) decides the
    rounding; a square root of an fp32 value is never exactly a midpoint.
    """
    s = x.double().sqrt().float()
    below = torch.nextafter(s, torch.zeros_like(s))
    above = torch.nextafter(s, torch.full_like(s, float("inf")))
    x64 = x.double()
    mid_below = (s.double() + below.double()) * 0.5
    mid_above = (s.double() + above.double()) * 0.5
    s = torch.where(x64 < mid_below * mid_below, below, s)
    return torch.where(x64 > mid_above * mid_above, above, s)


def adamw_scalars(config: AdamWConfig, step: int) -> dict[str, float]:
    """The fp32 scalars of AdamW step ``step`` (1-based), as in ``refgrad.optim.adamw_scalars``.

    Each is one fp32 operation on fp32 values computed in fp64 and rounded to
    fp32: innocuous double rounding (53 >= 2*24 + 2).
    """
    b1, b2 = fp32(config.beta1), fp32(config.beta2)
    b1p, b2p = b1, b2
    for _ in range(step - 1):
        b1p, b2p = fp32(b1p * b1), fp32(b2p * b2)
    lr, wd = fp32(config.lr), fp32(config.weight_decay)
    return {
        "lr": lr, "beta1": b1, "beta2": b2, "eps": fp32(config.eps), "wd": wd,
        "one_minus_beta1": fp32(1 - b1), "one_minus_beta2": fp32(1 - b2),
        "bc1": fp32(1 - b1p), "bc2": fp32(1 - b2p), "decay": fp32(1 - fp32(lr * wd)),
    }


def adamw_update_(
    master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    config: AdamWConfig, step: int,
) -> None:
    """One AdamW step on fp32 ``master``/``exp_avg``/``exp_avg_sq`` (in place)."""
    s = adamw_scalars(config, step)
    if s["wd"] != 0:
        master.mul_(s["decay"])
    exp_avg.mul_(s["beta1"])
    exp_avg.add_(torch.mul(grad, s["one_minus_beta1"]))
    grad_sq = torch.mul(grad, grad)
    grad_sq.mul_(s["one_minus_beta2"])
    exp_avg_sq.mul_(s["beta2"])
    exp_avg_sq.add_(grad_sq)
    m_hat = torch.div(exp_avg, torch.full_like(exp_avg, s["bc1"]))
    denom = torch.div(exp_avg_sq, torch.full_like(exp_avg_sq, s["bc2"]))
    denom = sqrt_fp32(denom)
    denom.add_(s["eps"])
    m_hat.div_(denom)
    m_hat.mul_(s["lr"])
    master.sub_(m_hat)


def sgd_update_(
    master: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor,
    config: SGDConfig, first_step: bool,
) -> None:
    """One SGD step (torch semantics, dampening 0) on fp32 tensors (in place)."""
    lr, mu, wd = fp32(config.lr), fp32(config.momentum), fp32(config.weight_decay)
    g = grad
    if wd != 0:
        g = torch.add(grad, torch.mul(master, wd))
    if mu != 0:
        if first_step:
            momentum_buffer.copy_(g)
        else:
            momentum_buffer.mul_(mu)
            momentum_buffer.add_(g)
        g = momentum_buffer
    master.sub_(torch.mul(g, lr))

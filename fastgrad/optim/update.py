"""The elementwise optimizer updates, in ``refgrad.optim``'s operation order.

Only separately rounded fp32 torch ops: no ``lerp``/``addcmul``/``addcdiv``/
``foreach``/``alpha=`` forms (they may be computed with a fused multiply-add).
Scalars are passed as fp32-exact Python floats, so whether torch converts a
scalar to fp32 first or not cannot matter. Divisors are full tensors, not
scalars: CUDA turns a division by a scalar into a multiplication by its
reciprocal (a second rounding).

``torch.sqrt`` is not used on fp32 tensors: torch 2.13's vectorized CPU
kernel (AVX512) is not correctly rounded (about 1 in 5 random inputs differs
by one ulp). :func:`sqrt_fp32` computes it in fp64 and rounds to fp32.
"""

from __future__ import annotations

import torch

from fastgrad.optim.config import fp32
from gradvocab import AdamWConfig, SGDConfig

BLOCK = 1 << 18  # elements per pass of the update: 1 MiB per operand, and few per-op thread barriers


def sqrt_fp32(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Correctly rounded fp32 square root of a non-negative fp32 tensor.

    The fp64 square root is correctly rounded, and rounding it again to fp32 is
    innocuous: 53 >= 2*24 + 2 (Figueroa), so ``fp32(sqrt64(x)) == sqrt32(x)``.
    """
    root = x.double().sqrt_()
    if out is None:
        return root.float()
    return out.copy_(root)


def _running_powers_python(b1: float, b2: float, p1: float, p2: float, n: int) -> tuple[float, float]:
    for _ in range(n):
        p1, p2 = fp32(p1 * b1), fp32(p2 * b2)
    return p1, p2


try:  # numba (a dependency; absent only in stripped installs): the same roundings, ~1000x faster
    import numba
    import numpy as np

    @numba.njit(cache=True, fastmath=False)
    def _running_powers_numba(b1, b2, p1, p2, n):  # float32 in, float32 out
        for _ in range(n):
            p1 = p1 * b1  # float32 * float32: one IEEE rounding (no fast-math, no FMA)
            p2 = p2 * b2
        return p1, p2

    def running_powers(b1: float, b2: float, p1: float, p2: float, n: int) -> tuple[float, float]:
        """``n`` more steps of the fp32 running products ``p_i = fp32(p_i * b_i)``.

        The product of two fp32 values is exact in fp64, so ``fp32(p * b)`` in Python and a
        float32 multiply are the same correctly rounded value; a beta that changes every step
        (OneCycleLR's momentum) restarts the product at step 1, so ``n`` can be the step count.
        """
        if n < 64:
            return _running_powers_python(b1, b2, p1, p2, n)
        f = np.float32
        q1, q2 = _running_powers_numba(f(b1), f(b2), f(p1), f(p2), n)
        return float(q1), float(q2)
except ImportError:  # pragma: no cover - numba is a dependency
    running_powers = _running_powers_python


def adamw_scalars(
    config: AdamWConfig, step: int, powers: tuple[int, float, float] | None = None
) -> dict[str, float]:
    """The fp32 scalars of AdamW step ``step`` (1-based), as in ``refgrad.optim.adamw_scalars``.

    Each is one fp32 operation on fp32 values computed in fp64 and rounded to
    fp32: innocuous double rounding (53 >= 2*24 + 2). ``powers``: a previous
    result's ``(k, beta1_power, beta2_power)`` for some ``k <= step``, to continue
    the running products from there instead of from step 1.
    """
    b1, b2 = fp32(config.beta1), fp32(config.beta2)
    k, b1p, b2p = powers if powers is not None and powers[0] <= step else (1, b1, b2)
    b1p, b2p = running_powers(b1, b2, b1p, b2p, step - k)
    lr, wd = fp32(config.lr), fp32(config.weight_decay)
    return {
        "lr": lr, "beta1": b1, "beta2": b2, "eps": fp32(config.eps), "wd": wd,
        "one_minus_beta1": fp32(1 - b1), "one_minus_beta2": fp32(1 - b2),
        "bc1": fp32(1 - b1p), "bc2": fp32(1 - b2p), "decay": fp32(1 - fp32(lr * wd)),
        "beta1_power": b1p, "beta2_power": b2p,
    }


def adamw_update_(
    master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    config: AdamWConfig, step: int,
) -> None:
    """One AdamW step on fp32 ``master``/``exp_avg``/``exp_avg_sq`` (in place).

    Done block by block (``BLOCK`` elements) so that every temporary stays in
    cache; the operations and their order per element are those of
    ``refgrad.optim``, so blocking changes no bit.
    """
    s = adamw_scalars(config, step)
    flat = [t.view(-1) for t in (master, grad, exp_avg, exp_avg_sq)]
    n = flat[0].numel()
    width = min(BLOCK, n)
    scratch = torch.empty((2, width), dtype=torch.float32, device=master.device)
    bc1 = torch.full((width,), s["bc1"], dtype=torch.float32, device=master.device)
    bc2 = torch.full((width,), s["bc2"], dtype=torch.float32, device=master.device)
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        k = stop - start
        p, g, m, v = (t[start:stop] for t in flat)
        tmp, denom = scratch[0, :k], scratch[1, :k]
        if s["wd"] != 0:
            p.mul_(s["decay"])
        m.mul_(s["beta1"])
        m.add_(torch.mul(g, s["one_minus_beta1"], out=tmp))
        torch.mul(g, g, out=tmp)
        tmp.mul_(s["one_minus_beta2"])
        v.mul_(s["beta2"])
        v.add_(tmp)
        torch.div(m, bc1[:k], out=tmp)  # m_hat
        torch.div(v, bc2[:k], out=denom)
        sqrt_fp32(denom, out=denom)
        denom.add_(s["eps"])
        tmp.div_(denom)
        tmp.mul_(s["lr"])
        p.sub_(tmp)


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

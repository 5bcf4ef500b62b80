"""Reference optimizer step (AdamW, SGD with momentum, global-norm clipping, loss scaling).

One process, whole tensors, exact arithmetic: every fp32 operation is computed
exactly on Fractions and rounded once with :func:`refgrad.formats.round_to_value`
(``r32`` below), every fp64 scalar operation likewise with ``r64``. This module
*is* the operation order that ``fastgrad.optim`` follows, written out once.

Rounding. ``+ - * /`` of two fp32 values are computed exactly and rounded once
(IEEE's definition). ``sqrt`` is correctly rounded from an exact integer square
root (:func:`sqrt_rounded`). fastgrad computes its fp32 *scalars* (bias
corrections, ``1 - beta``) in Python fp64 and rounds to fp32: that is double
rounding, and it is innocuous for a single ``+ - * / sqrt`` of fp32 inputs
because 53 >= 2*24 + 2 (Figueroa, "When is double rounding innocuous?", 1995),
so it equals this module's single rounding. Tensor ops run in fp32 directly.

The step, in order (``t`` = the param group's step count after increment):

1. grads: ``g = fp32(grad)`` (exact upcast); with a loss scale ``S`` (a power
   of two) ``g = r32(g * r32(1/S))``.
2. norm: ``N = r64(sqrt(r64(sum g^2)))`` with the sum of squares *exact*
   (independent of how elements are split across ranks); params marked
   ``shared=True`` (a tied embedding's second copy) are left out. Non-finite
   ``N`` (or any non-finite ``g``) skips the step.
3. clipping with ``max_norm``: ``c = r64(max_norm / r64(N + 1e-6))``; if
   ``c < 1``: ``g = r32(g * r32(c))``.
4. AdamW, per element, scalars ``b1p = r32(b1p_prev * beta1)`` (``beta1^t`` as a
   running fp32 product from ``b1p_1 = beta1``), ``bc1 = r32(1 - b1p)``, same
   for ``beta2``; ``decay = r32(1 - r32(lr * wd))``::

       p  = r32(p * decay)                      (only when wd != 0)
       m  = r32(r32(beta1 * m) + r32(r32(1 - beta1) * g))
       v  = r32(r32(beta2 * v) + r32(r32(1 - beta2) * r32(g * g)))
       d  = r32(r32(sqrt(r32(v / bc2))) + eps)
       p  = r32(p - r32(lr * r32(r32(m / bc1) / d)))

   SGD (torch's semantics, dampening 0, no Nesterov)::

       g  = r32(g + r32(wd * p))                (only when wd != 0)
       b  = g on the first step, else r32(r32(momentum * b) + g)   (momentum > 0)
       p  = r32(p - r32(lr * b))                (b = g when momentum == 0)

5. the model param is ``round(p)`` to its dtype (nearest, ties to even).

Where ``torch.optim.AdamW`` (single-tensor, non-fused) differs: it updates
``m`` with ``lerp_(g, 1 - beta1)`` (on CPU a fused multiply-add
``m + w*(g - m)``, not ``beta1*m + (1-beta1)*g``), ``v`` with
``addcmul_(g, g, 1 - beta2)`` (one fused op), computes ``beta^t``,
``1 - beta^t`` and ``lr / bc1`` in Python fp64, places the bias correction
on the step size and on ``sqrt(v) / sqrt(bc2)`` instead of on ``m`` and
``v``, adds ``eps`` after that division, and applies the update with one
``addcdiv_(m, denom, -step_size)``. :func:`torch_adamw_ulp_distance` measures
how far apart the two are on the same inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from refgrad import formats, integer_rounding

FLOAT64 = formats.FloatFormat("float64", 11, 52, 1023, True, True, True, True, "ieee", "inf", "float64")
CLIP_EPS = 1e-6  # Megatron-Core's clip_grad_by_total_norm_fp32: max_norm / (norm + 1e-6)


def r32(x: Fraction | int | float) -> Fraction:
    """``x`` rounded once to fp32 (finite results only: the spec never overflows).

    ``integer_rounding.round_rational``: ``round_to_value``'s rounding in integer arithmetic.
    """
    return integer_rounding.round_rational(formats.FLOAT32, Fraction(x))


def r64(x: Fraction | int | float) -> Fraction:
    """``x`` rounded once to fp64."""
    return integer_rounding.round_rational(FLOAT64, Fraction(x))


def sqrt_rounded(fmt: formats.FloatFormat, x: Fraction) -> Fraction:
    """``sqrt(x)`` correctly rounded to ``fmt`` (one rounding), for ``x >= 0``.

    ``r = isqrt(x * 4^k)`` with ``r`` wider than the format by >= 2 bits: the
    true root lies in ``[r, r + 1)``; when it is not exact, ``r + 1/2`` lies in
    the same open interval, which contains no rounding boundary, so rounding it
    rounds the true root.
    """
    if x < 0:
        raise ValueError(f"sqrt of a negative value {x}")
    if x == 0:
        return Fraction(0)
    k = max(0, fmt.mantissa_bits + 4 - (x.numerator.bit_length() - x.denominator.bit_length()) // 2)
    k += x.denominator.bit_length()
    scaled = x * 4**k
    r = math.isqrt(scaled.numerator // scaled.denominator)
    exact = r * r == scaled
    root = Fraction(r, 2**k) if exact else Fraction(2 * r + 1, 2 ** (k + 1))
    return integer_rounding.round_rational(fmt, root)


def values(t: torch.Tensor) -> list[Fraction]:
    """A tensor's elements as exact Fractions (finite elements only)."""
    return [formats.value_to_fraction(v) for v in formats.decode_tensor(t.detach().cpu().contiguous())]


# --------------------------------------------------------------------------- hyper-parameters


@dataclass(frozen=True)
class AdamW:
    """AdamW hyper-parameters of one param group (rounded to fp32 when used)."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass(frozen=True)
class SGD:
    """SGD hyper-parameters of one param group."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0


def adamw_scalars(h: AdamW, step: int) -> dict[str, Fraction]:
    """The fp32 scalars of AdamW step ``step`` (1-based): each one rounding."""
    b1, b2 = r32(h.beta1), r32(h.beta2)
    b1p, b2p = b1, b2
    for _ in range(step - 1):
        b1p, b2p = r32(b1p * b1), r32(b2p * b2)
    lr, wd = r32(h.lr), r32(h.weight_decay)
    return {
        "lr": lr, "beta1": b1, "beta2": b2, "eps": r32(h.eps), "wd": wd,
        "one_minus_beta1": r32(1 - b1), "one_minus_beta2": r32(1 - b2),
        "bc1": r32(1 - b1p), "bc2": r32(1 - b2p), "decay": r32(1 - r32(lr * wd)),
    }


def adamw_element(p: Fraction, g: Fraction, m: Fraction, v: Fraction, s: dict[str, Fraction]):
    """One element of one AdamW step: returns ``(p, m, v)``."""
    if s["wd"] != 0:
        p = r32(p * s["decay"])
    m = r32(r32(s["beta1"] * m) + r32(s["one_minus_beta1"] * g))
    v = r32(r32(s["beta2"] * v) + r32(s["one_minus_beta2"] * r32(g * g)))
    m_hat = r32(m / s["bc1"])
    v_hat = r32(v / s["bc2"])
    denom = r32(sqrt_rounded(formats.FLOAT32, v_hat) + s["eps"])
    p = r32(p - r32(s["lr"] * r32(m_hat / denom)))
    return p, m, v


def sgd_scalars(h: SGD) -> tuple[Fraction, Fraction, Fraction]:
    """``(lr, momentum, weight_decay)`` rounded to fp32."""
    return r32(h.lr), r32(h.momentum), r32(h.weight_decay)


def sgd_element(p: Fraction, g: Fraction, buf: Fraction | None, s: tuple[Fraction, ...]):
    """One element of one SGD step (``s`` from :func:`sgd_scalars`; ``buf`` None on the
    first step). Returns ``(p, buf)``."""
    lr, mu, wd = s
    if wd != 0:
        g = r32(g + r32(wd * p))
    if mu != 0:
        buf = g if buf is None else r32(r32(mu * buf) + g)
        g = buf
    return r32(p - r32(lr * g)), buf


# --------------------------------------------------------------------------- whole step


def sum_of_squares(grads: Sequence[Sequence[Fraction]]) -> Fraction:
    """The exact sum of squares of every element."""
    return sum((g * g for grad in grads for g in grad), Fraction(0))


def global_norm(grads: Sequence[Sequence[Fraction]]) -> Fraction:
    """``r64(sqrt(r64(exact sum of squares)))``."""
    return sqrt_rounded(FLOAT64, r64(sum_of_squares(grads)))


def clip_coefficient(norm: Fraction, max_norm: float) -> Fraction:
    """``r64(max_norm / r64(norm + 1e-6))``; clipping applies when it is < 1."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    return r64(Fraction(max_norm) / r64(norm + Fraction(CLIP_EPS)))


@dataclass
class ParamState:
    """One parameter's fp32 master and optimizer state, as flat lists of exact values."""

    master: list[Fraction]
    exp_avg: list[Fraction] | None = None
    exp_avg_sq: list[Fraction] | None = None
    momentum: list[Fraction] | None = None


def prepare_grads(
    grads: Sequence[torch.Tensor], *, loss_scale: float | None = None
) -> list[list[Fraction]] | None:
    """Step 1: exact fp32 grads, unscaled. None when any element is NaN/inf."""
    out = []
    inv = r32(Fraction(1) / Fraction(loss_scale)) if loss_scale is not None else None
    for grad in grads:
        decoded = formats.decode_tensor(grad.detach().float().cpu().contiguous())
        if any(isinstance(v, formats.Special) and v is not formats.Special.NEG_ZERO for v in decoded):
            return None
        vals = [formats.value_to_fraction(v) for v in decoded]
        out.append(vals if inv is None else [r32(g * inv) for g in vals])
    return out


def optimizer_step(
    states: Sequence[ParamState],
    grads: Sequence[torch.Tensor],
    hypers: Sequence[AdamW | SGD],
    steps: Sequence[int],
    *,
    max_norm: float | None = None,
    loss_scale: float | None = None,
    shared: Sequence[bool] | None = None,
) -> tuple[bool, Fraction | None]:
    """One step over whole params (in place on ``states``). Returns ``(stepped, norm)``.

    ``hypers[i]``: param i's hyper-parameters for this step (an LR schedule gives each
    step its own ``lr`` and ``weight_decay``). ``steps[i]``: param i's group step count
    *after* increment (1 on the first step). ``shared[i]``: leave param i out of the norm.
    """
    g_all = prepare_grads(grads, loss_scale=loss_scale)
    if g_all is None:
        return False, None
    shared = shared or [False] * len(g_all)
    norm = global_norm([g for g, s in zip(g_all, shared) if not s])
    if max_norm is not None:
        coef = clip_coefficient(norm, max_norm)
        if coef < 1:
            c32 = r32(coef)
            g_all = [[r32(g * c32) for g in grad] for grad in g_all]
    for state, g, h, t in zip(states, g_all, hypers, steps):
        if isinstance(h, AdamW):
            s = adamw_scalars(h, t)
            if state.exp_avg is None:
                state.exp_avg = [Fraction(0)] * len(g)
                state.exp_avg_sq = [Fraction(0)] * len(g)
            for i, gi in enumerate(g):
                state.master[i], state.exp_avg[i], state.exp_avg_sq[i] = adamw_element(
                    state.master[i], gi, state.exp_avg[i], state.exp_avg_sq[i], s
                )
        else:
            first = state.momentum is None
            new_buf = []
            s = sgd_scalars(h)
            for i, gi in enumerate(g):
                state.master[i], b = sgd_element(
                    state.master[i], gi, None if first else state.momentum[i], s
                )
                new_buf.append(b)
            if r32(h.momentum) != 0:
                state.momentum = new_buf
    return True, norm


def to_tensor(vals: Sequence[Fraction], shape: Sequence[int], dtype: torch.dtype = torch.float32):
    """Exact values rounded to ``dtype`` (once) as a tensor of ``shape``."""
    fmt = formats.format_of(dtype)
    if fmt.nan_style == "ieee":
        try:  # the fast form of the same rounding (finite results)
            bits = [integer_rounding.round_rational_bits(fmt, v) for v in vals]
            return formats.bits_to_tensor(fmt, bits, tuple(shape))
        except OverflowError:
            pass  # the format's overflow policy (inf) applies: the spec's path below
    return formats.round_values_to_tensor(fmt, vals, tuple(shape))


# --------------------------------------------------------------------------- torch comparison


def ulp_distance_fp32(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in fp32 units in the last place between two fp32 tensors."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.detach().float().contiguous().view(torch.int32).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def torch_adamw_ulp_distance(
    param: torch.Tensor, grads: Sequence[torch.Tensor], h: AdamW
) -> int:
    """Max ULP distance (fp32) between ``torch.optim.AdamW`` and this spec after each step.

    Runs both from the same fp32 ``param`` over the grads in ``grads`` (one per
    step) and returns the largest distance seen on the parameter.
    """
    p_torch = torch.nn.Parameter(param.detach().float().clone())
    opt = torch.optim.AdamW(
        [p_torch], lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay,
        foreach=False, fused=False,
    )
    state = ParamState(master=values(param.float()))
    worst = 0
    for t, grad in enumerate(grads, start=1):
        p_torch.grad = grad.detach().float().clone().reshape(p_torch.shape)
        opt.step()
        optimizer_step([state], [grad], [h], [t])
        ref = to_tensor(state.master, p_torch.shape)
        worst = max(worst, ulp_distance_fp32(p_torch.detach(), ref))
    return worst

"""A named variant of ``refgrad.optim``: the AdamW step in ``torch.optim.AdamW``'s operation order
(and the SGD step in ``torch.optim.SGD``'s: :func:`torch_sgd_element`).

Why: Megatron-Core without Transformer Engine or apex steps its fp32 main params with
``torch.optim.AdamW`` (``megatron/core/optimizer/__init__.py`` falls back to it), whose
order of operations differs from ``refgrad.optim``'s (REFERENCE_NOTES section 9), so its
bits differ by design. This module writes that order out element by element, in exact
arithmetic with one visible rounding per operation, so that a difference can be classified
as "torch's order" instead of "wrong". It models the single-tensor path (torch's default
on the CPU; ``foreach`` runs the same elementwise ops) of torch 2.x, ``capturable=False``,
``amsgrad=False``, ``maximize=False``:

Scalars are Python floats (IEEE fp64, ``**`` from the C library), as torch computes them
with ``step`` a float: ``bc1 = 1 - beta1**t``, ``bc2 = 1 - beta2**t``,
``step_size = lr / bc1``, ``bc2_sqrt = bc2 ** 0.5``. A Python float meets an fp32 tensor
rounded once to fp32 (``f32(x)`` below). Per element (``r32``: one rounding to fp32)::

    p = r32(p * f32(1 - lr * wd))                  param.mul_  (only when wd != 0)
    w = f32(1 - beta1)
    m = r32(m + w * r32(g - m))      if |w| < 0.5  exp_avg.lerp_: ONE rounding (fused multiply-add)
    m = r32(g + f32(w - 1) * r32(g - m))   else    (ATen's vectorized lerp, AVX2/AVX512)
    v = r32(v * f32(beta2))                        exp_avg_sq.mul_
    v = r32(v + r32(f32(1 - beta2) * g) * g)       .addcmul_(g, g, value=1 - beta2): ONE rounding
    d = r32(r32(sqrt32(v) / f32(bc2_sqrt)) + f32(eps)) (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    p = r32(p + r32(r32(f32(-step_size) * m) / d))    param.addcdiv_(m, d, value=-step_size)

``sqrt32`` is the platform's fp32 square root (IEEE's correctly rounded one by default; see
:func:`torch_adamw_element`). ``addcdiv`` evaluates ``value * t1 / t2`` left to right with a rounding per operation;
``addcmul`` rounds ``value * t1`` and then adds ``· t2`` to ``self`` in one fused
multiply-add, and so does the lerp: measured on this machine's AVX512 build of ATen's
vectorized CPU kernels (tails included, position-independent). On other CPU builds the
fusion may differ: ``tests/refgrad/test_optim_torch.py`` holds the model to
``torch.optim.AdamW`` on the running CPU, and the hand-derived cases pin the model itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction

from refgrad import formats
from refgrad.optim import (
    SGD,
    AdamW,
    ParamState,
    clip_coefficient,
    prepare_grads,
    r32,
    sqrt_rounded,
)


def f32(x: float) -> Fraction:
    """A Python float as it meets an fp32 tensor: rounded once to fp32."""
    return r32(Fraction(x))


def torch_adamw_scalars(h: AdamW, step: int) -> dict[str, Fraction]:
    """The step's scalars as torch forms them (Python fp64, then fp32 where used)."""
    t = float(step)
    bc1 = 1 - h.beta1**t
    bc2 = 1 - h.beta2**t
    step_size = h.lr / bc1
    return {
        "wd": Fraction(h.weight_decay), "decay": f32(1 - h.lr * h.weight_decay),
        "w1": f32(1 - h.beta1), "w1_minus_1": r32(f32(1 - h.beta1) - 1),
        "beta2": f32(h.beta2), "w2": f32(1 - h.beta2),
        "bc2_sqrt": f32(bc2**0.5), "eps": f32(h.eps), "neg_step_size": f32(-step_size),
    }


def correctly_rounded_sqrt(v: Fraction) -> Fraction:
    """The fp32 square root rounded once (IEEE's ``sqrt``)."""
    return sqrt_rounded(formats.FLOAT32, v)


def torch_adamw_element(p: Fraction, g: Fraction, m: Fraction, v: Fraction,
                        s: dict[str, Fraction],
                        sqrt32: Callable[[Fraction], Fraction] = correctly_rounded_sqrt,
                        ) -> tuple[Fraction, Fraction, Fraction]:
    """One element of one step in torch's order (module docstring); returns ``(p, m, v)``.

    ``sqrt32`` is the fp32 square root of the platform: IEEE's correctly rounded one by
    default. torch's CPU ``Tensor.sqrt`` on fp32 is not always correctly rounded (it
    calls the vector math library; measured: about 1 in 6 elements one ULP off), so a
    bitwise model of torch on a CPU passes that function in (it is an elementary
    function of the platform, not part of the optimizer's order).
    """
    if s["wd"] != 0:
        p = r32(p * s["decay"])
    diff = r32(g - m)
    if abs(s["w1"]) < Fraction(1, 2):
        m = r32(m + s["w1"] * diff)
    else:
        m = r32(g + s["w1_minus_1"] * diff)
    v = r32(v * s["beta2"])
    v = r32(v + r32(s["w2"] * g) * g)
    d = r32(r32(sqrt32(v) / s["bc2_sqrt"]) + s["eps"])
    p = r32(p + r32(r32(s["neg_step_size"] * m) / d))
    return p, m, v


def torch_sgd_scalars(h: SGD) -> dict[str, Fraction]:
    """``torch.optim.SGD``'s scalars as its kernels see them: Python floats rounded to fp32."""
    return {"wd": Fraction(h.weight_decay), "wd32": f32(h.weight_decay),
            "momentum": Fraction(h.momentum), "momentum32": f32(h.momentum),
            "neg_lr": f32(-h.lr)}


def torch_sgd_element(p: Fraction, g: Fraction, buf: Fraction | None, s: dict[str, Fraction]
                      ) -> tuple[Fraction, Fraction | None]:
    """One element of one ``torch.optim.SGD`` step (``dampening=0``, ``nesterov=False``, the
    CPU single-tensor path); ``buf`` None on the first step. Returns ``(p, buf)``::

        g = r32(g + wd32 * p)              grad.add(param, alpha=wd): ONE rounding (fused)
        buf = g                            first step: a copy of the grad
        buf = r32(r32(buf * mu32) + g)     later: buf.mul_(momentum).add_(grad) (alpha 1: exact)
        p = r32(p + neg_lr * buf)          param.add_(buf, alpha=-lr): ONE rounding (fused)

    ``add`` with ``alpha`` is a fused multiply-add in ATen's vectorized CPU kernel (measured on
    this machine's build, tails included: ``tests/refgrad/test_optim_torch.py``); refgrad.optim's
    SGD rounds the product first.
    """
    if s["wd"] != 0:
        g = r32(g + s["wd32"] * p)
    if s["momentum"] != 0:
        buf = g if buf is None else r32(r32(buf * s["momentum32"]) + g)
        g = buf
    return r32(p + s["neg_lr"] * g), buf


def torch_clip_coefficient(norm: Fraction, max_norm: float) -> Fraction:
    """``torch.nn.utils.clip_grads_with_norm_``'s coefficient for an fp32 ``total_norm``
    (``torch/nn/utils/clip_grad.py``): ``clip_coef = max_norm / (total_norm + 1e-6)`` on an
    fp32 tensor (the Python float rounded to fp32; ``Tensor.__rtruediv__`` is
    ``reciprocal() * max_norm``), then ``torch.clamp(clip_coef, max=1.0)``; every grad is
    then multiplied by it (``r32(g * c)``; by 1.0 when not clipping, which changes nothing)::

        c = min(r32(r32(1 / r32(N + f32(1e-6))) * f32(max_norm)), 1)
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    denominator = r32(Fraction(norm) + f32(1e-6))
    return min(r32(r32(1 / denominator) * f32(max_norm)), Fraction(1))


def torch_order_step(
    states: Sequence[ParamState],
    grads: Sequence,
    hypers: Sequence[AdamW | SGD],
    steps: Sequence[int],
    *,
    norm: Fraction | None,
    max_norm: float | None = None,
    loss_scale: float | None = None,
    sqrt32: Callable[[Fraction], Fraction] = correctly_rounded_sqrt,
    torch_clip: bool = False,
) -> bool:
    """One step over whole params in torch's order (``torch.optim.AdamW`` for :class:`AdamW`
    hypers, ``torch.optim.SGD`` for :class:`SGD` ones), given the grad ``norm`` to clip with.

    The grads are prepared (fp32, unscaled by ``r32(g * r32(1/S))``) and clipped with
    ``refgrad.optim.clip_coefficient`` exactly as ``refgrad.optim.optimizer_step`` does;
    the norm is an input because production computes it its own way (classified on its
    own). ``torch_clip``: clip with :func:`torch_clip_coefficient` (``torch.nn.utils``'s
    clipping) instead. Returns False (nothing changed) when a grad is NaN/inf.
    """
    g_all = prepare_grads(grads, loss_scale=loss_scale)
    if g_all is None:
        return False
    if max_norm is not None:
        if norm is None:
            raise ValueError("torch_order_step needs the grad norm to clip with max_norm")
        coef = torch_clip_coefficient(norm, max_norm) if torch_clip else clip_coefficient(norm, max_norm)
        if coef < 1:
            c32 = r32(coef)
            g_all = [[r32(g * c32) for g in grad] for grad in g_all]
    for state, g, h, t in zip(states, g_all, hypers, steps):
        if isinstance(h, SGD):
            sgd = torch_sgd_scalars(h)
            first = state.momentum is None
            buffers = []
            for i, gi in enumerate(g):
                state.master[i], b = torch_sgd_element(state.master[i], gi,
                                                       None if first else state.momentum[i], sgd)
                buffers.append(b)
            if sgd["momentum"] != 0:
                state.momentum = buffers
            continue
        s = torch_adamw_scalars(h, t)
        if state.exp_avg is None:
            state.exp_avg = [Fraction(0)] * len(g)
            state.exp_avg_sq = [Fraction(0)] * len(g)
        for i, gi in enumerate(g):
            state.master[i], state.exp_avg[i], state.exp_avg_sq[i] = torch_adamw_element(
                state.master[i], gi, state.exp_avg[i], state.exp_avg_sq[i], s, sqrt32)
    return True

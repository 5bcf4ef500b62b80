"""Reference output-layer (embedding) weight gradient, accumulated into ``main_grad``.

This is the spec that ``fastgrad.deferred_wgrad`` is held to. It walks a list of
microbatches, computes each microbatch's weight gradient with exact rational
arithmetic and accumulates it into ``main_grad`` in a stated order.

Rounding model (every rounding is round-to-nearest-even via ``refgrad.formats``):

For microbatch ``k`` with ``grad_output`` ``G_k`` (``[T_k, V]`` after flattening
the leading dimensions) and gathered input ``X_k`` (``[T_k, H]``):

1. ``d_k[v, h] = sum_t G_k[t, v] * X_k[t, h]`` exactly (Fractions; every
   product and the sum are exact).
2. ``w_k = fp32(d_k)``: the GEMM accumulates in fp32 and writes an fp32 result.
   Without gradient-accumulation fusion production's GEMM writes the weight's
   dtype instead, so ``w_k = fmt(fp32(d_k))`` with ``fmt = wgrad_format``
   (rounded through fp32 first, as cuBLAS does with an fp32 compute type).
3. ``main_grad = fmt_mg(fp32(main_grad + w_k))``: the add happens in fp32 (the
   GEMM epilogue with alpha = beta = 1) and is rounded once to fp32; a bf16/fp16
   ``main_grad`` then gets its own second rounding on the store. For an fp32
   ``main_grad`` the outer rounding is the identity.

So each microbatch contributes exactly two visible roundings into an fp32
``main_grad`` (dot product, then the add), in the order given by ``order``
(default: microbatch order 0, 1, ..., M-1).

What fastgrad can be held to. Step 1-2 in fastgrad is a BLAS/cuBLAS GEMM whose
summation order (blocking, split-K, FMA) is not fixed, so its ``w_k`` differs
from ``fp32(d_k)`` by at most ``gamma(T_k) * sum_t |G_k[t,v] X_k[t,h]|`` with
``gamma(n) = n u / (1 - n u)`` (``refgrad.formats.gamma``), ``u = 2^-24`` (Higham, inner
products).
Step 3 is the same single fp32 add in both. Hence, with
``A = |main_grad_init| + sum_k sum_t |G_k X_k|`` per element, both fastgrad and
this reference lie within ``((1 + gamma(T)) (1 + gamma'(M+1)) - 1) * A`` of the
exact sum (``gamma'`` uses the unit roundoff of the accumulation steps:
``2^-24`` for fp32 ``main_grad``, ``2^-8 + 2^-24 + 2^-32`` for bf16), so they
differ by at most twice that: :func:`fastgrad_error_factor`. No fixed ULP
bound exists in general (cancellation makes the result arbitrarily small
relative to ``A``); when every partial sum is exactly representable in fp32
(small-integer grids) the GEMM is exact in any order and fastgrad must equal
this reference bitwise.

The reference handles finite values only; it raises ValueError on NaN/inf
inputs or on an intermediate that overflows.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import torch

from refgrad.formats import (
    FLOAT32,
    FloatFormat,
    Special,
    decode_tensor,
    format_of,
    gamma,
    round_to_value,
    round_values_to_tensor,
    value_to_fraction,
)


def deferred_accumulation_order(num_microbatches: int, wgrad_deferral_limit: int) -> list[int]:
    """The order in which production adds microbatch wgrads into ``main_grad`` when deferring.

    The first ``limit`` microbatches (all of them for limit 0) are deferred and
    added at the flush, after the later microbatches were added immediately in
    their backward passes: ``[limit, ..., M-1, 0, ..., limit-1]``.
    """
    if num_microbatches < 0:
        raise ValueError(f"num_microbatches must be >= 0, got {num_microbatches}")
    if wgrad_deferral_limit < 0:
        raise ValueError(f"wgrad_deferral_limit must be >= 0, got {wgrad_deferral_limit}")
    deferred = num_microbatches if wgrad_deferral_limit == 0 else min(
        wgrad_deferral_limit, num_microbatches
    )
    return list(range(deferred, num_microbatches)) + list(range(deferred))


def _finite(value, what: str) -> Fraction:
    if isinstance(value, Special) and value is not Special.NEG_ZERO:
        raise ValueError(f"{what} is {value.value}; refgrad.deferred_wgrad models finite values only")
    return value_to_fraction(value)


def _as_rows(t: torch.Tensor, name: str) -> tuple[list[list[Fraction]], int]:
    """Exact values of ``t`` flattened to ``[rows, last_dim]`` and the column count."""
    if t.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dimensions, got shape {tuple(t.shape)}")
    cols = t.shape[-1]
    flat = [_finite(v, f"an element of {name}") for v in decode_tensor(t.contiguous())]
    return [flat[i : i + cols] for i in range(0, len(flat), cols)], cols


def exact_weight_gradient(grad_output: torch.Tensor, total_input: torch.Tensor) -> list[list[Fraction]]:
    """``grad_outputᵀ · total_input`` exactly, as ``[V][H]`` Fractions (leading dims flattened)."""
    g_rows, vocab = _as_rows(grad_output, "grad_output")
    x_rows, hidden = _as_rows(total_input, "total_input")
    if len(g_rows) != len(x_rows):
        raise ValueError(
            f"grad_output has {len(g_rows)} tokens but total_input has {len(x_rows)}; "
            "they must match after flattening the leading dimensions"
        )
    return [
        [sum((g[v] * x[h] for g, x in zip(g_rows, x_rows)), Fraction(0)) for h in range(hidden)]
        for v in range(vocab)
    ]


def _round(fmt: FloatFormat, value: Fraction, what: str) -> Fraction:
    return _finite(round_to_value(fmt, value), what)


def reference_main_grad(
    grad_outputs: Sequence[torch.Tensor],
    total_inputs: Sequence[torch.Tensor],
    *,
    main_grad_init: torch.Tensor | None = None,
    main_grad_dtype: torch.dtype = torch.float32,
    wgrad_dtype: torch.dtype | None = None,
    order: Sequence[int] | None = None,
) -> torch.Tensor:
    """``main_grad`` after adding every microbatch's weight gradient (see the module docstring).

    grad_outputs[k]: ``[..., V]`` output gradient of microbatch k (this rank's vocab shard).
    total_inputs[k]: ``[..., H]`` the gathered (full-sequence) layer input of microbatch k.
    main_grad_init: the starting ``main_grad`` (zeros when None), dtype ``main_grad_dtype``.
    wgrad_dtype: None for fused accumulation (fp32 wgrad); otherwise the dtype each
      microbatch's wgrad is rounded to before the add (production without fusion).
    order: the microbatch order of the adds; default ``range(M)``.
    """
    if len(grad_outputs) != len(total_inputs):
        raise ValueError(
            f"grad_outputs has {len(grad_outputs)} microbatches but total_inputs has "
            f"{len(total_inputs)}; they must be equal"
        )
    num = len(grad_outputs)
    order = list(range(num)) if order is None else list(order)
    if sorted(order) != list(range(num)):
        raise ValueError(f"order must be a permutation of range({num}), got {order}")
    mg_fmt = format_of(main_grad_dtype)
    wgrad_fmt = None if wgrad_dtype is None else format_of(wgrad_dtype)

    if num == 0 and main_grad_init is None:
        raise ValueError("with no microbatches, main_grad_init is needed to know the shape")
    if num:
        vocab, hidden = grad_outputs[0].shape[-1], total_inputs[0].shape[-1]
    else:
        vocab, hidden = main_grad_init.shape
    if main_grad_init is None:
        acc = [[Fraction(0)] * hidden for _ in range(vocab)]
    else:
        if main_grad_init.dtype != main_grad_dtype or tuple(main_grad_init.shape) != (vocab, hidden):
            raise ValueError(
                f"main_grad_init must be {main_grad_dtype} of shape {(vocab, hidden)}, got "
                f"{main_grad_init.dtype} of shape {tuple(main_grad_init.shape)}"
            )
        acc, _ = _as_rows(main_grad_init, "main_grad_init")

    for k in order:
        exact = exact_weight_gradient(grad_outputs[k], total_inputs[k])
        if len(exact) != vocab or len(exact[0]) != hidden:
            raise ValueError(f"microbatch {k} has a different [V, H] shape than microbatch 0")
        for v in range(vocab):
            for h in range(hidden):
                w = _round(FLOAT32, exact[v][h], "a microbatch weight gradient")
                if wgrad_fmt is not None:
                    w = _round(wgrad_fmt, w, "a rounded microbatch weight gradient")
                s = _round(FLOAT32, acc[v][h] + w, "a main_grad add")
                # An fp32 store of an fp32 value is exact; only a 16-bit main_grad rounds again.
                acc[v][h] = s if mg_fmt == FLOAT32 else _round(mg_fmt, s, "a main_grad store")
    return round_values_to_tensor(mg_fmt, [x for row in acc for x in row], (vocab, hidden))


def tied_embedding_grad_sum(stage_grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tied word-embedding gradient every stage holds after the embedding-group all-reduce.

    The exact elementwise sum of the stages' ``main_grad`` (first and last stage),
    rounded once to their dtype. For two stages a single IEEE add computes exactly
    this, in either order.
    """
    if not stage_grads:
        raise ValueError("stage_grads must hold at least one tensor")
    first = stage_grads[0]
    for i, g in enumerate(stage_grads):
        if g.dtype != first.dtype or g.shape != first.shape:
            raise ValueError(
                f"stage_grads[{i}] is {g.dtype} {tuple(g.shape)}; every stage must match "
                f"stage_grads[0] ({first.dtype} {tuple(first.shape)})"
            )
    fmt = format_of(first.dtype)
    decoded = [[_finite(v, "a stage gradient") for v in decode_tensor(g.contiguous())] for g in stage_grads]
    sums = [sum(column, Fraction(0)) for column in zip(*decoded)]
    return round_values_to_tensor(fmt, sums, tuple(first.shape))


def accumulation_unit_roundoff(main_grad_dtype: torch.dtype, wgrad_dtype: torch.dtype | None) -> Fraction:
    """The per-add relative error of one ``main_grad`` update in the rounding model."""
    u32 = FLOAT32.unit_roundoff
    u = u32
    for extra in (main_grad_dtype, wgrad_dtype):
        if extra is not None and format_of(extra) != FLOAT32:
            # Two successive roundings compose as (1+u)(1+u') - 1.
            ue = format_of(extra).unit_roundoff
            u = u + ue + u * ue
    return u


def fastgrad_error_factor(
    max_tokens: int,
    num_microbatches: int,
    *,
    main_grad_dtype: torch.dtype = torch.float32,
    wgrad_dtype: torch.dtype | None = None,
) -> Fraction:
    """``c`` such that ``|fastgrad - reference| <= c * A`` elementwise (see the module docstring).

    ``A = |main_grad_init| + sum_k sum_t |G_k[t,v] X_k[t,h]|``. Each of the two
    results is within ``(1+gamma(T))(1+gamma'(M)) - 1`` times ``A`` of the exact
    sum, so they are within twice that of each other (``gamma'(M+1)``: M adds plus
    the unfused wgrad's own store rounding; conservative when fused).
    """
    dot = gamma(max_tokens, FLOAT32.unit_roundoff)
    # M adds, plus one more factor for the wgrad's own store rounding without fusion.
    acc = gamma(num_microbatches + 1, accumulation_unit_roundoff(main_grad_dtype, wgrad_dtype))
    return 2 * ((1 + dot) * (1 + acc) - 1)

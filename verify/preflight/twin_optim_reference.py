"""refgrad's side of the optimizer twin, and the per-step comparison of the step's outcome.

:func:`reference_with_optimizer` runs ``refgrad.pipeline``'s model (or, with
16-bit params, ``refgrad.pipeline_mixed``) one replica after the other, reduces
as production does and steps ``refgrad.optim.optimizer_step`` (exact arithmetic,
one rounding per fp32 operation) with the twin's max norm and loss scale
(Megatron's scaler: ``verify.preflight.twin_scaler``).
:func:`compare_optimizer_step` holds each rank's outcome (stepped or skipped,
global norm, clip coefficient, loss scale) to refgrad's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from verify.preflight.twin_optim import ADAMW, AdamWTwin
from verify.preflight.twin_precision import cast_stage_params_
from verify.preflight.twin_scaler import ReferenceScaler


@dataclass
class OptimReference:
    """refgrad's run: per step losses [replica][microbatch], reduced grads, params, state."""

    losses: list[list[list[float]]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    state: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    # per step: (stepped, exact norm rounded to fp64, clip coefficient, loss scale)
    steps: list[tuple[bool, float, float | None, float | None]] = field(default_factory=list)
    max_norm: float | None = None


def reference_with_optimizer(case: Any, optim: AdamWTwin | None = None, *,
                             param_values: Any = None) -> OptimReference:
    """The whole model in one process: microbatch-ordered sums, DP reduction, exact AdamW.

    ``param_values(master)``: what the forward computes with, given an fp32 master tensor
    (None: the master itself). It is applied twice to the initial weights (the params are
    built from them, then published from the masters, which start as the built params) and
    once after every step (``verify.preflight.twin_mxfp8``: MXFP8 params)."""
    from refgrad.optim import AdamW, ParamState, clip_coefficient, optimizer_step, to_tensor, values
    from refgrad.pipeline import (
        HEAD_PARAM,
        StageModule,
        head_weight_init,
        reduce_and_tie,
        replica_grad_sums,
        stage_param_name,
    )

    optim = optim or AdamWTwin()
    precision = optim.precision
    spec = case.spec
    stages = [StageModule(spec, s) for s in range(spec.num_stages)]
    named = {stage_param_name(s, n): p for s, st in enumerate(stages) for n, p in st.named_parameters()}
    head_name = stage_param_name(spec.num_stages - 1, HEAD_PARAM)
    head = None
    if spec.output_head:
        head = head_weight_init(spec).requires_grad_(True)
        named[head_name] = head
    cast_stage_params_(named.values(), precision)  # the masters below: the 16-bit values
    names = list(named)
    publish = param_values or (lambda master: master)
    if param_values is not None:
        with torch.no_grad():
            for p in named.values():
                p.copy_(publish(p.detach()))
    states = {n: ParamState(master=values(p.detach())) for n, p in named.items()}
    if param_values is not None:
        with torch.no_grad():
            for p in named.values():
                p.copy_(publish(p.detach()))
    hyper = AdamW(**ADAMW)
    scaler = ReferenceScaler(optim.loss_scale, min_scale=optim.min_loss_scale if optim.dynamic
                             else optim.loss_scale, window=optim.window, hysteresis=optim.hysteresis)
    out = OptimReference(max_norm=optim.max_grad_norm)
    updates = 0  # AdamW's step count: a skipped step (NaN/inf grads) does not count
    for step, plan in enumerate(case.plans):
        scale = scaler.scale
        if precision.mixed:  # the scaled 16-bit backward itself (it may overflow)
            from refgrad.pipeline_mixed import mixed_reduce_and_tie, mixed_replica_grad_sums

            per_replica, step_losses = mixed_replica_grad_sums(
                spec, stages, named, head, step, plan.num_microbatches, case.dp_size,
                grad_dtype=precision.grad_dtype, loss_scale=scale)
            reduced = mixed_reduce_and_tie(spec, per_replica, case.reduction)
        else:
            per_replica, step_losses = replica_grad_sums(
                spec, stages, named, head, step, plan.num_microbatches, case.dp_size)
            reduced = reduce_and_tie(spec, per_replica, case.reduction)
            if scale is not None:  # what the scaled backward leaves in the buffer (exact: S = 2^k)
                reduced = {n: g * scale for n, g in reduced.items()}
        shared = [spec.tied_embedding and n == head_name for n in names]
        stepped, norm = optimizer_step(
            [states[n] for n in names], [reduced[n] for n in names], [hyper] * len(names),
            [updates + 1] * len(names), shared=shared, max_norm=optim.max_grad_norm, loss_scale=scale)
        coef = None
        if stepped and optim.max_grad_norm is not None:
            coef = float(clip_coefficient(norm, optim.max_grad_norm))
        out.steps.append((stepped, math.nan if norm is None else float(norm), coef, scale))
        scaler.update(found_inf=not stepped)
        updates += stepped
        state_now = {}
        with torch.no_grad():
            for n in names:
                shape, st = named[n].shape, states[n]
                zeros = [Fraction(0)] * len(st.master)  # moments before the first update that happened
                # The master rounded once to the param's dtype (the identity for fp32), or
                # what the forward computes with (MXFP8: quantized, then dequantized).
                if param_values is None:
                    named[n].copy_(to_tensor(st.master, shape, named[n].dtype))
                else:
                    named[n].copy_(publish(to_tensor(st.master, shape)))
                state_now[n] = {"master": to_tensor(st.master, shape),
                                "exp_avg": to_tensor(st.exp_avg or zeros, shape),
                                "exp_avg_sq": to_tensor(st.exp_avg_sq or zeros, shape)}
        out.losses.append(step_losses)
        out.grads.append(reduced)
        out.params.append({n: p.detach().clone() for n, p in named.items()})
        out.state.append(state_now)
    return out


def norm_tolerance(reference: Any, step: int, bound_ulps: int | None) -> float:
    """How far the twin's global norm may be from refgrad's: 0 when the reduction order is fixed
    (exact sum of squares, two fp64 roundings: bitwise). Otherwise each reduced grad element may
    be off by ``bound_ulps`` fp32 ULPs of its tensor's largest magnitude (``a_t``), and
    ``| ||g + d|| - ||g|| | <= ||d|| <= sqrt(sum_t numel_t a_t^2)``, plus two fp64 roundings."""
    if bound_ulps is None:
        return 0.0
    scale = reference.steps[step][3] or 1.0
    total = 0.0
    for grad in reference.grads[step].values():
        top = float(grad.abs().max()) / scale
        allowed = bound_ulps * (math.ulp(top) * 2.0**29 if top > 0 else 2.0**-149)
        total += grad.numel() * allowed * allowed
    norm = reference.steps[step][1]
    return math.sqrt(total) + 2 * math.ulp(norm if math.isfinite(norm) else 0.0)


def compare_optimizer_step(row: Any, reference: Any, ranks: list[Any],
                           bound_ulps: int | None = None) -> None:
    """The step's outcome (stepped, global grad norm, clip coefficient, loss scale) on every rank
    vs refgrad's; the norm bitwise where the reduction order is fixed, else within
    :func:`norm_tolerance` (and then clipping is compared only outside that band)."""
    if not hasattr(reference, "steps"):
        return
    step = row.step
    stepped, norm, coef, scale = reference.steps[step]
    row.grad_norm, row.clip_coefficient, row.loss_scale = norm, coef, scale
    row.stepped = stepped
    row.clipped = coef is not None and coef < 1.0
    tolerance = norm_tolerance(reference, step, bound_ulps)
    decided = reference.max_norm is None or abs(norm - reference.max_norm) > tolerance
    for res in ranks:
        if res is None or not hasattr(res, "steps"):
            continue
        got_stepped, got_norm, got_coef, got_scale = res.steps[step]
        where = f"step {step}: optimizer on stage {res.stage} (replica {res.dp_rank})"
        if got_stepped != stepped:
            row.failures.append(f"{where} {'stepped' if got_stepped else 'skipped'}, refgrad "
                                f"{'stepped' if stepped else 'skipped'}")
        if not (abs(got_norm - norm) <= tolerance or (math.isnan(norm) and math.isnan(got_norm))):
            row.failures.append(f"{where}: global grad norm {got_norm!r}, refgrad {norm!r}"
                                + (f" (bound {tolerance:.3g})" if tolerance else ""))
        if got_scale != scale:
            row.failures.append(f"{where}: loss scale {got_scale!r}, refgrad {scale!r}")
        if decided and (got_coef is not None and got_coef < 1.0) != row.clipped:
            row.failures.append(f"{where}: {'clipped' if got_coef is not None and got_coef < 1 else 'not clipped'}"
                                f" (coefficient {got_coef!r}), refgrad coefficient {coef!r}")

"""refgrad's side of the twin: the same case in one process, exact where production rounds once.

:func:`reference_for` picks the run for the plan's training variant:

- SGD: ``refgrad.pipeline.reference_training``;
- AdamW (:func:`reference_with_optimizer`): ``refgrad.pipeline``'s model (with 16-bit
  params, in ``refgrad.pipeline.precision``'s dtypes) one replica after the other, reduced as production
  does, stepped by ``refgrad.optim.optimizer_step`` (exact arithmetic, one rounding per fp32
  operation) with the twin's max norm, loss scale (Megatron's scaler:
  :mod:`verify.preflight.twin.scaler`) and each update's lr and weight decay
  (``AdamWTwin.schedule``);
- AdamW over MXFP8 params (:func:`reference_with_mxfp8`): the same, the forward weights
  ``refgrad.mxfp8.dequantize(quantize(bf16(master)))``.

A candidate whose optimizer departs from ``refgrad.optim`` by design
(``OPTIMIZER_BEHAVIOURS`` of :meth:`Candidate.documented`: Megatron-Core's
``torch.optim.AdamW`` order, no weight decay on 1-D params, its fp32 partial-sum norm) is
held to refgrad's model of that behaviour (:class:`ReferenceRule`): the reference's
trajectory steps ``refgrad.optim_torch.torch_order_step`` (with the platform's fp32 square
root, clipping with the candidate's own norm, which is judged on its own), and every step
also keeps what the spec (``refgrad.optim``) would have made of the same state and grads, so
the report can say how far the documented behaviour lands from it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from gradvocab import StepOutcome
from refgrad import mxfp8 as RQ
from refgrad.optim import (
    AdamW,
    ParamState,
    clip_coefficient,
    optimizer_step,
    to_tensor,
    values,
)
from refgrad.optim_torch import torch_order_step
from refgrad.pipeline import (
    HEAD_PARAM,
    ReferenceResult,
    StageModule,
    head_weight_init,
    reduce_and_tie,
    reference_training,
    replica_grad_sums,
    stage_param_name,
)
from verify.candidates.interfaces import (
    Behaviour,
    DocumentedBehaviour,
    HyperparameterSchedule,
    PipelineCase,
)
from verify.preflight.twin.mxfp8 import BLOCK, SCALE_MODE
from verify.preflight.twin.precision import cast_stage_params_
from verify.preflight.twin.scaler import ReferenceScaler
from verify.preflight.twin.variants import (
    TWIN_ADAMW,
    AdamWTwin,
    MXFP8Twin,
    SGDTwin,
    TwinTraining,
)


def torch_cpu_sqrt(v: Fraction) -> Fraction:
    """torch's CPU fp32 square root of one fp32 value (not always correctly rounded: an
    elementary function of the platform, not part of the optimizer's order)."""
    return Fraction(float(torch.tensor(float(v), dtype=torch.float32).sqrt()))


@dataclass(frozen=True)
class ReferenceRule:
    """How the reference steps AdamW: the spec (``refgrad.optim``), or refgrad's model of a
    candidate's documented behaviour.

    ``torch_order``: ``refgrad.optim_torch``'s order with the platform's fp32 square root;
    ``decay_1d_params``: False leaves params with one dimension undecayed;
    ``clip_norms``: the candidate's own global norm per step to clip with (None: refgrad's
    exact norm)."""

    torch_order: bool = False
    decay_1d_params: bool = True
    clip_norms: tuple[float | None, ...] | None = None

    @property
    def is_spec(self) -> bool:
        return not self.torch_order and self.decay_1d_params and self.clip_norms is None

    @classmethod
    def for_behaviour(cls, behaviour: Mapping[Behaviour, DocumentedBehaviour],
                      clip_norms: Sequence[float | None] = ()) -> ReferenceRule:
        """The rule modelling ``behaviour``; ``clip_norms``: the candidate's norms per step
        (used where it documents its own norm)."""
        own_norm = Behaviour.PARTIAL_SUM_GRAD_NORM in behaviour
        return cls(torch_order=Behaviour.TORCH_ADAMW_ORDER in behaviour,
                   decay_1d_params=Behaviour.NO_DECAY_ON_1D_PARAMS not in behaviour,
                   clip_norms=tuple(clip_norms) if own_norm else None)


SPEC = ReferenceRule()


@dataclass
class OptimReference:
    """refgrad's run: per step losses [replica][microbatch], reduced grads, params, state.

    ``spec_state``: with a non-spec :class:`ReferenceRule`, per step what ``refgrad.optim``
    would have made of the same state and grads (empty under the spec); ``decayed_state``:
    with a rule that leaves 1-D params undecayed, what the same rule would have made of them
    had it decayed them (the distance that behaviour alone puts between the two)."""

    losses: list[list[list[float]]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    state: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    # per step, what refgrad's optimizer did: the same record a candidate reports. refgrad
    # always takes the norm (exact, rounded to fp64), so grad_norm is never None here: it is
    # NaN where the grads hold NaN/inf (the value a candidate's norm takes there, compared as
    # such), not "took none".
    steps: list[StepOutcome] = field(default_factory=list)
    max_norm: float | None = None
    spec_state: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    decayed_state: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    mxfp8: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)


def _state_tensors(st: ParamState, shape: torch.Size) -> dict[str, torch.Tensor]:
    zeros = [Fraction(0)] * len(st.master)  # moments before the first update that happened
    return {"master": to_tensor(st.master, shape), "exp_avg": to_tensor(st.exp_avg or zeros, shape),
            "exp_avg_sq": to_tensor(st.exp_avg_sq or zeros, shape)}


def _hypers(shapes: Sequence[torch.Size], rule: ReferenceRule, schedule: HyperparameterSchedule,
            update: int) -> list[AdamW]:
    """Every param's AdamW for update ``update`` (the updates before it; a skipped step does
    not count): the schedule's lr and weight decay, none on 1-D params under ``rule``'s
    no-decay behaviour."""
    h, lr, weight_decay = TWIN_ADAMW, schedule.lr(update), schedule.weight_decay(update)
    return [AdamW(lr=lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                  weight_decay=weight_decay if rule.decay_1d_params or len(shape) > 1 else 0.0)
            for shape in shapes]


def reference_with_optimizer(case: PipelineCase, optim: AdamWTwin | None = None, *,
                             param_values: Callable[[torch.Tensor], torch.Tensor] | None = None,
                             rule: ReferenceRule = SPEC) -> OptimReference:
    """The whole model in one process: microbatch-ordered sums, DP reduction, exact AdamW.

    ``param_values(master)``: what the forward computes with, given an fp32 master tensor
    (None: the master itself). It is applied twice to the initial weights (the params are
    built from them, then published from the masters, which start as the built params) and
    once after every step (MXFP8 params). ``rule``: the spec, or refgrad's model of a
    candidate's documented optimizer behaviour."""
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
    shapes = [named[n].shape for n in names]
    scaler = ReferenceScaler(optim.loss_scale, min_scale=optim.min_loss_scale if optim.dynamic
                             else optim.loss_scale, window=optim.window, hysteresis=optim.hysteresis)
    out = OptimReference(max_norm=optim.max_grad_norm)
    updates = 0  # AdamW's step count: a skipped step (NaN/inf grads) does not count
    for step, plan in enumerate(case.plans):
        scale = scaler.scale
        if precision.mixed:  # the scaled 16-bit backward itself (it may overflow)
            per_replica, step_losses = replica_grad_sums(
                spec, stages, named, head, step, plan.num_microbatches, case.dp_size,
                grad_dtype=precision.grad_dtype, loss_scale=scale)
            reduced = reduce_and_tie(spec, per_replica, case.reduction)
        else:
            per_replica, step_losses = replica_grad_sums(
                spec, stages, named, head, step, plan.num_microbatches, case.dp_size)
            reduced = reduce_and_tie(spec, per_replica, case.reduction)
            if scale is not None:  # what the scaled backward leaves in the buffer (exact: S = 2^k)
                reduced = {n: g * scale for n, g in reduced.items()}
        shared = [spec.tied_embedding and n == head_name for n in names]
        ordered = [states[n] for n in names]
        grads = [reduced[n] for n in names]
        steps = [updates + 1] * len(names)
        spec_hypers = _hypers(shapes, SPEC, optim.schedule, updates)
        hypers = _hypers(shapes, rule, optim.schedule, updates)
        if rule.is_spec:
            stepped, norm = optimizer_step(ordered, grads, spec_hypers, steps, shared=shared,
                                           max_norm=optim.max_grad_norm, loss_scale=scale)
        else:
            spec_states = copy.deepcopy(ordered)
            stepped, norm = optimizer_step(spec_states, grads, spec_hypers, steps, shared=shared,
                                           max_norm=optim.max_grad_norm, loss_scale=scale)
            out.spec_state.append({n: _state_tensors(st, named[n].shape)
                                   for n, st in zip(names, spec_states)})
            if not rule.decay_1d_params:
                decayed = copy.deepcopy(ordered)
                _production_step(rule, step, decayed, grads, spec_hypers, steps, norm,
                                 optim.max_grad_norm, scale)
                out.decayed_state.append({n: _state_tensors(st, named[n].shape)
                                          for n, st in zip(names, decayed)})
            stepped = _production_step(rule, step, ordered, grads, hypers, steps, norm,
                                       optim.max_grad_norm, scale)
        coef = None
        if stepped and optim.max_grad_norm is not None:
            coef = float(clip_coefficient(norm, optim.max_grad_norm))
        out.steps.append(StepOutcome(stepped=stepped, grad_norm=math.nan if norm is None else float(norm),
                                     clip_coefficient=coef, loss_scale=scale))
        scaler.update(found_inf=not stepped)
        updates += stepped
        state_now = {}
        with torch.no_grad():
            for n in names:
                shape, st = named[n].shape, states[n]
                # The master rounded once to the param's dtype (the identity for fp32), or
                # what the forward computes with (MXFP8: quantized, then dequantized).
                if param_values is None:
                    named[n].copy_(to_tensor(st.master, shape, named[n].dtype))
                else:
                    named[n].copy_(publish(to_tensor(st.master, shape)))
                state_now[n] = _state_tensors(st, shape)
        out.losses.append(step_losses)
        out.grads.append(reduced)
        out.params.append({n: p.detach().clone() for n, p in named.items()})
        out.state.append(state_now)
    return out


def _production_step(rule: ReferenceRule, step: int, states: list[ParamState],
                     grads: list[torch.Tensor], hypers: list[AdamW], steps: list[int],
                     exact_norm: Fraction | None, max_norm: float | None,
                     scale: float | None) -> bool:
    """One step of refgrad's model of a candidate's documented optimizer behaviour."""
    if not rule.torch_order:
        raise ValueError("refgrad models a documented optimizer behaviour only in "
                         "torch.optim.AdamW's order (refgrad.optim_torch)")
    norm = exact_norm
    if rule.clip_norms is not None and max_norm is not None:
        own = rule.clip_norms[step] if step < len(rule.clip_norms) else None
        if own is not None and math.isfinite(own):
            norm = Fraction(own)  # the candidate's own norm (judged on its own)
    if norm is None:  # NaN/inf grads: torch_order_step skips before it needs a norm
        norm = Fraction(0)
    return torch_order_step(states, grads, hypers, steps, norm=norm, max_norm=max_norm,
                            loss_scale=scale, sqrt32=torch_cpu_sqrt)


def _bits_after(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """refgrad's MXFP8 bits of an fp32 master: staged as bf16 (refgrad's rounding), quantized."""
    staged = to_tensor(values(master), tuple(master.shape), torch.bfloat16)
    return RQ.quantize(staged, scale_mode=SCALE_MODE, block_size=BLOCK)


def reference_with_mxfp8(case: PipelineCase, mx: MXFP8Twin, *, rule: ReferenceRule = SPEC
                         ) -> OptimReference:
    """:func:`reference_with_optimizer` whose forward weights are the masters quantized with
    ``refgrad.mxfp8`` (exact) and dequantized; the bits of every step kept for the comparison."""
    bits: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}

    def dequantized(master: torch.Tensor) -> torch.Tensor:
        key = master.contiguous().numpy().tobytes() + repr(tuple(master.shape)).encode()
        if key not in bits:
            bits[key] = _bits_after(master)
        return RQ.dequantize(*bits[key], block_size=BLOCK, dtype=torch.float32)

    out = reference_with_optimizer(case, mx.adamw, param_values=dequantized, rule=rule)
    for state in out.state:
        out.mxfp8.append({n: _bits_after(s["master"]) for n, s in state.items()})
    return out


def reference_for(case: PipelineCase, training: TwinTraining, rule: ReferenceRule = SPEC
                  ) -> OptimReference | ReferenceResult:
    """refgrad's single-process run of the twin's case as ``training`` trains it."""
    match training:
        case MXFP8Twin():
            return reference_with_mxfp8(case, training, rule=rule)
        case AdamWTwin():
            return reference_with_optimizer(case, training, rule=rule)
        case SGDTwin():
            return reference_training(case.spec, case.plans, case.dp_size, lr=case.lr,
                                      reduction=case.reduction)
    raise TypeError(f"not a twin training variant: {type(training).__name__}")

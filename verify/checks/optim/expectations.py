"""What the ``optim`` check (and tests/fastgrad/test_optim*.py) expect: refgrad's trajectory.

The DDP reduction of the ranks' grads is refgrad's reduce-scatter spec; the step
is ``refgrad.optim.optimizer_step`` (exact arithmetic, one rounding per op) with each
update's lr and weight decay from the case's schedule (``cases.SCHEDULES``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction

import torch

from gradvocab import Averaging
from refgrad import formats
from refgrad import optim as R
from refgrad import reduce_scatter as RS
from refgrad.optim_torch import torch_order_step
from verify.candidates.interfaces import HyperparameterSchedule
from verify.checks.optim.cases import (
    ADAMW,
    NAMES,
    SGD,
    SHAPES,
    SHARED,
    averaging_at,
    coefficient,
    initial,
)


def reduced_grads(world: int, step: int, dtypes, *, averaging: Averaging, grad_fp32=False,
                  loss_scale=1.0, inf_at=None, seed=0) -> tuple[torch.Tensor, ...]:
    """Per param: the DDP reduction of the ranks' grads, by refgrad's reduce-scatter spec.

    The grads are multiples of 1/8 (times a power-of-two loss scale), so every
    partial sum is exact and the rank order used here is also gloo's result.
    ``averaging``: ``Averaging.SUM``, or ``Averaging.PRESCALE`` (torch's ``1/dp`` pre-scale,
    exact only for power-of-two dp); the others are not modelled here (ValueError).
    Memoised: the refgrad reductions are slow and shared by several cases.
    """
    if not isinstance(averaging, Averaging):
        raise TypeError(f"reduced_grads: averaging must be an Averaging, got {averaging!r}")
    if averaging not in (Averaging.SUM, Averaging.PRESCALE):
        raise ValueError(f"reduced_grads: averaging {averaging.name} is not modelled: the optim "
                         f"check's reference sums or pre-scales by 1/dp (SUM or PRESCALE)")
    return _reduced_grads(world, step, tuple(dtypes.items()), averaging, grad_fp32, loss_scale,
                          inf_at, seed)


@functools.lru_cache(maxsize=512)
def _reduced_grads(world, step, dtype_items, averaging, grad_fp32, loss_scale, inf_at, seed):
    dtypes = dict(dtype_items)
    out = []
    for i, name in enumerate(NAMES):
        gdtype = torch.float32 if grad_fp32 else dtypes[name]
        per_rank = [
            (coefficient(r, step, i, name, inf_at, seed) * loss_scale)
            .to(dtypes[name]).to(gdtype).reshape(-1)
            for r in range(world)
        ]
        if averaging is Averaging.PRESCALE:
            per_rank = RS.prescale_like_torch(per_rank, 1.0 / world)
        out.append(RS.all_reduce(per_rank, accumulate="wire", order="rank")[0])
    return tuple(out)


def param_loss_grads(world: int, step: int, dtypes, states, *, grad_fp32=False, seed=0):
    """Per param: the DDP reduction of ``Leaf``'s ``param_loss`` grads, ``c + p/2`` with ``p``
    the published param (the master rounded to the param dtype), by refgrad: one fp32 rounding
    of the sum, then the param dtype's; 1/2 pre-scale (exact) and a two-term sum (one rounding
    in any order) at DP 2."""
    if world > 2:
        raise ValueError("param_loss_grads: DP <= 2 only (see verify.checks.optim.cases)")
    out = []
    for i, (name, state) in enumerate(zip(NAMES, states)):
        fmt = formats.format_of(dtypes[name])
        gdtype = torch.float32 if grad_fp32 else dtypes[name]
        published = [formats.value_to_fraction(formats.round_to_value(fmt, m)) for m in state.master]
        per_rank = []
        for r in range(world):
            c = R.values(coefficient(r, step, i, name, seed=seed).float())
            local = [formats.round_to_value(fmt, R.r32(ci + R.r32(p / 2))) for ci, p in zip(c, published)]
            per_rank.append(formats.round_values_to_tensor(fmt, local).to(gdtype))
        if world == 2:
            per_rank = RS.prescale_like_torch(per_rank, 0.5)
        out.append(RS.all_reduce(per_rank, accumulate="wire", order="rank")[0])
    return tuple(out)


def torch_cpu_sqrt(v: Fraction) -> Fraction:
    """torch's CPU fp32 square root of one value (the platform's; not always correctly rounded)."""
    return Fraction(float(torch.tensor(float(v), dtype=torch.float32).sqrt()))


@dataclass(frozen=True)
class ProductionModel:
    """refgrad's model of a candidate's documented optimizer: the step in torch.optim's order
    (``refgrad.optim_torch``, torch's CPU square root), clipped with the candidate's own grad
    norm of each step (``norms``; None: refgrad's exact one)."""

    norms: tuple[float | None, ...] | None = None
    # clipped with torch.nn.utils' coefficient (Behaviour.TORCH_CLIP_COEFFICIENT)
    torch_clip: bool = False

    def norm(self, k: int) -> float | None:
        return None if self.norms is None or k >= len(self.norms) else self.norms[k]


def _model_step(states, grads, hypers, steps, *, clip, scale, production: ProductionModel, k: int):
    """One step of ``production``'s model: returns ``(stepped, the norm it clipped with)``."""
    norm = None
    if clip is not None:
        observed = production.norm(k)
        if observed is not None:
            norm = Fraction(observed)
        else:
            prepared = R.prepare_grads(grads, loss_scale=scale)
            norm = None if prepared is None else R.global_norm(
                [g for g, s in zip(prepared, SHARED) if not s])
    stepped = torch_order_step(states, grads, hypers, steps, norm=norm, max_norm=clip,
                               loss_scale=scale, sqrt32=torch_cpu_sqrt,
                               torch_clip=production.torch_clip)
    return stepped, norm


def step_hypers(algorithm: str, schedule: HyperparameterSchedule | None, update: int) -> list:
    """refgrad's hyper-parameters of every param (``NAMES`` order) for update ``update`` (the
    updates before it; skipped steps do not count): ``ADAMW`` / ``SGD`` with the schedule's lr
    and weight decay of that update (None: constant), no weight decay on 1-D params."""
    base = ADAMW if algorithm == "adamw" else SGD
    if schedule is not None:
        base = {**base, "lr": schedule.lr(update), "weight_decay": schedule.weight_decay(update)}
    kind = R.AdamW if algorithm == "adamw" else R.SGD
    hyper, no_decay = kind(**base), kind(**{**base, "weight_decay": 0.0})
    return [no_decay if len(SHAPES[n]) == 1 else hyper for n in NAMES]


def reference_trajectory(worlds, dtypes, algorithm, *, clip=None,
                         averaging: Averaging = Averaging.PRESCALE, grad_fp32=False,
                         scales=None, inf_at=None, start=None, first_step_id=0, seed=0,
                         param_loss=False, production: ProductionModel | None = None,
                         schedule: HyperparameterSchedule | None = None):
    """refgrad.optim fed the reduced grads of each step; a snapshot after every step.

    ``worlds[k]``: the DP size of step k (grads differ per DP size).
    ``scales[k]``: the loss scale of step k. ``start``: (states, steps) to resume from
    (updated in place); ``first_step_id``: the data index of the first step.
    ``param_loss``: the grads depend on the published params (``param_loss_grads``).
    The tied copy (``cases.SHARED``) is left out of the norm. Each snapshot holds the
    exact global norm (``grad_norm``, None on a skipped step).
    ``production``: the trajectory of refgrad's model of a candidate's documented optimizer
    instead of the spec's (``grad_norm`` is then the norm it clipped with).
    ``schedule``: each update's lr and weight decay (None: ``ADAMW`` / ``SGD``'s), indexed by
    the updates made so far (``steps``, which a resume carries).
    Returns ``(snapshots, (states, steps))``.
    """
    if start is None:
        states = [R.ParamState(master=R.values(initial(i, n, seed).to(dtypes[n]).float()))
                  for i, n in enumerate(NAMES)]
        steps = 0
    else:
        states, steps = start
    snapshots = []
    for k, world in enumerate(worlds):
        scale = None if scales is None else scales[k]
        step_id = first_step_id + k
        if param_loss:
            if scale is not None or inf_at is not None:
                raise ValueError("param_loss runs without loss scaling and without an inf")
            grads = param_loss_grads(world, step_id, dtypes, states, grad_fp32=grad_fp32, seed=seed)
        else:
            grads = reduced_grads(world, step_id, dtypes, averaging=averaging, grad_fp32=grad_fp32,
                                  loss_scale=1.0 if scale is None else scale, inf_at=inf_at, seed=seed)
        hypers = step_hypers(algorithm, schedule, steps)
        if production is None:
            stepped, norm = R.optimizer_step(states, grads, hypers, [steps + 1] * len(NAMES),
                                             max_norm=clip, loss_scale=scale, shared=list(SHARED))
        else:
            stepped, norm = _model_step(states, grads, hypers, [steps + 1] * len(NAMES), clip=clip,
                                        scale=scale, production=production, k=k)
        steps += stepped
        snapshots.append({"stepped": stepped, "steps": steps,
                          "grad_norm": None if norm is None else float(norm),
                          **expected_tensors(states, dtypes)})
    return snapshots, (states, steps)


def expected_tensors(states, dtypes) -> dict:
    """refgrad's states as tensors: model params (rounded to their dtype) and fp32 state."""
    out = {"params": {}, "state": {}}
    for n, s in zip(NAMES, states):
        shape = SHAPES[n]
        out["params"][n] = R.to_tensor(s.master, shape, dtypes[n])
        entry = {"master": R.to_tensor(s.master, shape)}
        for key in ("exp_avg", "exp_avg_sq"):
            if getattr(s, key) is not None:
                entry[key] = R.to_tensor(getattr(s, key), shape)
        if s.momentum is not None:
            entry["momentum_buffer"] = R.to_tensor(s.momentum, shape)
        out["state"][n] = entry
    return out


def case_trajectory(case, seed: int, start=None, first_step_id: int = 0, worlds=None,
                    production: ProductionModel | None = None):
    """refgrad's trajectory for an ``OptimCase`` (optionally resumed / at other DP sizes;
    ``production``: of refgrad's model of the candidate's documented optimizer)."""
    steps = case.steps - first_step_id if worlds is None else len(worlds)
    worlds = [case.dp] * steps if worlds is None else worlds
    scales = case.scales()
    return reference_trajectory(
        worlds, case.dtypes, case.algorithm, clip=case.clip,
        # one averaging for the whole trajectory: the pre-scale only where every DP has it
        averaging=(Averaging.PRESCALE if all(averaging_at(w) is Averaging.PRESCALE for w in worlds)
                   else Averaging.SUM),
        grad_fp32=case.main_grads_fp32,
        scales=None if scales is None else scales[first_step_id:first_step_id + steps],
        inf_at=case.inf_at, start=start, first_step_id=first_step_id, seed=seed,
        param_loss=case.param_loss, production=production, schedule=case.schedule,
    )


"""Megatron-Core's distributed optimizer step (``optim`` driver) vs refgrad, step after step.

The spec is ``refgrad.optim.optimizer_step`` on whole params: the DP mean of the ranks'
gradients (``refgrad.pipeline.reduce_across_replicas``, pre-scaled as production does:
exact at DP 2), unscaled by the loss scale, the exact global norm, clipping
``max_norm / (norm + 1e-6)``, AdamW in refgrad's order with the configured weight decay
on every parameter. Megatron-Core differs by design in three documented ways, modelled
together as one production model:

* its inner optimizer is ``torch.optim.AdamW`` when neither Transformer Engine nor apex
  is installed (``megatron/core/optimizer/__init__.py``): ``refgrad.optim_torch``'s order,
  with torch's CPU fp32 square root (an elementary function of the platform);
* ``get_standard_config_overrides`` gives 1-D params and biases ``wd_mult = 0``, applied
  by ``OptimizerParamScheduler.step`` (no weight decay on them);
* its grad norm is an fp32 partial-sum norm (``optimizer/clip_grads.py``
  ``get_grad_norm_fp32`` with ``utils.local_multi_tensor_l2_norm``: per-shard fp32 norms,
  their norm, squared, summed over ranks in fp32, square root in fp64). It is judged on its
  own against the exact norm, within the relative bound ``γ(n + k + R + 8)`` (``u = 2^-24``;
  every rounding in that chain acts on non-negative terms, so each adds at most ``u``
  relative error along the longest chain of ``n`` elements, ``k`` shards and ``R``
  ranks), and then the production model clips with production's own norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import torch

from refgrad.deferred_wgrad import gamma
from refgrad.formats import FLOAT32
from refgrad.optim import AdamW, ParamState, optimizer_step, to_tensor, values
from refgrad.optim_torch import torch_order_step
from refgrad.pipeline import reduce_across_replicas
from verify.candidates.megatron_core.findings import Finding, Model, Verdict, classify
from verify.candidates.megatron_core.optim import OptimCase, initial_param, run_optim

TECHNIQUE = "optim"
PRODUCTION_WHERE = ("megatron/core/optimizer/__init__.py (torch.optim.AdamW fallback; "
                    "get_standard_config_overrides: wd_mult 0 for 1-D params and biases, applied by "
                    "optimizer_param_scheduler.py OptimizerParamScheduler.step)")
NORM_WHERE = ("megatron/core/optimizer/clip_grads.py get_grad_norm_fp32 with "
              "megatron/core/utils.py local_multi_tensor_l2_norm")


def torch_cpu_sqrt(v: Fraction) -> Fraction:
    """torch's CPU fp32 square root of one value (not always correctly rounded)."""
    return Fraction(float(torch.tensor(float(v), dtype=torch.float32).sqrt()))


def reduced_grads(case: OptimCase, ranks: Sequence[dict], step: int) -> list[torch.Tensor]:
    """Per param, the DP-reduced main grad: each rank's ``c_p · S`` added into a zeroed
    buffer of the grad dtype, pre-scaled by 1/DP and summed (refgrad.pipeline)."""
    grad_dtype = torch.float32 if case.grad_reduce_in_fp32 else case.param_dtype
    scale = ranks[0]["steps"][step]["loss_scale"]
    out = []
    for i in range(len(case.shapes)):
        per_rank = []
        for r in ranks:
            c = r["steps"][step]["grads"][i]
            scaled = (c * scale).to(case.param_dtype) if scale != 1.0 else c
            per_rank.append(torch.zeros(case.shapes[i], dtype=grad_dtype).add_(scaled.to(grad_dtype)))
        out.append(reduce_across_replicas(per_rank, "prescale"))
    return out


def _hypers(case: OptimCase, production: bool) -> list[AdamW]:
    return [AdamW(lr=case.lr, beta1=case.adam_beta1, beta2=case.adam_beta2, eps=case.adam_eps,
                  weight_decay=0.0 if production and len(shape) == 1 else case.weight_decay)
            for shape in case.shapes]


def _assembled_masters(case: OptimCase, ranks: Sequence[dict], step: int) -> list[torch.Tensor]:
    out = []
    for i, shape in enumerate(case.shapes):
        full = torch.full((torch.Size(shape).numel(),), float("nan"))
        for r in ranks:
            owned = r["steps"][step]["owned"].get(i)
            if owned is not None:
                lo, hi = owned["range"]
                full[lo:hi] = owned["main"]
        out.append(full)
    return out


STALE_WHERE = ("megatron/core/distributed/distributed_data_parallel.py "
               "DistributedDataParallel._make_forward_pre_hook: with overlap_param_gather the wait "
               "for a bucket's param all-gather happens only in the forward pre-hook of a module "
               "that owns the params (parameters(recurse=False)); a documented contract, silent "
               "when broken")


def _stale_model(cast: torch.Tensor, rank: dict, step: int, index: int) -> torch.Tensor | None:
    """This rank's own pieces updated, the others as the forward saw them at ``step``."""
    owned = rank["steps"][step]["owned"].get(index)
    previous = rank["steps"][step]["params"][index].flatten().clone()
    if owned is not None:
        lo, hi = owned["range"]
        previous[lo:hi] = cast.flatten()[lo:hi]
    return previous.reshape(cast.shape)


def norm_finding(case: OptimCase, step: int, observed: float, exact: Fraction, numel: int) -> Finding:
    name = f"{case.label()} step {step}: grad norm"
    if Fraction(observed) == exact:
        return Finding(TECHNIQUE, name, Verdict.MATCH)
    bound = gamma(numel + len(case.shapes) + case.dp_size + 8, FLOAT32.unit_roundoff)
    rel = abs(Fraction(observed) - exact) / exact if exact else Fraction(0)
    detail = f"relative error {float(rel):.3g} vs the bound {float(bound):.3g}"
    if rel <= bound:
        return Finding(TECHNIQUE, name, Verdict.PRODUCTION,
                       f"fp32 partial-sum norm, not the exact one: {detail}", NORM_WHERE)
    return Finding(TECHNIQUE, name, Verdict.BUG, detail)


def case_findings(case: OptimCase, ranks: Sequence[dict]) -> list[Finding]:
    findings = []
    spec_states = [ParamState(master=values(initial_param(case, i).float()))
                   for i in range(len(case.shapes))]
    prod_states = [ParamState(master=list(s.master)) for s in spec_states]
    numel = max(torch.Size(s).numel() for s in case.shapes)
    loss_scale = case.initial_loss_scale
    for step in range(case.steps):
        record = ranks[0]["steps"][step]
        grads = reduced_grads(case, ranks, step)
        t = [step + 1] * len(case.shapes)
        max_norm = case.clip_grad if case.clip_grad > 0 else None
        stepped, exact = optimizer_step(spec_states, grads, _hypers(case, False), t,
                                        max_norm=max_norm, loss_scale=loss_scale)
        findings.append(Finding(TECHNIQUE, f"{case.label()} step {step}: step taken",
                                Verdict.MATCH if record["ok"] == stepped else Verdict.BUG,
                                "" if record["ok"] == stepped else
                                f"Megatron stepped={record['ok']}, refgrad stepped={stepped}"))
        if max_norm is not None and exact is not None:
            norm = Fraction(record["grad_norm"])
            findings.append(norm_finding(case, step, record["grad_norm"], exact, numel))
        else:
            norm = None
        torch_order_step(prod_states, grads, _hypers(case, True), t, norm=norm,
                         max_norm=max_norm, loss_scale=loss_scale, sqrt32=torch_cpu_sqrt)
        observed = _assembled_masters(case, ranks, step)
        for i, shape in enumerate(case.shapes):
            n = torch.Size(shape).numel()
            findings.append(classify(
                TECHNIQUE, f"{case.label()} step {step}: fp32 main param {i} {tuple(shape)}",
                observed[i], to_tensor(spec_states[i].master, (n,)),
                [Model("torch.optim.AdamW's order, no weight decay on 1-D params, clipped with "
                       "production's norm", to_tensor(prod_states[i].master, (n,)),
                       PRODUCTION_WHERE)]))
        for i, shape in enumerate(case.shapes):
            cast = observed[i].to(case.param_dtype).reshape(shape)
            for r in ranks:
                params = (r["steps"][step + 1]["params"] if step + 1 < case.steps else r["final"])
                stale = _stale_model(cast, r, step, i)
                findings.append(classify(
                    TECHNIQUE, f"{case.label()} step {step}: param {i} after the all-gather on "
                    f"DP rank {r['dp_rank']} = its main param rounded to {case.param_dtype}",
                    params[i], cast,
                    [Model("STALE: the pieces other ranks own still hold this step's input "
                           "values (the all-gather was never waited for: these params are read "
                           "outside their owning module's forward, where DDP's pre-hook waits)",
                           stale, STALE_WHERE)] if stale is not None else ()))
    return findings


def default_cases(quick: bool = False) -> list[OptimCase]:
    cases = [OptimCase(), OptimCase(overlap_param_gather=True),
             OptimCase(param_dtype=torch.float16, initial_loss_scale=2.0**10, grad_scale=0.5),
             OptimCase(param_dtype=torch.float32, clip_grad=0.0, weight_decay=0.0),
             OptimCase(overlap_param_gather=True, call_owning_modules=False)]
    return cases[:2] if quick else cases


def run(quick: bool = False, *, timeout_s: float = 240.0) -> list[Finding]:
    findings = []
    for case in default_cases(quick):
        findings.extend(case_findings(case, run_optim(case, timeout_s=timeout_s)))
    return findings

"""The reference training loop for gradient sync in pipeline bubbles (REFERENCE_NOTES section 5).

The pipelined, data-parallel training step must compute exactly what this one
process computes, in this order:

1. for each data-parallel replica ``d``, run its microbatches one after the
   other through the *whole* model (all stages in one autograd graph);
2. sum each parameter's per-microbatch gradients in microbatch order, in the
   grad dtype (fp32), starting from zeros: ``acc = acc + g_m``
   (``refgrad.pipeline.grad_sums``);
3. reduce the per-replica sums across replicas with ``refgrad.reduce_scatter``
   (rank-order fp32 sum; for ``D <= 2`` the correctly rounded sum), summed,
   averaged in the collective, or pre-scaled by ``1/D`` as production does,
   then the TP and tied-embedding sums (``refgrad.pipeline.reduction``);
4. an SGD step ``p = p - lr * g`` with two visible fp32 roundings, skipping
   frozen parameters.

The model is a small deterministic stack of ``Linear`` + ``tanh`` layers split
evenly across ``num_stages`` stages; its weights, inputs and targets come from
seeded generators, so the pipelined run can rebuild exactly the same tensors on
each stage. A frozen parameter (``requires_grad=False``) gets no gradient: its
reduced gradient is zero and it is not updated.

The same steps with 16-bit params and a grad-dtype buffer (``refgrad.pipeline.precision``),
stepped by ``refgrad.optim``, model production's ``--bf16`` and ``--fp16`` training.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from gradvocab import Averaging
from refgrad.pipeline.grad_sums import replica_grad_sums
from refgrad.pipeline.model import StageModule
from refgrad.pipeline.reduction import check_reduction, reduce_and_tie
from refgrad.pipeline.spec import (
    HEAD_PARAM,
    LinearStackSpec,
    StepPlan,
    head_weight_init,
    positive_int,
    stage_param_name,
)


@dataclass
class ReferenceResult:
    """Per step: losses ``[dp][microbatch]``, reduced grads, params after the update,
    and each replica's microbatch-ordered grad sum before the DP reduction."""

    losses: list[list[list[float]]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    replica_sums: list[list[dict[str, torch.Tensor]]] = field(default_factory=list)


def sgd_update(param: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """``param - lr * grad`` with two separate fp32 roundings (no fused multiply-add)."""
    return torch.sub(param, torch.mul(grad, lr))


def updated_once(named: dict[str, torch.nn.Parameter], frozen: Iterable[str]
                 ) -> list[torch.nn.Parameter]:
    """The params :func:`sgd_update` steps after a step of ``named`` (refgrad's names): each
    once (a shared weight has two names), none of the ``frozen`` ones."""
    frozen = set(frozen)
    out: list[torch.nn.Parameter] = []
    for name, param in named.items():
        if name not in frozen and all(param is not seen for seen in out):
            out.append(param)
    return out


def reference_training(
    spec: LinearStackSpec,
    plans: Sequence[StepPlan],
    dp_size: int,
    *,
    lr: float = 0.05,
    reduction: Averaging = Averaging.SUM,
) -> ReferenceResult:
    """Run ``plans`` (one per step) on the whole model in one process; see the module doc."""
    positive_int("reference_training", "dp_size", dp_size)
    check_reduction(reduction)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr):
        raise ValueError(f"lr must be a finite number, got {lr!r}")
    stages = [StageModule(spec, s) for s in range(spec.num_stages)]
    named = {
        stage_param_name(s, n): p for s, stage in enumerate(stages) for n, p in stage.named_parameters()
    }
    head_name = stage_param_name(spec.num_stages - 1, HEAD_PARAM)
    head = None
    if spec.output_head:
        head = head_weight_init(spec).requires_grad_(True)
        named[head_name] = head
    result = ReferenceResult()
    for step, plan in enumerate(plans):
        unknown = sorted(set(plan.frozen) - set(named))
        if unknown:
            raise ValueError(f"StepPlan.frozen names unknown parameters: {unknown}")
        for name, p in named.items():
            p.requires_grad_(name not in plan.frozen)
        per_replica_sums, step_losses = replica_grad_sums(
            spec, stages, named, head, step, plan.num_microbatches, dp_size)
        reduced = reduce_and_tie(spec, per_replica_sums, reduction)
        with torch.no_grad():
            for name, p in named.items():
                p.grad = None
                if name not in plan.frozen:
                    p.copy_(sgd_update(p, reduced[name], lr))
        result.losses.append(step_losses)
        result.grads.append(reduced)
        result.replica_sums.append(per_replica_sums)
        result.params.append({name: p.detach().clone() for name, p in named.items()})
    return result

"""Reference for gradient sync in pipeline bubbles (REFERENCE_NOTES section 5).

The pipelined, data-parallel training step must compute exactly what this one
process computes, in this order:

1. for each data-parallel replica ``d``, run its microbatches one after the
   other through the *whole* model (all stages in one autograd graph);
2. sum each parameter's per-microbatch gradients in microbatch order, in the
   grad dtype (fp32), starting from zeros: ``acc = acc + g_m``;
3. reduce the per-replica sums across replicas with ``refgrad.reduce_scatter``
   (rank-order fp32 sum; for ``D <= 2`` the correctly rounded sum), summed,
   averaged in the collective, or pre-scaled by ``1/D`` as production does;
4. an SGD step ``p = p - lr * g`` with two visible fp32 roundings, skipping
   frozen parameters.

The model is a small deterministic stack of ``Linear`` + ``tanh`` layers split
evenly across ``num_stages`` stages; its weights, inputs and targets come from
seeded generators, so the pipelined run can rebuild exactly the same tensors on
each stage. A frozen parameter (``requires_grad=False``) gets no gradient: its
reduced gradient is zero and it is not updated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from gradvocab.averaging import Averaging
from refgrad.exact import correctly_rounded_sum
from refgrad.pipeline_embedding import VocabParallelFirstLayer
from refgrad.pipeline_spec import (  # noqa: F401  (re-exported: one import site for the model)
    EMBEDDING_PARAM,
    HEAD_PARAM,
    HeadRecordingWgrad,
    LinearStackSpec,
    StepPlan,
    head_weight_init,
    layer_init,
    microbatch_data,
    microbatch_loss,
    positive_int,
    sgd_update,
    stage_param_name,
)
from refgrad.pipeline_tp import sum_over_tensor_parallel, tp_replica_grad_sums
from refgrad.reduce_scatter import all_reduce, prescale_like_torch


class StageModule(nn.Module):
    """One pipeline stage: ``spec.layers_on(stage)`` Linear layers, tanh between them."""

    def __init__(self, spec: LinearStackSpec, stage: int) -> None:
        super().__init__()
        if not 0 <= stage < spec.num_stages:
            raise ValueError(f"stage must be in [0, {spec.num_stages}), got {stage}")
        self.final_activation = stage != spec.num_stages - 1
        self.layers = nn.ModuleList()
        for layer in range(spec.layers_on(stage)):
            weight, bias = layer_init(spec, stage, layer)
            if stage == 0 and layer == 0 and spec.vocab_parallel_embedding:
                self.layers.append(VocabParallelFirstLayer(spec, weight, bias))
                continue
            linear = nn.Linear(spec.hidden, spec.hidden)
            with torch.no_grad():
                linear.weight.copy_(weight)
                linear.bias.copy_(bias)
            self.layers.append(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._after_first_layer(self.layers[0](x))

    def after_embedding(self, embedded: torch.Tensor) -> torch.Tensor:
        """The stage given its vocab-parallel first layer's TP-summed product (the rows this
        sequence shard keeps): the first bias, then the rest of the stage."""
        return self._after_first_layer(embedded + self.layers[0].bias)

    def _after_first_layer(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, linear in enumerate(self.layers):
            if i > 0:
                x = linear(x)
            if i < last or self.final_activation:
                x = torch.tanh(x)
        return x


@dataclass
class ReferenceResult:
    """Per step: losses ``[dp][microbatch]``, reduced grads, params after the update,
    and each replica's microbatch-ordered grad sum before the DP reduction."""

    losses: list[list[list[float]]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    replica_sums: list[list[dict[str, torch.Tensor]]] = field(default_factory=list)


# The ways refgrad reduces across replicas (a pipeline's DP sync never post-scales).
REDUCTIONS = (Averaging.SUM, Averaging.AVG, Averaging.PRESCALE)


def _check_reduction(reduction: Averaging) -> None:
    if not isinstance(reduction, Averaging) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of Averaging.SUM, .AVG, .PRESCALE, got {reduction!r}")


def reduce_across_replicas(per_replica: Sequence[torch.Tensor], reduction: Averaging) -> torch.Tensor:
    """The reference DP reduction of one parameter's per-replica grads (``refgrad.reduce_scatter``).

    ``reduction``: ``Averaging.SUM`` (fp32 sum in rank order, one rounding per add),
    ``Averaging.AVG`` (that sum divided by ``D`` with one more rounding: ``ReduceOp.AVG``)
    or ``Averaging.PRESCALE`` (each replica's grad multiplied by ``1/D`` as torch does,
    then summed: production's gradient scaling factor before a SUM). For
    ``D <= 2`` the rank-order sum is the correctly rounded sum, which any
    all-reduce algorithm produces.
    """
    _check_reduction(reduction)
    if not per_replica:
        raise ValueError("per_replica must hold at least one tensor")
    if len(per_replica) == 1:
        # A reduction over one replica is that replica (x * 1.0 and x / 1 are exact).
        return per_replica[0].clone()
    shape = per_replica[0].shape
    world = len(per_replica)
    numel = per_replica[0].numel()
    padded = -(-numel // world) * world
    flat = []
    for t in per_replica:
        f = torch.zeros(padded, dtype=t.dtype)
        f[:numel] = t.reshape(-1)
        flat.append(f)
    factors = reduction.factors(world)
    if factors.pre_scale is not None:
        flat = prescale_like_torch(flat, factors.pre_scale)
    op = Averaging.from_reduce_op(factors.op)  # the collective's op, SUM or AVG
    reduced = all_reduce(flat, accumulate="fp32", order="rank", op=op)[0]
    return reduced[:numel].reshape(shape)


def replica_grad_sums(
    spec: LinearStackSpec,
    stages: Sequence[nn.Module],
    named: dict[str, torch.Tensor],
    head: torch.Tensor | None,
    step: int,
    num_microbatches: int,
    dp_size: int,
) -> tuple[list[dict[str, torch.Tensor]], list[list[float]]]:
    """Each replica's grads summed in microbatch order (fp32), and its losses, for one step.

    ``named`` maps every parameter name to its tensor (the head too, when ``head`` is
    given: its weight gradient is the recorded ``Gᵀ · X`` of each microbatch, added in
    ``spec.head_wgrad_order``).
    """
    if spec.tensor_parallel > 1:
        return tp_replica_grad_sums(spec, stages, named, head, step, num_microbatches, dp_size)
    head_name = stage_param_name(spec.num_stages - 1, HEAD_PARAM)
    tied_name = stage_param_name(0, EMBEDDING_PARAM)
    per_replica_sums: list[dict[str, torch.Tensor]] = []
    step_losses: list[list[float]] = []
    for dp_rank in range(dp_size):
        inputs, targets = microbatch_data(spec, dp_rank, step, num_microbatches)
        sums = {name: torch.zeros_like(p) for name, p in named.items()}
        losses: list[float] = []
        record: list[tuple[torch.Tensor, torch.Tensor]] = []
        for x, target in zip(inputs, targets):
            for p in named.values():
                p.grad = None
            out = x
            for stage in stages:
                out = stage(out)
            if head is not None:
                out = HeadRecordingWgrad.apply(out, head, record)
            loss = microbatch_loss(out, target, num_microbatches)
            loss.backward()
            losses.append(float(loss.detach()))
            if spec.shares_one_weight:  # the head's wgrad first: the backward reaches it first
                grad_output, head_input = record.pop()
                sums[tied_name] = sums[tied_name] + torch.mm(grad_output.t(), head_input)
            for name, p in named.items():
                if p.grad is not None:  # the head's stays None: HeadRecordingWgrad records it
                    sums[name] = sums[name] + p.grad
        if record:
            for k in spec.head_wgrad_order(num_microbatches):
                grad_output, head_input = record[k]
                sums[head_name] = sums[head_name] + torch.mm(grad_output.t(), head_input)
        if spec.shares_one_weight:
            sums[head_name] = sums[tied_name].clone()  # one parameter, reported under both names
        step_losses.append(losses)
        per_replica_sums.append(sums)
    return per_replica_sums, step_losses


def reduce_and_tie(
    spec: LinearStackSpec, per_replica_sums: Sequence[dict[str, torch.Tensor]], reduction: Averaging
) -> dict[str, torch.Tensor]:
    """The DP reduction of every gradient, then (sequence parallel) the TP sum of the
    replicated blocks' grads, then the tied-embedding all-reduce if tied."""
    reduced = {
        name: reduce_across_replicas([sums[name] for sums in per_replica_sums], reduction)
        for name in per_replica_sums[0]
    }
    if spec.sequence_shards > 1:
        sum_over_tensor_parallel(spec, reduced)
    if spec.tied_embedding and not spec.shares_one_weight:
        # The embedding all-reduce over the first and last stage, after the DP sync.
        head_name = stage_param_name(spec.num_stages - 1, HEAD_PARAM)
        tied_name = stage_param_name(0, EMBEDDING_PARAM)
        tied = correctly_rounded_sum([reduced[tied_name], reduced[head_name]], torch.float32)
        reduced[tied_name] = tied
        reduced[head_name] = tied.clone()
    return reduced


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
    _check_reduction(reduction)
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

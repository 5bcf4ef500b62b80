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

from refgrad.deferred_wgrad import deferred_accumulation_order
from refgrad.exact import correctly_rounded_sum
from refgrad.reduce_scatter import all_reduce, prescale_like_torch


def _positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{owner}.{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class LinearStackSpec:
    """A ``num_stages * layers_per_stage`` stack of ``hidden x hidden`` Linear+tanh layers.

    The last layer of the last stage has no tanh. ``seed`` fixes the weights and
    the data; ``microbatch_size`` is the number of rows per microbatch.
    ``output_head`` appends ``logits = x · W_headᵀ`` (``hidden x hidden``) on the
    last stage, whose weight gradient production defers to the pipeline flush:
    per microbatch ``W_head.main_grad += G_kᵀ · X_k`` (one fp32 GEMM, one fp32
    add, microbatch order). ``tied_embedding`` ties ``W_head`` to the first
    stage's ``layers.0.weight`` (same initial values); after the DP reduction
    both copies become ``fp32(reduced_first + reduced_head)``. On one stage
    (``shares_one_weight``) the two are one parameter: each microbatch adds the
    head's wgrad, then the first layer's grad, into its one sum (at TP > 1 each
    TP rank's row block, ``refgrad.pipeline_tp``). At
    ``tensor_parallel > 1`` that first layer is a vocab-parallel embedding,
    ``x · W + b`` with ``W`` split over TP by rows as the head is
    (``refgrad.pipeline_embedding``), so each TP rank's two copies are tied.
    ``defer_output_wgrad`` and ``wgrad_deferral_limit`` are production's
    ``--defer-embedding-wgrad-compute`` and ``--wgrad-deferral-limit``: with
    ``0 < limit < M`` the first ``limit`` microbatches' head wgrads are added
    at the drain, after the immediate ones (order ``limit..M-1, 0..limit-1``,
    ``refgrad.deferred_wgrad.deferred_accumulation_order``); otherwise in
    microbatch order.
    ``tensor_parallel`` (TP) and ``sequence_parallel`` split the model as
    production does; their model is ``refgrad.pipeline_tp`` (the output head
    vocab-parallel over TP, the Linear+tanh blocks replicated, run on sequence
    shards under sequence parallelism).
    ``stage_layers``, when given, is the number of layers on each stage (one entry per
    stage, each >= 1), as production's uneven pipeline splits give different stages
    different layer counts; empty: ``layers_per_stage`` on every stage.
    """

    num_stages: int
    layers_per_stage: int = 2
    hidden: int = 8
    microbatch_size: int = 4
    seed: int = 0
    output_head: bool = False
    tied_embedding: bool = False
    defer_output_wgrad: bool = True
    wgrad_deferral_limit: int = 0
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    stage_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_stages", "layers_per_stage", "hidden", "microbatch_size",
                     "tensor_parallel"):
            _positive_int("LinearStackSpec", name, getattr(self, name))
        if not isinstance(self.stage_layers, tuple):
            raise TypeError("LinearStackSpec.stage_layers must be a tuple of ints")
        if self.stage_layers:
            if len(self.stage_layers) != self.num_stages:
                raise ValueError(f"LinearStackSpec.stage_layers needs one count per stage "
                                 f"({self.num_stages}), got {len(self.stage_layers)}")
            for count in self.stage_layers:
                _positive_int("LinearStackSpec", "stage_layers[...]", count)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"LinearStackSpec.seed must be an int >= 0, got {self.seed!r}")
        for name in ("output_head", "tied_embedding", "defer_output_wgrad", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LinearStackSpec.{name} must be a bool")
        if self.output_head and self.num_stages < 2 and self.defer_output_wgrad:
            raise ValueError("LinearStackSpec.output_head with defer_output_wgrad needs "
                             "num_stages >= 2 (the wgrad is deferred to the pipeline flush)")
        limit = self.wgrad_deferral_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"LinearStackSpec.wgrad_deferral_limit must be an int >= 0 "
                             f"(0 = defer every microbatch), got {limit!r}")
        if self.tied_embedding and not self.output_head:
            raise ValueError("LinearStackSpec.tied_embedding needs output_head=True")
        if self.tensor_parallel > 1:
            from refgrad.pipeline_tp import validate_tensor_parallel

            validate_tensor_parallel(self)
        elif self.sequence_parallel:
            raise ValueError("LinearStackSpec.sequence_parallel needs tensor_parallel > 1")

    def layers_on(self, stage: int) -> int:
        """How many Linear layers ``stage`` has."""
        return self.stage_layers[stage] if self.stage_layers else self.layers_per_stage

    def head_wgrad_order(self, num_microbatches: int) -> list[int]:
        """The microbatch order in which the head's wgrads are added into its ``main_grad``."""
        if not self.defer_output_wgrad:
            return list(range(num_microbatches))
        return deferred_accumulation_order(num_microbatches, self.wgrad_deferral_limit)

    @property
    def activation_shape(self) -> tuple[int, int]:
        """Shape of one microbatch's inputs and targets (every row)."""
        return (self.microbatch_size, self.hidden)

    @property
    def vocab_parallel_embedding(self) -> bool:
        """Tied at TP > 1: the first stage's first layer is a vocab-parallel embedding tied to
        the head (``refgrad.pipeline_embedding``)."""
        return self.tied_embedding and self.tensor_parallel > 1

    @property
    def shares_one_weight(self) -> bool:
        """Tied on one stage (production's PP 1): the first layer and the head are ONE
        parameter; per microbatch the head's wgrad is added into its grad, then the first
        layer's (the backward reaches the head first), and there is no embedding all-reduce."""
        return self.tied_embedding and self.num_stages == 1

    @property
    def sequence_shards(self) -> int:
        """How many row shards the blocks run on: the TP size under sequence parallelism."""
        return self.tensor_parallel if self.sequence_parallel else 1

    @property
    def stage_activation_shape(self) -> tuple[int, int]:
        """Shape of the tensor one rank passes to the next stage (a sequence shard under SP)."""
        return (self.microbatch_size // self.sequence_shards, self.hidden)


class StageModule(nn.Module):
    """One pipeline stage: ``spec.layers_on(stage)`` Linear layers, tanh between them."""

    def __init__(self, spec: LinearStackSpec, stage: int) -> None:
        super().__init__()
        if not 0 <= stage < spec.num_stages:
            raise ValueError(f"stage must be in [0, {spec.num_stages}), got {stage}")
        self.final_activation = stage != spec.num_stages - 1
        self.layers = nn.ModuleList()
        for layer in range(spec.layers_on(stage)):
            weight, bias = _layer_init(spec, stage, layer)
            if stage == 0 and layer == 0 and spec.vocab_parallel_embedding:
                from refgrad.pipeline_embedding import VocabParallelFirstLayer

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


def _layer_init(spec: LinearStackSpec, stage: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed * 7919 + stage * 101 + layer)
    scale = 1.0 / spec.hidden**0.5
    weight = (torch.rand(spec.hidden, spec.hidden, generator=g) * 2 - 1) * scale
    bias = (torch.rand(spec.hidden, generator=g) * 2 - 1) * 0.1
    return weight, bias


HEAD_PARAM = "head.weight"  # stage-local name of the output-head weight on the last stage
EMBEDDING_PARAM = "layers.0.weight"  # stage-local name of the first stage's tied weight


def head_weight_init(spec: LinearStackSpec) -> torch.Tensor:
    """Initial output-head weight: the first stage's first weight when tied."""
    if spec.tied_embedding:
        return _layer_init(spec, 0, 0)[0]
    g = torch.Generator().manual_seed(spec.seed * 7919 + 99_991)
    return (torch.rand(spec.hidden, spec.hidden, generator=g) * 2 - 1) / spec.hidden**0.5


class HeadRecordingWgrad(torch.autograd.Function):
    """``x · Wᵀ``; backward returns the input gradient ``G · W`` and records ``(G, X)``."""

    @staticmethod
    def forward(ctx, x, weight, record):
        ctx.save_for_backward(x, weight)
        ctx.record = record
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        ctx.record.append((grad_output.detach(), x.detach()))
        return grad_output.matmul(weight), None, None


def microbatch_data(
    spec: LinearStackSpec, dp_rank: int, step: int, num_microbatches: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rank-, step- and microbatch-specific ``(inputs, targets)`` for one replica."""
    _positive_int("microbatch_data", "num_microbatches", num_microbatches)
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + dp_rank * 10_007 + step * 31 + 5)
    inputs = [torch.randn(spec.activation_shape, generator=g) for _ in range(num_microbatches)]
    targets = [torch.randn(spec.activation_shape, generator=g) for _ in range(num_microbatches)]
    return inputs, targets


def microbatch_loss(output: torch.Tensor, target: torch.Tensor, num_microbatches: int) -> torch.Tensor:
    """Mean squared error of one microbatch, divided by the microbatch count (as production)."""
    return (output - target).square().mean() / num_microbatches


def sgd_update(param: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """``param - lr * grad`` with two separate fp32 roundings (no fused multiply-add)."""
    return torch.sub(param, torch.mul(grad, lr))


@dataclass(frozen=True)
class StepPlan:
    """One training step: how many microbatches, and which parameters are frozen."""

    num_microbatches: int
    frozen: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        _positive_int("StepPlan", "num_microbatches", self.num_microbatches)


@dataclass
class ReferenceResult:
    """Per step: losses ``[dp][microbatch]``, reduced grads, params after the update,
    and each replica's microbatch-ordered grad sum before the DP reduction."""

    losses: list[list[list[float]]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    replica_sums: list[list[dict[str, torch.Tensor]]] = field(default_factory=list)


def stage_param_name(stage: int, name: str) -> str:
    """The global name of a stage-local parameter name, e.g. ``stage1.layers.0.weight``."""
    return f"stage{stage}.{name}"


REDUCTIONS = ("sum", "avg", "prescale")


def reduce_across_replicas(per_replica: Sequence[torch.Tensor], reduction: str) -> torch.Tensor:
    """The reference DP reduction of one parameter's per-replica grads (``refgrad.reduce_scatter``).

    ``reduction``: ``"sum"`` (fp32 sum in rank order, one rounding per add),
    ``"avg"`` (that sum divided by ``D`` with one more rounding: ``ReduceOp.AVG``)
    or ``"prescale"`` (each replica's grad multiplied by ``1/D`` as torch does,
    then summed: production's gradient scaling factor before a SUM). For
    ``D <= 2`` the rank-order sum is the correctly rounded sum, which any
    all-reduce algorithm produces.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
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
    op = "sum"
    if reduction == "prescale":
        flat = prescale_like_torch(flat, 1.0 / world)
    elif reduction == "avg":
        op = "avg"
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
        from refgrad.pipeline_tp import tp_replica_grad_sums

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
    spec: LinearStackSpec, per_replica_sums: Sequence[dict[str, torch.Tensor]], reduction: str
) -> dict[str, torch.Tensor]:
    """The DP reduction of every gradient, then (sequence parallel) the TP sum of the
    replicated blocks' grads, then the tied-embedding all-reduce if tied."""
    reduced = {
        name: reduce_across_replicas([sums[name] for sums in per_replica_sums], reduction)
        for name in per_replica_sums[0]
    }
    if spec.sequence_shards > 1:
        from refgrad.pipeline_tp import sum_over_tensor_parallel

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
    reduction: str = "sum",
) -> ReferenceResult:
    """Run ``plans`` (one per step) on the whole model in one process; see the module doc."""
    _positive_int("reference_training", "dp_size", dp_size)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
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

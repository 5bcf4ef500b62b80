"""The pipeline model's description and its seeded data: what every part of the reference reads.

:class:`LinearStackSpec` (the Linear+tanh stack, its output head, tied embedding, deferral and
TP / SP split), :class:`StepPlan`, the seeded initial weights and microbatches, the loss, and
the parameter names. The model (``model``), its tensor-parallel split (``tensor_parallel``,
``embedding``), the grad sums, the reductions and the training loop all build on it, so none
of them needs another's model to describe it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refgrad.deferred_wgrad import deferred_accumulation_order


def positive_int(owner: str, name: str, value: object) -> None:
    """TypeError/ValueError unless ``value`` is an int >= 1 (named ``owner.name``)."""
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
    TP rank's row block, ``refgrad.pipeline.tensor_parallel``). At
    ``tensor_parallel > 1`` that first layer is a vocab-parallel embedding,
    ``x · W + b`` with ``W`` split over TP by rows as the head is
    (``refgrad.pipeline.embedding``), so each TP rank's two copies are tied.
    ``defer_output_wgrad`` and ``wgrad_deferral_limit`` are production's
    ``--defer-embedding-wgrad-compute`` and ``--wgrad-deferral-limit``: with
    ``0 < limit < M`` the first ``limit`` microbatches' head wgrads are added
    at the drain, after the immediate ones (order ``limit..M-1, 0..limit-1``,
    ``refgrad.deferred_wgrad.deferred_accumulation_order``); otherwise in
    microbatch order.
    ``tensor_parallel`` (TP) and ``sequence_parallel`` split the model as
    production does; their model is ``refgrad.pipeline.tensor_parallel`` (the output head
    vocab-parallel over TP, the Linear+tanh blocks replicated, run on sequence
    shards under sequence parallelism).
    ``stage_layers``, when given, is the number of layers on each stage (one entry per
    stage, each >= 1), as production's uneven pipeline splits give different stages
    different layer counts; empty: ``layers_per_stage`` on every stage.
    ``overflow_step``, when given, is a step whose targets are ``OVERFLOW_TARGET_SCALE``
    times the seeded ones (every replica and microbatch): a loss spike whose loss stays
    finite in fp32 while its gradient overflows fp16 (the fp16 twin's deliberate skip).
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
    overflow_step: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_stages", "layers_per_stage", "hidden", "microbatch_size",
                     "tensor_parallel"):
            positive_int("LinearStackSpec", name, getattr(self, name))
        if not isinstance(self.stage_layers, tuple):
            raise TypeError("LinearStackSpec.stage_layers must be a tuple of ints")
        if self.stage_layers:
            if len(self.stage_layers) != self.num_stages:
                raise ValueError(f"LinearStackSpec.stage_layers needs one count per stage "
                                 f"({self.num_stages}), got {len(self.stage_layers)}")
            for count in self.stage_layers:
                positive_int("LinearStackSpec", "stage_layers[...]", count)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"LinearStackSpec.seed must be an int >= 0, got {self.seed!r}")
        step = self.overflow_step
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"LinearStackSpec.overflow_step must be None or an int >= 0, got {step!r}")
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
        the head (``refgrad.pipeline.embedding``)."""
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


def validate_tensor_parallel(spec: LinearStackSpec) -> None:
    """ValueError unless ``spec``'s shapes split over its TP size."""
    tp = spec.tensor_parallel
    if spec.output_head and spec.hidden % tp:
        raise ValueError(f"LinearStackSpec.hidden ({spec.hidden}) must be divisible by "
                         f"tensor_parallel ({tp}): the head's vocabulary is split over TP")
    if spec.sequence_parallel and spec.microbatch_size % tp:
        raise ValueError(f"LinearStackSpec.microbatch_size ({spec.microbatch_size}) must be "
                         f"divisible by tensor_parallel ({tp}) with sequence_parallel")


def layer_init(spec: LinearStackSpec, stage: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The initial ``(weight, bias)`` of ``layer`` on ``stage``, from the spec's seed."""
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
        return layer_init(spec, 0, 0)[0]
    g = torch.Generator().manual_seed(spec.seed * 7919 + 99_991)
    return (torch.rand(spec.hidden, spec.hidden, generator=g) * 2 - 1) / spec.hidden**0.5


# A loss spike: 2^32 x unit-variance targets. The MSE (~2^64) and its gradient (~2^33 / (rows x
# hidden x M) per element, below 2^38 and, scaled, far below fp32's 2^128) stay finite in fp32;
# cast to fp16 (max 65504 < 2^16) for the backward, every element above 2^16 overflows.
OVERFLOW_TARGET_SCALE = 2.0**32


def microbatch_data(
    spec: LinearStackSpec, dp_rank: int, step: int, num_microbatches: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rank-, step- and microbatch-specific ``(inputs, targets)`` for one replica (at
    ``spec.overflow_step`` the targets times ``OVERFLOW_TARGET_SCALE``, exact: a power of two)."""
    positive_int("microbatch_data", "num_microbatches", num_microbatches)
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + dp_rank * 10_007 + step * 31 + 5)
    inputs = [torch.randn(spec.activation_shape, generator=g) for _ in range(num_microbatches)]
    targets = [torch.randn(spec.activation_shape, generator=g) for _ in range(num_microbatches)]
    if step == spec.overflow_step:
        targets = [t * OVERFLOW_TARGET_SCALE for t in targets]
    return inputs, targets


def microbatch_loss(output: torch.Tensor, target: torch.Tensor, num_microbatches: int) -> torch.Tensor:
    """Mean squared error of one microbatch, divided by the microbatch count (as production)."""
    return (output - target).square().mean() / num_microbatches


@dataclass(frozen=True)
class StepPlan:
    """One training step: how many microbatches, and which parameters are frozen."""

    num_microbatches: int
    frozen: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        positive_int("StepPlan", "num_microbatches", self.num_microbatches)


def stage_param_name(stage: int, name: str) -> str:
    """The global name of a stage-local parameter name, e.g. ``stage1.layers.0.weight``."""
    return f"stage{stage}.{name}"

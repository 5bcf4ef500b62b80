"""The distributed optimizer step with the param all-gather, as a typed interface.

A candidate's optimizer is built over the data-parallel model its own pipeline built
(:class:`DataParallelModel`: the candidate's DDP-wrapped chunks; Megatron-Core's
``get_megatron_optimizer`` over its ``DistributedDataParallel`` chunks, fastgrad's
``DistributedOptimizer`` / ``ReplicatedOptimizer`` over its ``DistributedDataParallel`` or
``ModelChunks``), with AdamW, global-norm clipping and a loss scaler
(:class:`OptimizerSettings`). Which of the two optimizers is built follows the model's DDP
(``use_distributed_optimizer``: shards of a reduce-scattered buffer, or every param over
all-reduced grads). Each :meth:`TrainingOptimizer.step` reports what it did
(:class:`StepOutcome`); :meth:`TrainingOptimizer.state` gives the fp32 master params and the
AdamW moments by the model's parameter names, whole (the shards other ranks own gathered).

A candidate whose optimizer departs from ``refgrad.optim`` by design says how in
:meth:`DistributedOptimizerStep.behaviour` (:class:`OptimizerBehaviour`): the comparison
then holds it to refgrad's model of that behaviour, and reports its distance from the spec
as a documented difference naming where the behaviour lives.

The ``optim`` check (and the preflight twin) use the interface inside ``with
candidate.optimizer() as optimizer:`` (:mod:`verify.candidates.api.scope`), in the rank
processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gradvocab import AdamWConfig, LossScaling, ParallelDims, SGDConfig, StepOutcome
from verify.candidates.api.core import DocumentedBehaviour
from verify.candidates.api.optimizer_parts import MXFP8Training
from verify.candidates.api.optimizer_schedule import HyperparameterSchedule
from verify.candidates.api.scope import TechniqueScope


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW, the global-norm clip (``max_grad_norm``; None: none) and the loss scaler (None:
    unscaled). The norm is taken over the data-parallel and model-parallel (pipeline and
    tensor) groups, a tied embedding's second copy (``param.shared``) once.

    ``sgd``: set, the step is SGD with momentum instead (``adamw`` is then not used).
    ``decay_1d_params``: False puts no weight decay on params of one dimension (biases, norm
    weights), Megatron-Core's default grouping; True decays every param.
    ``schedule``: set, each update's learning rate and weight decay are the schedule's
    (:class:`~verify.candidates.api.optimizer_schedule.HyperparameterSchedule`, in place of
    ``lr`` and ``weight_decay`` of ``adamw`` / ``sgd``); None: those, at every update.
    """

    adamw: AdamWConfig = AdamWConfig(lr=1e-2)
    max_grad_norm: float | None = None
    loss_scaling: LossScaling | None = None
    sgd: SGDConfig | None = None
    decay_1d_params: bool = True
    schedule: HyperparameterSchedule | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.adamw, AdamWConfig):
            raise TypeError("OptimizerSettings.adamw must be an AdamWConfig")
        if self.sgd is not None and not isinstance(self.sgd, SGDConfig):
            raise TypeError("OptimizerSettings.sgd must be an SGDConfig or None")
        if not isinstance(self.decay_1d_params, bool):
            raise TypeError("OptimizerSettings.decay_1d_params must be a bool")
        if self.max_grad_norm is not None and (
                isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm, (int, float))
                or not math.isfinite(self.max_grad_norm) or self.max_grad_norm <= 0):
            raise ValueError(f"OptimizerSettings.max_grad_norm must be None or a finite number > 0, "
                             f"got {self.max_grad_norm!r}")
        if self.loss_scaling is not None and not isinstance(self.loss_scaling, LossScaling):
            raise TypeError("OptimizerSettings.loss_scaling must be a LossScaling or None")
        if self.schedule is not None and not isinstance(self.schedule, HyperparameterSchedule):
            raise TypeError("OptimizerSettings.schedule must be a HyperparameterSchedule or None "
                            f"(per-update values, not a callable), got {type(self.schedule).__name__}")

    def lr_and_weight_decay(self, update: int) -> tuple[float, float]:
        """``(lr, weight_decay)`` of update ``update`` (0: the first; skipped steps do not
        count) for a param that takes weight decay: the schedule's, or the constant ones."""
        if self.schedule is not None:
            return self.schedule.lr(update), self.schedule.weight_decay(update)
        hyper = self.sgd if self.sgd is not None else self.adamw
        return hyper.lr, hyper.weight_decay


@dataclass(frozen=True)
class AdamWState:
    """One parameter's fp32 master and AdamW moments, whole (every DP rank's shard)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


@runtime_checkable
class DataParallelModel(Protocol):
    """What a candidate's optimizer is built over: the model chunks its own DDP wraps, on
    this rank of ``grid``. Each candidate's optimizer accepts only its own candidate's model
    (the DDP buffers it shards are that candidate's)."""

    @property
    def grid(self) -> ParallelDims:
        """This rank's place in the grid, with its process groups."""
        ...

    def named_parameters(self) -> Mapping[str, torch.nn.Parameter]:
        """The model's parameters by name as the forward uses them (a weight shared by two
        layers under both names)."""
        ...


@runtime_checkable
class TrainingOptimizer(Protocol):
    """One rank's optimizer, built by :meth:`DistributedOptimizerStep.build`."""

    @property
    def loss_scale(self) -> float | None:
        """The scale the next step's loss is to be multiplied by (None: no loss scaling)."""
        ...

    @property
    def param_gather_in_flight(self) -> bool:
        """Whether a param all-gather launched by a step is still unfinished
        (``overlap_param_gather``: the next forward's pre-hooks wait for it)."""
        ...

    def step(self) -> StepOutcome:
        """Unscale, take the norm, clip, step AdamW on the masters, publish the params (their
        all-gather, overlapped or not) and update the loss scale."""
        ...

    def state(self) -> dict[str, AdamWState]:
        """Every parameter's master and moments by the model's names (collective over the DP
        group; call it once the params are gathered)."""
        ...

    def finish_param_sync(self) -> None:
        """Wait for the last step's param all-gather (no forward follows it)."""
        ...

    def close(self) -> None:
        """Remove what the optimizer hooked into the model."""
        ...


@dataclass(frozen=True)
class OptimizerBehaviour:
    """How a candidate's optimizer departs from ``refgrad.optim`` by design (None: it does not).

    ``torch_adamw_order``: AdamW in ``torch.optim.AdamW``'s order of operations
    (``refgrad.optim_torch``, with the platform's fp32 square root).
    ``no_decay_on_1d_params``: weight decay only on params with more than one dimension.
    ``partial_sum_grad_norm``: the global norm is an fp32 partial-sum norm, judged against the
    exact norm within ``γ(n + k + R + 8)`` (``n`` the largest param, ``k`` the params, ``R``
    the ranks); the candidate then clips with its own norm.
    ``torch_sgd_order``: SGD in ``torch.optim.SGD``'s order (``refgrad.optim_torch``).
    ``param_gather_in_forward``: with ``overlap_param_gather`` the step launches no param
    all-gather; each module's forward pre-hook launches (and waits for) its bucket's.
    ``torch_clip_coefficient``: the clip coefficient is ``torch.nn.utils``'s, computed on the
    fp32 norm (``refgrad.optim_torch.torch_clip_coefficient``), not ``refgrad.optim``'s.
    """

    torch_adamw_order: DocumentedBehaviour | None = None
    no_decay_on_1d_params: DocumentedBehaviour | None = None
    partial_sum_grad_norm: DocumentedBehaviour | None = None
    torch_sgd_order: DocumentedBehaviour | None = None
    param_gather_in_forward: DocumentedBehaviour | None = None
    torch_clip_coefficient: DocumentedBehaviour | None = None

    def documented(self) -> tuple[DocumentedBehaviour, ...]:
        """Every documented behaviour, in this order."""
        return tuple(b for b in (self.torch_adamw_order, self.no_decay_on_1d_params,
                                 self.partial_sum_grad_norm, self.torch_sgd_order,
                                 self.param_gather_in_forward, self.torch_clip_coefficient)
                     if b is not None)


@dataclass(frozen=True)
class DataParallelSettings:
    """The DDP a module is wrapped in for the optimizer (``DistributedDataParallelConfig``'s
    names; always the distributed optimizer with ``overlap_grad_reduce``, as the ``optim``
    check runs it): ``bucket_size`` elements per bucket, ``overlap_param_gather``,
    ``grad_reduce_in_fp32`` and ``average`` (the DP mean; False: the sum)."""

    bucket_size: int
    overlap_param_gather: bool = False
    grad_reduce_in_fp32: bool = False
    average: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int) or self.bucket_size < 1:
            raise ValueError(f"DataParallelSettings.bucket_size must be an int >= 1, got {self.bucket_size!r}")
        for name in ("overlap_param_gather", "grad_reduce_in_fp32", "average"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"DataParallelSettings.{name} must be a bool")


@runtime_checkable
class DataParallelModule(DataParallelModel, Protocol):
    """A module wrapped in the candidate's DDP by :meth:`DistributedOptimizerStep.data_parallel`
    (a :class:`DataParallelModel` the same candidate's :meth:`~DistributedOptimizerStep.build`
    accepts). The caller runs the module itself (``module(...)``, then ``backward``): the DDP's
    hooks accumulate and reduce the grads, its forward pre-hooks wait for param all-gathers."""

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped module."""
        ...

    def zero_grad_buffer(self) -> None:
        """Start an iteration: zero the grad buffer (and what the training loop resets with it)."""
        ...

    def finish_grad_sync(self) -> None:
        """Finish every bucket's grad reduction after the backward."""
        ...


@dataclass(frozen=True)
class LossScalerState:
    """A dynamic loss scaler's state after a step (Megatron-Core's ``DynamicGradScaler``)."""

    scale: float
    growth_tracker: int
    hysteresis_tracker: int

    def as_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}


@dataclass(frozen=True)
class OptimizerCheckpoint:
    """A whole optimizer checkpoint, reshardable across DP sizes: ``params`` by the model's
    names (fp32 ``master`` and the state: ``exp_avg``/``exp_avg_sq`` or
    ``momentum_buffer``, whole), ``native`` the candidate's own form of it (what it loads;
    picklable, opaque to the check)."""

    params: Mapping[str, Mapping[str, torch.Tensor]]
    native: object


@runtime_checkable
class ShardedOptimizer(TrainingOptimizer, Protocol):
    """The optimizer :meth:`DistributedOptimizerStep.build` returns over a
    :class:`DataParallelModule`: :class:`TrainingOptimizer` and what the ``optim`` check reads."""

    def loss_scaler_state(self) -> LossScalerState | None:
        """The loss scaler's state after the last step (None: no loss scaling)."""
        ...

    def publish_params(self) -> None:
        """Launch the param all-gather of the current masters without a step (what a rank whose
        step was skipped does to pair the others' gathers)."""
        ...

    def gather_in_flight(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether a param all-gather covering one of ``params`` is launched and not waited for."""
        ...

    def named_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every param's fp32 ``master`` and state (``exp_avg``/``exp_avg_sq`` or
        ``momentum_buffer``) by the model's names, whole (collective over the DP group)."""
        ...

    def checkpoint(self) -> OptimizerCheckpoint:
        """The whole optimizer state (collective over the DP group)."""
        ...

    def load_checkpoint(self, checkpoint: OptimizerCheckpoint) -> None:
        """Resume from ``checkpoint``, taken at any DP size (collective)."""
        ...


@runtime_checkable
class MXFP8ParamOptimizer(Protocol):
    """Builds :class:`~verify.candidates.api.optimizer_parts.MXFP8Training` runs."""

    def build(self, values: Sequence[torch.Tensor], settings: OptimizerSettings, *,
              sharing: bool, grad_fp32: bool, bucket_size: int,
              dp_group: dist.ProcessGroup | None) -> MXFP8Training:
        """MXFP8 params quantized from ``values``, their buffer over ``dp_group`` (buffer
        sharing on or off, fp32 or bf16 grads, ``bucket_size``) and the optimizer of
        ``settings`` (its decay on every param), its first publication done."""
        ...


@runtime_checkable
class DistributedOptimizerStep(TechniqueScope, Protocol):
    """The candidate's optimizer over its data-parallel model.

    ``shares_a_world``: False when building the optimizer runs collectives over the whole
    default group (Megatron-Core's ``get_megatron_optimizer``), so every DP group a check
    builds one on needs a world of its own.
    """

    shares_a_world: bool

    def build(self, model: DataParallelModel, settings: OptimizerSettings) -> TrainingOptimizer:
        """This rank's optimizer over ``model`` (built by the same candidate): the distributed
        optimizer when the model's DDP shards its grads, else the replicated one; over a
        :class:`DataParallelModule`, a :class:`ShardedOptimizer`."""
        ...

    def behaviour(self) -> OptimizerBehaviour:
        """How this optimizer departs from ``refgrad.optim`` by design."""
        ...

    def data_parallel(self, module: torch.nn.Module, settings: DataParallelSettings,
                      dp_group: dist.ProcessGroup | None) -> DataParallelModule:
        """``module`` wrapped in the candidate's DDP over ``dp_group`` (None: the world)."""
        ...

    def mxfp8(self) -> MXFP8ParamOptimizer:
        """The optimizer over MXFP8 params (Unsupported where the candidate has none here)."""
        ...


__all__ = [
    "AdamWState",
    "DataParallelModel",
    "DataParallelModule",
    "DataParallelSettings",
    "DistributedOptimizerStep",
    "HyperparameterSchedule",
    "LossScalerState",
    "MXFP8ParamOptimizer",
    "MXFP8Training",
    "OptimizerBehaviour",
    "OptimizerCheckpoint",
    "ShardedOptimizer",
    "OptimizerSettings",
    "TrainingOptimizer",
]

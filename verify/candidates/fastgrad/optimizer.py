"""fastgrad's :class:`~verify.candidates.interfaces.DistributedOptimizerStep`:
``fastgrad.optim.DistributedOptimizer`` (AdamW over the shards of the reduce-scattered
buffer; over an MXFP8 buffer it re-quantizes the params at the end of the step) or, without
the distributed optimizer, ``ReplicatedOptimizer`` over the all-reduced grads: Megatron's two
optimizers. The norm is summed over the pipeline (and TP) group, the tied copy on the last
stage left out; the loss is scaled as Megatron's grad scaler does
(``fastgrad.optim.DynamicLossScaler``). fastgrad's AdamW is ``refgrad.optim``'s order, its
norm refgrad's: fastgrad documents no optimizer departure (its ``documented()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch.distributed as dist
from torch import nn

from fastgrad.optim import (
    DistributedOptimizer,
    DynamicLossScaler,
    ReplicatedOptimizer,
)
from gradvocab import Averaging, DDPConfig, StepOutcome
from verify.candidates.fastgrad.sharded_optimizer import (
    FastgradDataParallel,
    FastgradMXFP8Optimizer,
    FastgradShardedOptimizer,
    decaying_groups,
    fastgrad_config,
    schedule_next_update,
)
from verify.candidates.fastgrad.stages import FastgradStages, norm_group
from verify.candidates.interfaces import (
    AdamWState,
    DataParallelModel,
    DistributedOptimizerStep,
    MXFP8ParamOptimizer,
    OptimizerSettings,
    Technique,
    TrainingOptimizer,
    Unsupported,
)


@dataclass(frozen=True)
class FastgradOptimizer(DistributedOptimizerStep):
    """fastgrad's optimizers over fastgrad's stages, or over a module its DDP wraps
    (:meth:`data_parallel`; its ``with`` scope is empty). ``sharded_cls``: the distributed
    optimizer class for those and its MXFP8 params (a test's broken candidate gives a
    subclass)."""

    shares_a_world: ClassVar[bool] = True
    # keyword-only: subclasses add positional fields (tests' broken optimizers)
    sharded_cls: type[DistributedOptimizer] = field(default=DistributedOptimizer, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.sharded_cls, type):
            raise TypeError(f"FastgradOptimizer.sharded_cls must be a class, got {self.sharded_cls!r}")

    def optimizer_class(self, stages: FastgradStages) -> type[DistributedOptimizer]:
        """``DistributedOptimizer`` for a sharding DDP (or an MXFP8 buffer), else
        ``ReplicatedOptimizer`` (a test's broken candidate returns a subclass)."""
        if stages.front is not None or stages.case.use_distributed_optimizer:
            return DistributedOptimizer
        return ReplicatedOptimizer

    def build(self, model: DataParallelModel, settings: OptimizerSettings) -> TrainingOptimizer:
        if isinstance(model, FastgradDataParallel):
            return FastgradShardedOptimizer(model, settings, self.sharded_cls)
        if not isinstance(model, FastgradStages):
            raise TypeError(f"fastgrad's optimizer steps fastgrad's stages or a module its "
                            f"data_parallel() wrapped, got {type(model).__name__}")
        return FastgradTrainingOptimizer(model, settings, self.optimizer_class(model))

    def data_parallel(self, module: nn.Module, config: DDPConfig,
                      dp_group: dist.ProcessGroup | None, *,
                      averaging: Averaging | None = None) -> FastgradDataParallel:
        return FastgradDataParallel(module, config, dp_group, averaging)

    def mxfp8(self) -> MXFP8ParamOptimizer:
        if not getattr(self.sharded_cls, "supports_mxfp8", False):
            raise Unsupported(Technique.OPTIMIZER, f"{self.sharded_cls.__name__}.supports_mxfp8 is "
                              "absent or False: the optimizer has no MXFP8 parameter support")
        return FastgradMXFP8Optimizer(self.sharded_cls)


class FastgradTrainingOptimizer:
    """One rank's fastgrad optimizer over its :class:`FastgradStages`."""

    def __init__(self, stages: FastgradStages, settings: OptimizerSettings,
                 cls: type[DistributedOptimizer]) -> None:
        self.stages, self.settings = stages, settings
        scaling = settings.loss_scaling
        scaler = None if scaling is None else DynamicLossScaler(scaling)
        if stages.front is not None and scaler is not None:
            raise ValueError("fastgrad's MXFP8 buffer takes no loss scaler (its grads are fp32)")
        self.optimizer = cls(
            stages.optimizer_target, fastgrad_config(replace(settings, sgd=None)),
            max_grad_norm=settings.max_grad_norm, loss_scaler=scaler,
            model_parallel_group=norm_group(stages.case, stages.grid))
        self.decaying = decaying_groups(self.optimizer)
        if stages.front is not None:
            self.optimizer.publish_params()  # the first forward's weights: the masters, quantized
            stages.refresh_from_mxfp8()

    @property
    def loss_scale(self) -> float | None:
        scaler = self.optimizer.loss_scaler
        return None if scaler is None else scaler.scale

    @property
    def param_gather_in_flight(self) -> bool:
        return self.optimizer.param_gather_in_flight

    def step(self) -> StepOutcome:
        schedule_next_update(self.optimizer, self.settings, self.decaying)
        outcome = self.optimizer.step()  # MXFP8: stage -> all-gather -> quantize -> zero
        if self.stages.front is not None:
            self.stages.refresh_from_mxfp8()
        return outcome

    def state(self) -> dict[str, AdamWState]:
        by_name = self.optimizer.named_state_dict()["params"]
        if self.stages.front is not None:
            params = dict(zip(self.stages.named, self.stages.front_params))
        else:
            params = self.stages.named
        out = {}
        for name, param in params.items():
            entry = by_name.get(self.optimizer.name_of(param))
            if entry is not None:
                out[name] = AdamWState(entry["master"], entry["exp_avg"], entry["exp_avg_sq"])
        return out

    def finish_param_sync(self) -> None:
        self.optimizer.finish_param_sync()

    def close(self) -> None:
        self.optimizer.remove_hooks()

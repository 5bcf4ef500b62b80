"""Megatron-Core's :class:`~verify.candidates.interfaces.DistributedOptimizerStep`: its
``get_megatron_optimizer`` over the DDP chunks of :class:`~verify.candidates.megatron_core.stages.MegatronStages`.

As Megatron-LM's ``setup_model_and_optimizer`` and ``train`` wire it: an ``OptimizerConfig``
(Adam with decoupled weight decay, ``clip_grad``, bf16/fp16, the distributed optimizer,
``overlap_param_gather``, the loss scale: a ``ConstantGradScaler`` for a constant one, fp16's
``DynamicGradScaler`` otherwise), ``OptimizerParamScheduler`` setting each group's lr and
weight decay (the settings' schedule: warm-up, decay, weight-decay increment; it applies
``wd_mult``), ``config.grad_scale_func =
optimizer.scale_loss``, and each step ``optimizer.zero_grad()`` after the buffers are zeroed,
then ``optimizer.step()`` and ``scheduler.step(1)``.

How it departs from ``refgrad.optim`` by design (the candidate's ``documented()``), each
modelled by refgrad and named where it lives:

* its inner optimizer is ``torch.optim.AdamW`` when neither Transformer Engine nor apex is
  installed (``megatron/core/optimizer/__init__.py``): ``refgrad.optim_torch``'s order (a
  fused Adam has no refgrad model: the optimizer is then Unsupported, saying so);
* ``get_standard_config_overrides``: 1-D params and biases get ``wd_mult = 0``
  (``OptimizerParamScheduler.step`` applies it);
* its global norm is an fp32 partial-sum norm (``clip_grads.get_grad_norm_fp32`` with
  ``utils.local_multi_tensor_l2_norm``), judged against refgrad's exact norm within a bound,
  and it clips with that norm (``clip_grad_by_total_norm_fp32``: ``max_norm / (norm + 1e-6)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NoReturn

import torch
import torch.distributed as dist

from gradvocab import Averaging, DDPConfig, StepOutcome
from verify.candidates.interfaces import (
    AdamWState,
    DataParallelModel,
    DistributedOptimizerStep,
    OptimizerSettings,
    Technique,
    TrainingOptimizer,
    Unsupported,
)
from verify.candidates.megatron_core.scope import MegatronScope
from verify.candidates.megatron_core.sharded_optimizer import (
    MegatronDataParallel,
    MegatronShardedOptimizer,
    gathered_state,
    loss_scale,
    optimizer_config,
    owned_state,
    param_scheduler,
    step_and_report,
)
from verify.candidates.megatron_core.stages import MegatronStages
from verify.candidates.megatron_core.version import require_modelled_adamw

NO_MXFP8 = ("MXFP8 params need Transformer Engine's MXFP8 tensors (CUDA); Megatron-Core's "
            "optimizer over them is the mxfp8 check's subject where it can run")


@dataclass(frozen=True)
class MegatronOptimizer(MegatronScope, DistributedOptimizerStep):
    """Megatron-Core's optimizer over Megatron-Core's stages or over a module its DDP wraps
    (:meth:`data_parallel`), in the candidate's scope. ``ddp_class``: the DDP class
    :meth:`data_parallel` wraps with (a test's broken copy of Megatron's);
    ``sharded_cls``: the optimizer adapter over it (a test's broken copy); ``training_cls``:
    the twin's adapter over :class:`MegatronStages` (None: :class:`MegatronTrainingOptimizer`;
    a test's broken copy)."""

    # get_megatron_optimizer all-gathers its param-group keys over the default group
    # (megatron/core/optimizer/__init__.py _get_param_groups): one DP group per world.
    shares_a_world: ClassVar[bool] = False
    ddp_class: type | None = field(default=None, kw_only=True)
    sharded_cls: type[MegatronShardedOptimizer] = field(default=MegatronShardedOptimizer, kw_only=True)
    training_cls: type | None = field(default=None, kw_only=True)

    def build(self, model: DataParallelModel, settings: OptimizerSettings) -> TrainingOptimizer:
        if isinstance(model, MegatronDataParallel):
            require_modelled_adamw()  # Unsupported where refgrad has no model of its inner optimizer
            return self.sharded_cls(model, settings)
        if not isinstance(model, MegatronStages):
            raise TypeError(f"Megatron-Core's optimizer steps Megatron-Core's stages or a module "
                            f"its data_parallel() wrapped, got {type(model).__name__}")
        return (self.training_cls or MegatronTrainingOptimizer)(model, settings)

    def data_parallel(self, module: torch.nn.Module, config: DDPConfig,
                      dp_group: dist.ProcessGroup | None, *,
                      averaging: Averaging | None = None) -> MegatronDataParallel:
        return MegatronDataParallel(module, config, dp_group, averaging, self.ddp_class)

    def mxfp8(self) -> NoReturn:
        raise Unsupported(Technique.OPTIMIZER, NO_MXFP8)


class MegatronTrainingOptimizer:
    """One rank's Megatron optimizer and scheduler over its :class:`MegatronStages`.
    ``owned``: how this rank's masters are found (:func:`owned_state`, as the ``optim``
    check's adapter; a test's broken copy gives another)."""

    owned = staticmethod(owned_state)

    def __init__(self, stages: MegatronStages, settings: OptimizerSettings) -> None:
        from megatron.core.optimizer import get_megatron_optimizer

        if not stages.case.use_distributed_optimizer:
            raise ValueError("the twin reads Megatron-Core's masters from its distributed "
                             "optimizer only")
        self.stages, self.settings = stages, settings
        self.optimizer = get_megatron_optimizer(
            optimizer_config(settings, dtype=stages.settings.param_dtype,
                             overlap_param_gather=stages.settings.overlap_param_gather),
            stages.ddps, use_gloo_process_groups=False, pg_collection=stages.groups)
        self.scheduler = param_scheduler(self.optimizer, settings)
        stages.config.grad_scale_func = self.optimizer.scale_loss
        stages.on_zero_grad.append(self.optimizer.zero_grad)

    @property
    def loss_scale(self) -> float | None:
        return loss_scale(self.optimizer, self.settings)

    @property
    def param_gather_in_flight(self) -> bool:
        return self.stages.param_gather_in_flight()

    def step(self) -> StepOutcome:
        return step_and_report(self.optimizer, self.scheduler, self.settings)

    def state(self) -> dict[str, AdamWState]:
        """Every param's whole master and moments, read as the ``optim`` check's adapter reads
        them (:func:`~verify.candidates.megatron_core.sharded_optimizer.gathered_state`)."""
        names = list(self.stages.named)
        params = [self.stages.named[n] for n in names]
        whole = gathered_state(self.optimizer, names, params, self.stages.groups.dp, self.owned)
        return {name: AdamWState(entry["master"], entry["exp_avg"], entry["exp_avg_sq"])
                for name, entry in whole.items()}

    def finish_param_sync(self) -> None:
        self.stages.force_param_sync()

    def close(self) -> None:
        if self.optimizer.zero_grad in self.stages.on_zero_grad:
            self.stages.on_zero_grad.remove(self.optimizer.zero_grad)


"""fastgrad's distributed optimizer as the ``optim`` check drives it (:mod:`verify.candidates.interfaces`).

``fastgrad.ddp.DistributedDataParallel`` (distributed optimizer, ``overlap_grad_reduce``) wraps
the check's module (:class:`FastgradDataParallel`); ``fastgrad.optim.DistributedOptimizer`` (or
a test's subclass) steps it (:class:`FastgradShardedOptimizer`), with
``param_groups_without_decay_for`` when 1-D params take no decay, the global-norm clip and
``DynamicLossScaler``. Its MXFP8 params (:class:`FastgradMXFP8Training`,
``fastgrad.mxfp8_sharing``) are the same optimizer class.
fastgrad follows ``refgrad.optim``'s order and exact norm: it documents no departure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from fastgrad.ddp import DistributedDataParallel
from fastgrad.mxfp8_sharing import MXFP8Parameter, MXFP8ParamGradBuffer
from fastgrad.optim import (
    DistributedOptimizer,
    DynamicLossScaler,
    param_groups_without_decay_for,
)
from gradvocab import AdamWConfig, Averaging, DDPConfig, ParallelDims, SGDConfig, StepOutcome
from verify.candidates.interfaces import (
    AdamWState,
    DataParallelModule,
    LossScalerState,
    MXFP8ParamOptimizer,
    MXFP8Training,
    OptimizerCheckpoint,
    OptimizerSettings,
    ShardedOptimizer,
)


def fastgrad_config(settings: OptimizerSettings) -> AdamWConfig | SGDConfig:
    """The seam's optimizer config (gradvocab's type, which fastgrad takes as it is). With a
    schedule, its peak lr and its largest (final) weight decay in place of the config's: the
    groups the optimizer builds with a nonzero weight decay are those the schedule decays
    (:func:`decaying_groups`)."""
    config = settings.sgd if settings.sgd is not None else settings.adamw
    if settings.schedule is None:
        return config
    return replace(config, lr=settings.schedule.max_lr, weight_decay=settings.schedule.end_wd)


def decaying_groups(optimizer: DistributedOptimizer) -> list[bool]:
    """Which of the optimizer's groups take weight decay, as the optimizer built them (a
    nonzero ``weight_decay``; ``param_groups_without_decay_for`` gives 1-D params 0): the
    groups a schedule's weight decay reaches, as Megatron's ``wd_mult``. Read from the
    optimizer's own groups, so an optimizer that grouped its params wrongly is not put
    right here."""
    return [group["weight_decay"] != 0 for group in optimizer.param_groups]


def schedule_next_update(optimizer: DistributedOptimizer, settings: OptimizerSettings,
                         decaying: Sequence[bool]) -> None:
    """Write the next update's learning rate and weight decay into the optimizer's
    ``param_groups``, as an LR scheduler does between steps (its step reads them). The update
    is the optimizer's own count of updates (a step skipped on NaN/inf grads does not
    advance it, as Megatron-LM's ``train_step`` does not advance its scheduler)."""
    if settings.schedule is None:
        return
    lr, weight_decay = settings.lr_and_weight_decay(optimizer.steps[0] if optimizer.steps else 0)
    for group, decays in zip(optimizer.param_groups, decaying, strict=True):
        group["lr"] = lr
        group["weight_decay"] = weight_decay if decays else 0.0


class FastgradDataParallel(DataParallelModule):
    """A module in fastgrad's ``DistributedDataParallel``."""

    def __init__(self, module: nn.Module, config: DDPConfig,
                 dp_group: dist.ProcessGroup | None, averaging: Averaging | None = None) -> None:
        # fastgrad's DDP holds averaging to config (DDPConfig.resolve_averaging) first
        self.ddp = DistributedDataParallel(module, config=config, averaging=averaging,
                                           dp_group=dp_group)

    @property
    def grid(self) -> ParallelDims:
        return self.ddp.parallel_dims

    @property
    def module(self) -> nn.Module:
        return self.ddp.module

    def named_parameters(self) -> Mapping[str, nn.Parameter]:
        return dict(self.ddp.module.named_parameters())

    def zero_grad_buffer(self) -> None:
        self.ddp.zero_grad_buffer()

    def finish_grad_sync(self) -> None:
        self.ddp.finish_grad_sync()


class FastgradShardedOptimizer(ShardedOptimizer):
    """``optimizer_cls`` (``DistributedOptimizer`` or a subclass) over a :class:`FastgradDataParallel`."""

    def __init__(self, model: FastgradDataParallel, settings: OptimizerSettings,
                 optimizer_cls: type[DistributedOptimizer]) -> None:
        scaling = settings.loss_scaling
        scaler = None if scaling is None else DynamicLossScaler(scaling)
        ddp = model.ddp
        groups = None if settings.decay_1d_params else param_groups_without_decay_for(ddp)
        self.optimizer = optimizer_cls(ddp, fastgrad_config(settings), groups,
                                       max_grad_norm=settings.max_grad_norm, loss_scaler=scaler)
        self.settings = settings
        self.decaying = decaying_groups(self.optimizer)
        self.names = {p: n for n, p in model.named_parameters().items()}

    @property
    def loss_scale(self) -> float | None:
        scaler = self.optimizer.loss_scaler
        return None if scaler is None else scaler.scale

    @property
    def param_gather_in_flight(self) -> bool:
        return self.optimizer.param_gather_in_flight

    def step(self) -> StepOutcome:
        schedule_next_update(self.optimizer, self.settings, self.decaying)
        return self.optimizer.step()  # fastgrad reports its step in the seam's StepOutcome

    def state(self) -> dict[str, AdamWState]:
        return {name: AdamWState(entry["master"], entry["exp_avg"], entry["exp_avg_sq"])
                for name, entry in self.named_state().items() if "exp_avg" in entry}

    def finish_param_sync(self) -> None:
        self.optimizer.finish_param_sync()

    def close(self) -> None:
        self.optimizer.remove_hooks()

    def loss_scaler_state(self) -> LossScalerState | None:
        scaler = self.optimizer.loss_scaler
        if scaler is None:
            return None
        return LossScalerState(scale=float(scaler.scale), growth_tracker=int(scaler.growth_tracker),
                               hysteresis_tracker=int(scaler.hysteresis_tracker))

    def publish_params(self) -> None:
        self.optimizer.publish_params()

    def gather_in_flight(self, params: Iterable[nn.Parameter]) -> bool:
        mine = {id(p) for p in params}
        return any(s.gather_handle is not None for s in self.optimizer.shards
                   if any(id(p) in mine for p in s.bucket.params))

    def named_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return dict(self.optimizer.named_state_dict()["params"])

    def checkpoint(self) -> OptimizerCheckpoint:
        native = self.optimizer.named_state_dict()
        return OptimizerCheckpoint(params=native["params"], native=native)

    def load_checkpoint(self, checkpoint: OptimizerCheckpoint) -> None:
        self.optimizer.load_state_dict(checkpoint.native)


class FastgradMXFP8Training(MXFP8Training):
    """``MXFP8Parameter``s in an ``MXFP8ParamGradBuffer`` under ``optimizer_cls``."""

    def __init__(self, values: Sequence[torch.Tensor], settings: OptimizerSettings, *,
                 sharing: bool, grad_fp32: bool, bucket_size: int,
                 dp_group: dist.ProcessGroup | None,
                 optimizer_cls: type[DistributedOptimizer]) -> None:
        self.weights = [MXFP8Parameter(v) for v in values]
        self._initial = [w.dequantize(torch.float32) for w in self.weights]
        config = DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                           overlap_param_gather=True, fp8_param_gather=True,
                           reuse_grad_buf_for_mxfp8_param_ag=sharing, grad_reduce_in_fp32=grad_fp32,
                           bucket_size=bucket_size)
        self.buffer = MXFP8ParamGradBuffer(self.weights, config=config, dp_group=dp_group)
        self.optimizer = optimizer_cls(self.buffer, fastgrad_config(settings),
                                       max_grad_norm=settings.max_grad_norm)
        self.settings = settings
        self.decaying = decaying_groups(self.optimizer)
        self.optimizer.publish_params()

    @property
    def sharing(self) -> bool:
        return self.buffer.sharing

    @property
    def param_ranges(self) -> list[tuple[int, int]]:
        return [self.buffer.param_range(w) for w in self.weights]

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return [(b.start, b.end) for b in self.buffer.buckets]

    def initial(self) -> list[torch.Tensor]:
        return list(self._initial)

    def bits(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(w.scale_bits.clone(), w.element_bits.clone()) for w in self.weights]

    def zero_grad(self) -> None:
        self.buffer.zero_grad()

    def accumulate_grad(self, index: int, grad: torch.Tensor) -> None:
        self.buffer.accumulate_grad(self.weights[index], grad)

    def reduce_grads(self) -> None:
        self.buffer.reduce_grads()

    def local_grad_shards(self) -> list[torch.Tensor]:
        return [b.local_grad_shard.clone() for b in self.buffer.buckets]

    def step(self) -> bool:
        schedule_next_update(self.optimizer, self.settings, self.decaying)
        return self.optimizer.step().stepped

    def master_shards(self) -> list[torch.Tensor]:
        return self.optimizer.master_shards()

    def named_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return dict(self.optimizer.named_state_dict()["params"])


class FastgradMXFP8Optimizer(MXFP8ParamOptimizer):
    """Builds :class:`FastgradMXFP8Training` runs with ``optimizer_cls``."""

    def __init__(self, optimizer_cls: type[DistributedOptimizer]) -> None:
        self.optimizer_cls = optimizer_cls

    def build(self, values: Sequence[torch.Tensor], settings: OptimizerSettings, *,
              sharing: bool, grad_fp32: bool, bucket_size: int,
              dp_group: dist.ProcessGroup | None) -> MXFP8Training:
        return FastgradMXFP8Training(values, settings, sharing=sharing, grad_fp32=grad_fp32,
                                     bucket_size=bucket_size, dp_group=dp_group,
                                     optimizer_cls=self.optimizer_cls)

"""torch's optimizers on FSDP2's sharded parameters, as the ``optim`` check drives them
(:mod:`verify.candidates.interfaces`).

:meth:`TorchFSDP2Optimizer.data_parallel` wraps the check's module as torchtitan does:
``fully_shard`` on every child module and on the root, over the check's DP group, the
sharded parameters in fp32 (the masters) and a ``MixedPrecisionPolicy`` per child
(``param_dtype`` its 16-bit dtype, ``reduce_dtype`` fp32 with ``grad_reduce_in_fp32``, else
its own); the DP sum instead of the mean is ``set_gradient_divide_factor(1.0)``.
:meth:`~TorchFSDP2Optimizer.build` steps the shards with ``torch.optim.AdamW`` (or ``SGD``;
no decay on 1-D params as asked; a schedule's lr and weight decay written into the param
groups before each step, as torch's LR schedulers do), clipping with ``torch.nn.utils.get_total_norm`` (the tied
copy left out) and ``clip_grads_with_norm_``, as ``clip_grad_norm_`` composes them.

FSDP2 gathers each module's parameters in its forward; to show them whole between steps,
:meth:`~FSDP2Training.finish_param_sync` unshards every module (``FSDPModule.unshard``) and
the next step reshards first. What it does not have is Unsupported: loss scaling
(``torch.amp.GradScaler`` is a separate API), checkpoints (``torch.distributed.checkpoint``
is not wired) and MXFP8.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from gradvocab import Averaging, DDPConfig, ParallelDims, StepOutcome
from verify.candidates.interfaces import (
    AdamWState,
    DataParallelModel,
    DataParallelModule,
    DistributedOptimizerStep,
    LossScalerState,
    OptimizerCheckpoint,
    OptimizerSettings,
    Technique,
    Unsupported,
)
from verify.candidates.torch_fsdp2.sharding import mesh_of, policy

NO_SCALER = ("loss scaling: FSDP2 has none (torch.amp.GradScaler is a separate API, not wired "
             "into this adapter)")
NO_CHECKPOINT = ("a reshardable checkpoint: torch.distributed.checkpoint is not wired into this "
                 "adapter")


def _unsupported(reason: str) -> Unsupported:
    return Unsupported(Technique.OPTIMIZER, f"torch-fsdp2: {reason}")


def _fsdp_modules(module: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class FSDP2Module(DataParallelModule):
    """The check's module under ``fully_shard`` (its children, then the root)."""

    def __init__(self, module: nn.Module, config: DDPConfig, group: dist.ProcessGroup | None,
                 averaging: Averaging | None = None) -> None:
        from torch.distributed.fsdp import fully_shard

        # FSDP2 has its own mean (its divide factors, a documented departure) for every way
        # that averages, and a divide factor of 1 for the sum
        averages = config.resolve_averaging(averaging).averages

        self._module = module
        self._grid = ParallelDims.data_parallel(dp_group=group)
        self.shared = {n for n, p in module.named_parameters() if getattr(p, "shared", False)}
        mesh = mesh_of(group)
        for child in module.children():
            dtypes = {p.dtype for p in child.parameters()}
            if len(dtypes) != 1:
                raise ValueError(f"torch-fsdp2 gives each child module one MixedPrecisionPolicy: "
                                 f"{type(child).__name__} holds params of dtypes {sorted(map(str, dtypes))}")
            (dtype,) = dtypes
            child.float()  # the sharded params are the fp32 masters
            reduce = torch.float32 if config.grad_reduce_in_fp32 else dtype
            fully_shard(child, mesh=mesh, mp_policy=policy(None if dtype == torch.float32 else dtype,
                                                           reduce))
        fully_shard(module, mesh=mesh)
        if not averages:
            for fsdp in _fsdp_modules(module):
                fsdp.set_gradient_divide_factor(1.0)  # FSDP2's setting for the DP sum
        self.sharded = dict(module.named_parameters())

    @property
    def grid(self) -> ParallelDims:
        return self._grid

    @property
    def module(self) -> nn.Module:
        return self._module

    def named_parameters(self) -> Mapping[str, nn.Parameter]:
        return self.sharded

    def zero_grad_buffer(self) -> None:
        for p in self.sharded.values():
            p.grad = None

    def finish_grad_sync(self) -> None:
        """Nothing: FSDP2 reduce-scattered every module's grads in the backward."""


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor().detach().clone()


class FSDP2Training:
    """``torch.optim.AdamW`` / ``SGD`` over the sharded params, clipped as ``clip_grad_norm_``."""

    def __init__(self, model: FSDP2Module, settings: OptimizerSettings) -> None:
        self.model = model
        self.settings = settings
        params = model.sharded
        if settings.decay_1d_params:
            groups = [{"params": list(params.values())}]
        else:
            groups = [{"params": [p for p in params.values() if p.ndim > 1]},
                      {"params": [p for p in params.values() if p.ndim <= 1], "weight_decay": 0.0}]
        # Which groups take weight decay, as built (1-D params take none without
        # decay_1d_params): the groups a schedule's weight decay reaches.
        self._decaying = [group.get("weight_decay") != 0.0 for group in groups]
        self._updates = 0  # FSDP2 has no loss scaler: every step is an update
        lr, weight_decay = settings.lr_and_weight_decay(0)
        if settings.sgd is not None:
            h = settings.sgd
            self.optimizer = torch.optim.SGD(groups, lr=lr, momentum=h.momentum,
                                             weight_decay=weight_decay, foreach=False)
        else:
            h = settings.adamw
            self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=(h.beta1, h.beta2), eps=h.eps,
                                               weight_decay=weight_decay, foreach=False)

    loss_scale = None
    param_gather_in_flight = False

    def step(self) -> StepOutcome:
        self._reshard()
        norm = coefficient = None
        if self.settings.max_grad_norm is not None:
            total = torch.nn.utils.get_total_norm(
                [p.grad for n, p in self.model.sharded.items() if n not in self.model.shared])
            torch.nn.utils.clip_grads_with_norm_(list(self.model.sharded.values()),
                                                 self.settings.max_grad_norm, total)
            whole = total.full_tensor() if hasattr(total, "full_tensor") else total
            norm = float(whole)
            # the coefficient clip_grads_with_norm_ computed, on the same fp32 tensor
            coefficient = float(torch.clamp(self.settings.max_grad_norm / (whole + 1e-6), max=1.0))
        self._schedule_this_update()
        self.optimizer.step()
        self._updates += 1
        return StepOutcome(stepped=True, grad_norm=norm, clip_coefficient=coefficient, loss_scale=None)

    def _schedule_this_update(self) -> None:
        """This update's lr and weight decay into the param groups, as a torch LR scheduler
        writes them between steps (torch has no weight-decay scheduler: set the same way)."""
        if self.settings.schedule is None:
            return
        lr, weight_decay = self.settings.lr_and_weight_decay(self._updates)
        for group, decays in zip(self.optimizer.param_groups, self._decaying, strict=True):
            group["lr"] = lr
            group["weight_decay"] = weight_decay if decays else 0.0

    def named_state(self) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for name, p in self.model.sharded.items():
            entry = {"master": _whole(p)}
            for key, value in self.optimizer.state.get(p, {}).items():
                if key != "step":
                    entry[key] = _whole(value)
            out[name] = entry
        return out

    def state(self) -> dict[str, AdamWState]:
        return {n: AdamWState(s["master"], s["exp_avg"], s["exp_avg_sq"])
                for n, s in self.named_state().items()}

    def _reshard(self) -> None:
        for fsdp in _fsdp_modules(self.model.module):
            fsdp.reshard()

    def finish_param_sync(self) -> None:
        """Gather every module's params (what the next forward would use) into the module."""
        for fsdp in _fsdp_modules(self.model.module):
            fsdp.unshard()

    def close(self) -> None:
        self._reshard()

    def loss_scaler_state(self) -> LossScalerState | None:
        return None

    def publish_params(self) -> None:
        """Nothing: FSDP2 gathers the params in the next forward."""

    def gather_in_flight(self, params: Iterable[nn.Parameter]) -> bool:
        return False

    def checkpoint(self) -> OptimizerCheckpoint:
        raise _unsupported(NO_CHECKPOINT)

    def load_checkpoint(self, checkpoint: OptimizerCheckpoint) -> NoReturn:
        raise _unsupported(NO_CHECKPOINT)


class TorchFSDP2Optimizer(DistributedOptimizerStep):
    """torch.optim over FSDP2's shards (module docstring)."""

    # Building it runs no collective over the default group, but a DP sum on gloo crashes
    # (finding torch-fsdp2-1): each case in a world of its own, so that crash ends no other.
    shares_a_world = False

    def build(self, model: DataParallelModel, settings: OptimizerSettings) -> FSDP2Training:
        if not isinstance(model, FSDP2Module):
            raise TypeError(f"torch-fsdp2 builds its optimizer over its own FSDP2Module, got "
                            f"{type(model).__name__}")
        if settings.loss_scaling is not None:
            raise _unsupported(NO_SCALER)
        return FSDP2Training(model, settings)


    def data_parallel(self, module: nn.Module, config: DDPConfig,
                      dp_group: dist.ProcessGroup | None, *,
                      averaging: Averaging | None = None) -> FSDP2Module:
        return FSDP2Module(module, config, dp_group, averaging)

    def mxfp8(self) -> NoReturn:
        raise _unsupported("MXFP8 params (torchao's float8 training is not wired)")

"""Megatron-Core's distributed optimizer as the ``optim`` check drives it (:mod:`verify.candidates.interfaces`).

Megatron's ``DistributedDataParallel`` (distributed optimizer, ``overlap_grad_reduce``) wraps the
check's module on the check's DP group, given as a ``ProcessGroupCollection``
(:class:`MegatronDataParallel`); ``get_megatron_optimizer`` steps it
(:class:`MegatronShardedOptimizer`) as Megatron-LM's ``setup_model_and_optimizer`` and ``train``
wire it: an ``OptimizerConfig`` (Adam with decoupled weight decay, ``clip_grad``, bf16 / fp16
with fp32 main params, ``overlap_param_gather``, fp16's ``DynamicGradScaler``; a
``ConstantGradScaler`` of 1 for fp16 without loss scaling), ``OptimizerParamScheduler`` built
from the settings' schedule (warm-up, decay and weight-decay increment; constant without one;
it applies ``wd_mult``: no decay on 1-D params) and stepped after each successful update, and
each iteration the buffers' ``zero_grad_buffer`` then the optimizer's ``zero_grad``. The DP sum instead of the mean
is ``TransformerConfig.calculate_per_token_loss`` (DDP's ``gradient_scaling_factor`` 1).

What it cannot do here is :class:`~verify.candidates.interfaces.Unsupported`, naming where:
SGD (``DistributedOptimizer`` steps Adam only), weight decay on 1-D params, and a reshardable
checkpoint (not wired: its ``get_parameter_state_dp_zero`` format is not yet adapted).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from gradvocab import Averaging, DDPConfig, ParallelDims, StepOutcome
from verify.candidates.interfaces import (
    AdamWState,
    DataParallelModule,
    HyperparameterSchedule,
    LossScalerState,
    OptimizerCheckpoint,
    OptimizerSettings,
    ShardedOptimizer,
    Technique,
    Unsupported,
)
from verify.candidates.megatron_core.grad_reduction import data_parallel_groups, model_config
from verify.candidates.megatron_core.version import installed, megatron_ddp_config

SGD_UNSUPPORTED = ("SGD: Megatron-Core's DistributedOptimizer steps Adam only "
                   "(megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer.__init__ "
                   "asserts Adam, torch.optim.AdamW or HybridDeviceOptimizer)")
DECAY_1D_UNSUPPORTED = ("weight decay on 1-D params: Megatron-Core gives 1-D params and biases "
                        "wd_mult 0 (megatron/core/optimizer/__init__.py get_standard_config_overrides)")
CHECKPOINT_UNSUPPORTED = ("a reshardable optimizer checkpoint: Megatron-Core's "
                          "DistributedOptimizer.get_parameter_state_dp_zero / "
                          "load_parameter_state_from_dp_zero are not wired into this adapter yet")
CLIP_EPS = 1.0e-6  # megatron/core/optimizer/clip_grads.py clip_grad_by_total_norm_fp32


def _unsupported(reason: str) -> Unsupported:
    return Unsupported(Technique.OPTIMIZER, reason)


def _distributed_optimizers(optimizer) -> list:
    """The ``DistributedOptimizer``s inside what ``get_megatron_optimizer`` returned."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def owned_state(optimizer, params: list[nn.Parameter]) -> dict[int, dict]:
    """The fp32 main params and Adam state this rank owns, per index into ``params``.

    Each main param is found beside its model param in the group lists Megatron steps
    (``model_float16_groups`` / ``shard_fp32_from_float16_groups``, ``model_fp32_groups`` /
    ``shard_fp32_groups``), not through ``model_param_group_index_map``: for a param group
    holding fp32 and 16-bit params that map indexes the group's params in model order while
    ``optimizer.param_groups`` lists the fp32 shards first (``_build_model_and_main_param_groups``),
    so it names another param's main (see docs/megatron_core.md)."""
    index = {p: i for i, p in enumerate(params)}
    owned = {}
    for dist_opt in _distributed_optimizers(optimizer):
        pairs = [*zip(dist_opt.model_float16_groups, dist_opt.shard_fp32_from_float16_groups),
                 *zip(dist_opt.model_fp32_groups, dist_opt.shard_fp32_groups)]
        for models, mains in pairs:
            for param, main in zip(models, mains):
                if param not in index:
                    continue
                param_range = dist_opt._get_model_param_range_map(param)["param"]
                state = dist_opt.optimizer.state.get(main, {})
                zeros = torch.zeros_like(main.detach())
                owned[index[param]] = {
                    "range": (param_range.start, param_range.end), "master": main.detach().clone(),
                    "exp_avg": state.get("exp_avg", zeros).detach().clone(),
                    "exp_avg_sq": state.get("exp_avg_sq", zeros).detach().clone()}
    return owned


def gathered_state(optimizer, names: list[str], params: list[nn.Parameter],
                   dp_group: dist.ProcessGroup, owned=owned_state) -> dict[str, dict[str, torch.Tensor]]:
    """Every param's whole fp32 master and Adam moments by name: each DP rank's pieces
    (``owned(optimizer, params)``, :func:`owned_state`), gathered over the DP group as objects
    (the pieces differ in size). The one reader of Megatron's masters: the ``optim`` check's
    adapter (:class:`MegatronShardedOptimizer`) and the twin's
    (``optimizer.MegatronTrainingOptimizer``) both read through it."""
    mine = owned(optimizer, params)
    pieces: list[dict[int, dict] | None] = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(pieces, mine, group=dp_group)
    out = {}
    for i, (name, param) in enumerate(zip(names, params)):
        full = {key: torch.full((param.numel(),), float("nan"))
                for key in ("master", "exp_avg", "exp_avg_sq")}
        for rank_pieces in pieces:
            piece = rank_pieces.get(i) if rank_pieces else None
            if piece is None:
                continue
            lo, hi = piece["range"]
            for key, tensor in full.items():
                tensor[lo:hi] = piece[key].reshape(-1)
        out[name] = {key: tensor.view(param.shape) for key, tensor in full.items()}
    return out


class MegatronDataParallel(DataParallelModule):
    """A module in Megatron-Core's ``DistributedDataParallel`` on ``dp_group``. ``ddp_class``: the
    DDP class (a test's broken copy of Megatron's)."""

    def __init__(self, module: nn.Module, config: DDPConfig, dp_group: dist.ProcessGroup | None,
                 averaging: Averaging | None = None, ddp_class: type | None = None) -> None:
        from megatron.core.distributed import DistributedDataParallel

        dtypes = {p.dtype for p in module.parameters()}
        self.fp16, self.bf16 = torch.float16 in dtypes, torch.bfloat16 in dtypes
        if self.fp16 and self.bf16:
            raise ValueError("Megatron-Core's optimizer takes fp16 or bf16 params, not both")
        self.param_dtype = (torch.float16 if self.fp16 else torch.bfloat16 if self.bf16
                            else torch.float32)
        # a bool or a way config contradicts is refused; POSTSCALE has no Megatron-Core flags
        flags = config.resolve_averaging(averaging).megatron_flags()
        self._module, self._ddp_config = module, config
        self.groups = data_parallel_groups(dp_group, {})
        self.config = model_config(fp16=self.fp16, bf16=self.bf16, params_dtype=self.param_dtype,
                                   calculate_per_token_loss=flags.calculate_per_token_loss)
        ddp_config = megatron_ddp_config(config, installed(), _unsupported)
        self.ddp = (ddp_class or DistributedDataParallel)(self.config, ddp_config, module,
                                                          pg_collection=self.groups)
        self._grid = ParallelDims.data_parallel(dp_group)
        # The optimizer's zero_grad, after the buffers are zeroed (Megatron-LM's train_step).
        self.on_zero_grad: list = []

    @property
    def grid(self) -> ParallelDims:
        return self._grid

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def ddp_config(self) -> DDPConfig:
        return self._ddp_config

    def named_parameters(self) -> Mapping[str, nn.Parameter]:
        return dict(self._module.named_parameters())

    def zero_grad_buffer(self) -> None:
        self.ddp.zero_grad_buffer()
        for zero_grad in self.on_zero_grad:
            zero_grad()

    def finish_grad_sync(self) -> None:
        self.ddp.finish_grad_sync()


def optimizer_config(settings: OptimizerSettings, *, dtype: torch.dtype,
                     overlap_param_gather: bool):
    """The ``OptimizerConfig`` Megatron-LM would build: Adam with decoupled weight decay over
    ``dtype`` params and fp32 masters, the distributed optimizer, the settings' clipping and
    loss scaling (fp16 without one: a constant scale of 1)."""
    from megatron.core.optimizer import OptimizerConfig

    fp16, bf16 = dtype is torch.float16, dtype is torch.bfloat16
    hyper, scaling = settings.adamw, settings.loss_scaling
    schedule = scheduled_hyperparameters(settings)
    scale: dict[str, float | int] = {}
    if scaling is None and fp16:
        scale = {"loss_scale": 1.0}  # fp16 unscaled: Megatron's ConstantGradScaler of 1
    elif scaling is not None and not scaling.dynamic:
        scale = {"loss_scale": scaling.initial_scale}
    elif scaling is not None:
        if not fp16:
            raise ValueError("Megatron-Core's dynamic loss scaler is fp16's (OptimizerConfig.fp16)")
        if not scaling.megatron_factors:
            raise ValueError("Megatron-Core's dynamic loss scaler grows by 2 and backs off by 1/2 "
                             "(get_megatron_optimizer; OptimizerConfig has no field for them), got "
                             f"LossScaling.growth_factor={scaling.growth_factor}, "
                             f"backoff_factor={scaling.backoff_factor}")
        scale = {"initial_loss_scale": scaling.initial_scale, "min_loss_scale": scaling.min_scale,
                 "loss_scale_window": scaling.growth_interval, "hysteresis": scaling.hysteresis}
    return OptimizerConfig(
        optimizer="adam", lr=schedule.max_lr, min_lr=schedule.min_lr, weight_decay=schedule.start_wd,
        adam_beta1=hyper.beta1, adam_beta2=hyper.beta2, adam_eps=hyper.eps,
        clip_grad=settings.max_grad_norm or 0.0, fp16=fp16, bf16=bf16, params_dtype=dtype,
        use_distributed_optimizer=True, overlap_param_gather=overlap_param_gather, **scale)


def scheduled_hyperparameters(settings: OptimizerSettings) -> HyperparameterSchedule:
    """The settings' schedule, or their constant lr and weight decay as one."""
    if settings.schedule is not None:
        return settings.schedule
    return HyperparameterSchedule.constant(settings.adamw.lr, settings.adamw.weight_decay)


def param_scheduler(optimizer, settings: OptimizerSettings):
    """Megatron-LM's ``OptimizerParamScheduler`` driving the settings' schedule (warm-up, decay,
    weight-decay increment; constant without one), counting updates (increment 1). Its
    ``step`` applies each group's ``wd_mult``: no decay on 1-D params."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    schedule = scheduled_hyperparameters(settings)
    return OptimizerParamScheduler(
        optimizer, init_lr=schedule.init_lr, max_lr=schedule.max_lr, min_lr=schedule.min_lr,
        lr_warmup_steps=schedule.warmup_steps, lr_decay_steps=schedule.decay_steps,
        lr_decay_style=schedule.decay_style, start_wd=schedule.start_wd, end_wd=schedule.end_wd,
        wd_incr_steps=schedule.wd_incr_steps, wd_incr_style=schedule.wd_incr_style)


def loss_scale(optimizer, settings: OptimizerSettings) -> float | None:
    """The scale the next step's grads carry (None: the settings scale nothing)."""
    return None if settings.loss_scaling is None else float(optimizer.get_loss_scale())


def step_and_report(optimizer, scheduler, settings: OptimizerSettings) -> StepOutcome:
    """One ``optimizer.step()`` and, after a successful update, the scheduler's (Megatron-LM's
    ``train_step``: a step skipped on NaN/inf grads keeps the lr and weight decay), as the
    seam's :class:`StepOutcome`."""
    scale = loss_scale(optimizer, settings)
    stepped, norm, _ = optimizer.step()
    if stepped:
        scheduler.step(increment=1)
    max_norm = settings.max_grad_norm
    grad_norm = float(norm) if stepped and max_norm is not None and norm is not None else None
    coefficient = None
    if grad_norm is not None and math.isfinite(grad_norm):
        coefficient = max_norm / (grad_norm + CLIP_EPS)  # what clip_grad_by_total_norm_fp32 uses
    return StepOutcome(stepped=bool(stepped), grad_norm=grad_norm, clip_coefficient=coefficient,
                       loss_scale=scale, reason="" if stepped else "found NaN/inf in the grads")


class MegatronShardedOptimizer(ShardedOptimizer):
    """``get_megatron_optimizer`` and ``OptimizerParamScheduler`` over a :class:`MegatronDataParallel`.
    ``owned``: how this rank's masters are found (:func:`owned_state`; a test's broken copy
    gives another)."""

    owned = staticmethod(owned_state)

    def __init__(self, model: MegatronDataParallel, settings: OptimizerSettings) -> None:
        from megatron.core.optimizer import get_megatron_optimizer

        if settings.sgd is not None:
            raise _unsupported(SGD_UNSUPPORTED)
        if settings.decay_1d_params and settings.adamw.weight_decay > 0 and any(
                p.dim() == 1 for p in model.named_parameters().values()):
            raise _unsupported(DECAY_1D_UNSUPPORTED)
        self.model, self.settings = model, settings
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="full scope is deprecated")
            self.optimizer = get_megatron_optimizer(
                optimizer_config(settings, dtype=model.param_dtype,
                                 overlap_param_gather=model.ddp_config.overlap_param_gather),
                [model.ddp], use_gloo_process_groups=False, pg_collection=model.groups)
        self.scheduler = param_scheduler(self.optimizer, settings)
        model.on_zero_grad.append(self.optimizer.zero_grad)
        self.names = list(model.named_parameters())
        self.params = [model.named_parameters()[n] for n in self.names]

    @property
    def loss_scale(self) -> float | None:
        return loss_scale(self.optimizer, self.settings)

    @property
    def param_gather_in_flight(self) -> bool:
        return any(group.param_gather_handle is not None for group in self.model.ddp.bucket_groups)

    def step(self) -> StepOutcome:
        return step_and_report(self.optimizer, self.scheduler, self.settings)

    def state(self) -> dict[str, AdamWState]:
        return {name: AdamWState(entry["master"], entry["exp_avg"], entry["exp_avg_sq"])
                for name, entry in self.named_state().items()}

    def finish_param_sync(self) -> None:
        """Gather every param now, leaving Megatron's own bookkeeping as it was: a forced sync
        marks each bucket group dispatched, and the next forward's pre-hooks would then skip
        the all-gather of the next step's update (``finish_grad_sync`` clears the mark, the
        forward's ``finish_param_sync`` dispatches only unmarked groups). The check observes
        between the backward and the step; its observation must not change what comes next."""
        groups = self.model.ddp.bucket_groups
        dispatched = [group.param_gather_dispatched for group in groups]
        self.model.ddp.start_param_sync(force_sync=True)
        for group, was in zip(groups, dispatched):
            group.param_gather_dispatched = was

    def close(self) -> None:
        if self.optimizer.zero_grad in self.model.on_zero_grad:
            self.model.on_zero_grad.remove(self.optimizer.zero_grad)

    def loss_scaler_state(self) -> LossScalerState | None:
        scaler = _distributed_optimizers(self.optimizer)[0].grad_scaler
        if self.settings.loss_scaling is None or scaler is None:
            return None
        return LossScalerState(scale=float(scaler.scale),
                               growth_tracker=int(getattr(scaler, "_growth_tracker", 0)),
                               hysteresis_tracker=int(getattr(scaler, "_hysteresis_tracker", 1)))

    def publish_params(self) -> None:
        self.model.ddp.start_param_sync()

    def gather_in_flight(self, params: Iterable[nn.Parameter]) -> bool:
        owner = self.model.ddp.param_to_bucket_group
        return any(owner[p].param_gather_handle is not None for p in params if p in owner)

    def named_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every param's whole master and moments (:func:`gathered_state`)."""
        return gathered_state(self.optimizer, self.names, self.params, self.model.groups.dp,
                              self.owned)

    def checkpoint(self) -> OptimizerCheckpoint:
        raise _unsupported(CHECKPOINT_UNSUPPORTED)

    def load_checkpoint(self, checkpoint: OptimizerCheckpoint) -> None:
        raise _unsupported(CHECKPOINT_UNSUPPORTED)

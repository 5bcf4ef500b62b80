"""How the twin trains: a sealed set of frozen dataclasses, one per training variant.

:data:`TwinTraining` is one of

- :class:`SGDTwin`: the ``pipeline`` check's SGD (``PipelineTraining.train``, the case's lr);
- :class:`AdamWTwin`: AdamW through the candidate's optimizer over its DDP chunks, with
  clipping, loss scaling and the param all-gather, at a :class:`TwinPrecision` (fp32, or
  16-bit params and compute with an fp32 or 16-bit main-grad buffer), its lr and weight decay
  changing at every update (:data:`TWIN_SCHEDULE`);
- :class:`MXFP8Twin`: that AdamW over MXFP8 params (``--fp8-recipe mxfp8 --fp8-param-gather``).

Each variant says what the candidate builds for it (:meth:`stage_settings`,
:meth:`optimizer_settings`: None for SGD, which needs no optimizer), so the rank side
dispatches on those typed settings, never on a name.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from gradvocab import CONSTANT_SCALE_WINDOW, AdamWConfig, LossScaling
from verify.candidates.interfaces import (
    HyperparameterSchedule,
    MXFP8Params,
    OptimizerSettings,
    StageSettings,
)
from verify.preflight.config import PreflightConfig

# The twin's AdamW (every candidate's): Megatron-LM's betas, eps and default --weight-decay (0.01), lr 1e-2.
TWIN_ADAMW = AdamWConfig(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
# Its lr and weight decay change at every update, as a training run's do (Megatron-LM's
# OptimizerParamScheduler): a warm-up of one update from 4e-3 to TWIN_ADAMW's 1e-2, then cosine
# decay to 1e-3 at update 3; the weight decay rising linearly from 0.005 to TWIN_ADAMW's 0.01
# over 2 updates. Updates 0, 1, 2 each have their own lr and weight decay.
TWIN_SCHEDULE = HyperparameterSchedule(
    max_lr=TWIN_ADAMW.lr, min_lr=1e-3, init_lr=4e-3, warmup_steps=1, decay_steps=3,
    decay_style="cosine", start_wd=0.005, end_wd=TWIN_ADAMW.weight_decay, wd_incr_steps=2,
    wd_incr_style="linear")


class Dtype(str, enum.Enum):
    """A param or grad dtype by Megatron's name."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def torch(self) -> torch.dtype:
        return {Dtype.FP32: torch.float32, Dtype.BF16: torch.bfloat16,
                Dtype.FP16: torch.float16}[self]


@dataclass(frozen=True)
class TwinPrecision:
    """The twin's param (and compute) dtype and its main-grad buffer dtype."""

    params: Dtype = Dtype.FP32
    grads: Dtype = Dtype.FP32

    def __post_init__(self) -> None:
        for name in ("params", "grads"):
            try:
                object.__setattr__(self, name, Dtype(getattr(self, name)))
            except ValueError:
                raise ValueError(f"TwinPrecision.{name} must be one of "
                                 f"{[d.value for d in Dtype]}, got {getattr(self, name)!r}") from None
        if self.grads not in (Dtype.FP32, self.params):
            raise ValueError(f"TwinPrecision.grads must be fp32 or the param dtype "
                             f"{self.params.value!r}, got {self.grads.value!r}")

    @property
    def param_dtype(self) -> torch.dtype:
        return self.params.torch

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.grads.torch

    @property
    def mixed(self) -> bool:
        """16-bit params (``refgrad.pipeline.precision``)."""
        return self.params is not Dtype.FP32


def power_of_two(value: float) -> bool:
    return value > 0 and math.isfinite(value) and math.frexp(value)[0] == 0.5


@dataclass(frozen=True)
class SGDTwin:
    """SGD with the case's ``lr`` (the ``pipeline`` check's update, ``refgrad.pipeline.sgd_update``)."""

    name: ClassVar[str] = "sgd"

    def stage_settings(self, overlap: bool) -> StageSettings | None:
        return None  # the candidate's own PipelineTraining.train builds and steps

    def optimizer_settings(self) -> OptimizerSettings | None:
        return None


@dataclass(frozen=True)
class AdamWTwin:
    """AdamW with clipping and loss scaling, taken from the configuration.

    ``loss_scale``: the initial scale (dynamic) or the constant one; None = no scaling.
    Megatron's ConstantGradScaler is modelled as a scaler that never changes (min = initial,
    a growth window no twin reaches).
    """

    max_grad_norm: float | None = None
    loss_scale: float | None = None
    dynamic: bool = False
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    overlap_param_gather: bool = False  # gather launched by step(), waited in forward pre-hooks
    precision: TwinPrecision = TwinPrecision()  # 16-bit params/compute and the grad buffer dtype
    schedule: HyperparameterSchedule = TWIN_SCHEDULE  # each update's lr and weight decay
    name: ClassVar[str] = "adamw"

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm)
                                                   and self.max_grad_norm > 0):
            raise ValueError(f"AdamWTwin.max_grad_norm must be finite and > 0, got {self.max_grad_norm}")
        if self.loss_scale is not None and not power_of_two(self.loss_scale):
            raise ValueError(f"AdamWTwin.loss_scale must be a power of two, got {self.loss_scale}")
        if not isinstance(self.precision, TwinPrecision):
            raise TypeError(f"AdamWTwin.precision must be a TwinPrecision, got "
                            f"{type(self.precision).__name__}")
        if not isinstance(self.schedule, HyperparameterSchedule):
            raise TypeError(f"AdamWTwin.schedule must be a HyperparameterSchedule, got "
                            f"{type(self.schedule).__name__}")

    @property
    def window(self) -> int:
        return self.loss_scale_window if self.dynamic else CONSTANT_SCALE_WINDOW

    @property
    def loss_scaling(self) -> LossScaling | None:
        """The scaler the candidate's optimizer is built with (None: no loss scaling)."""
        if self.loss_scale is None:
            return None
        return LossScaling(initial_scale=self.loss_scale,
                           min_scale=self.min_loss_scale if self.dynamic else self.loss_scale,
                           growth_interval=self.window, hysteresis=self.hysteresis)

    def stage_settings(self, overlap: bool) -> StageSettings | None:
        return StageSettings(param_dtype=self.precision.param_dtype,
                             grad_dtype=self.precision.grad_dtype, overlap_grad_reduce=overlap,
                             overlap_param_gather=self.overlap_param_gather)

    def optimizer_settings(self) -> OptimizerSettings | None:
        return OptimizerSettings(adamw=TWIN_ADAMW, max_grad_norm=self.max_grad_norm,
                                 loss_scaling=self.loss_scaling, schedule=self.schedule)


@dataclass(frozen=True)
class MXFP8Twin:
    """AdamW over MXFP8 params, and whether the param all-gather reuses the grad buffer
    (``--reuse-grad-buf-for-mxfp8-param-ag``, which needs both overlaps)."""

    adamw: AdamWTwin
    reuse_grad_buffer: bool = False
    name: ClassVar[str] = "adamw over MXFP8 params"

    def __post_init__(self) -> None:
        if not isinstance(self.adamw, AdamWTwin):
            raise TypeError(f"MXFP8Twin.adamw must be an AdamWTwin, got {type(self.adamw).__name__}")
        if self.adamw.loss_scale is not None:
            raise ValueError("MXFP8Twin.adamw.loss_scale must be None: fastgrad's MXFP8 buffer "
                             "takes no loss scaler (its grads are fp32)")
        if self.adamw.precision.mixed:
            raise ValueError("MXFP8Twin.adamw.precision must be fp32: the MXFP8 twin computes in "
                             "fp32 on the dequantized weights")
        if not isinstance(self.reuse_grad_buffer, bool):
            raise TypeError("MXFP8Twin.reuse_grad_buffer must be a bool")

    def stage_settings(self, overlap: bool) -> StageSettings | None:
        return StageSettings(overlap_grad_reduce=overlap,
                             overlap_param_gather=self.adamw.overlap_param_gather,
                             mxfp8=MXFP8Params(reuse_grad_buffer=self.reuse_grad_buffer))

    def optimizer_settings(self) -> OptimizerSettings | None:
        return self.adamw.optimizer_settings()


TwinTraining = SGDTwin | AdamWTwin | MXFP8Twin
TWIN_TRAININGS = (SGDTwin, AdamWTwin, MXFP8Twin)


def adamw_of(training: TwinTraining) -> AdamWTwin | None:
    """The AdamW settings a variant steps with (None: SGD)."""
    match training:
        case MXFP8Twin(adamw=adamw):
            return adamw
        case AdamWTwin():
            return training
        case SGDTwin():
            return None
    raise TypeError(f"not a twin training variant: {type(training).__name__}")


def twins_mxfp8(config: PreflightConfig) -> bool:
    """Whether the twin reproduces the configuration's MXFP8 params (``--fp8-recipe mxfp8
    --fp8-param-gather``; the configuration's validation already requires the distributed
    optimizer for ``--fp8-param-gather``)."""
    return config.fp8_recipe == "mxfp8" and config.fp8_param_gather

"""Hyper-parameters, the dynamic loss scaler and the step result of ``fastgrad.optim``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


def fp32(x: float) -> float:
    """``x`` rounded once to fp32 (nearest, ties to even; inf beyond the range), as a Python float.

    numpy's fp64 -> fp32 cast (a C cast: round to nearest even), ~50x cheaper than
    a torch scalar tensor: AdamW's scalars take two per step of the running ``beta^t``.
    """
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _positive_finite(owner: str, name: str, value: object, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}.{name} must be a float, got {type(value).__name__}")
    ok = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and ok):
        rule = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.{name} must be finite and {rule}, got {value}")


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW (decoupled weight decay) hyper-parameters of one param group."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        # lr 0 is allowed, as torch's: a warmup (Megatron's, LambdaLR's) starts there
        _positive_finite("AdamWConfig", "lr", self.lr, allow_zero=True)
        _positive_finite("AdamWConfig", "eps", self.eps)
        _positive_finite("AdamWConfig", "weight_decay", self.weight_decay, allow_zero=True)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _positive_finite("AdamWConfig", name, value, allow_zero=True)
            if not value < 1:
                raise ValueError(f"AdamWConfig.{name} must be in [0, 1), got {value}")


@dataclass(frozen=True)
class SGDConfig:
    """SGD hyper-parameters (torch semantics: coupled weight decay, dampening 0)."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _positive_finite("SGDConfig", "lr", self.lr, allow_zero=True)
        _positive_finite("SGDConfig", "momentum", self.momentum, allow_zero=True)
        _positive_finite("SGDConfig", "weight_decay", self.weight_decay, allow_zero=True)


OptimizerConfig = AdamWConfig | SGDConfig


@dataclass
class DynamicLossScaler:
    """Megatron-Core's dynamic grad scaler for fp16 (powers of two only, so unscaling is exact).

    On a step with NaN/inf grads: the growth tracker resets and the hysteresis
    counter drops; when it reaches 0 the scale is multiplied by
    ``backoff_factor`` (not below ``min_scale``). After ``growth_interval``
    clean steps in a row the scale is multiplied by ``growth_factor`` and the
    hysteresis is restored.
    """

    initial_scale: float = 2.0**16
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    scale: float = field(init=False)
    growth_tracker: int = field(init=False, default=0)
    hysteresis_tracker: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("initial_scale", "min_scale", "growth_factor", "backoff_factor"):
            value = getattr(self, name)
            _positive_finite("DynamicLossScaler", name, value)
            if math.frexp(value)[0] != 0.5:
                raise ValueError(
                    f"DynamicLossScaler.{name} must be a power of two (so unscaling is exact), "
                    f"got {value}"
                )
        if not self.growth_factor > 1 or not self.backoff_factor < 1:
            raise ValueError("DynamicLossScaler needs growth_factor > 1 and backoff_factor < 1")
        if self.min_scale > self.initial_scale:
            raise ValueError("DynamicLossScaler.min_scale must be <= initial_scale")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicLossScaler.{name} must be an int >= 1, got {value!r}")
        self.scale = float(self.initial_scale)
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (``found_inf``: the all-reduced flag)."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])

"""The optimizer's settings, one type each for every package.

fastgrad's optimizers take them (``DistributedOptimizer(ddp, AdamWConfig(lr=...))``,
``DynamicLossScaler(LossScaling(...))``), and so do gradverify's candidate seam
(``OptimizerSettings``), its checks and ``verify preflight``'s twin, so what a check asks for is
what the optimizer runs, with no translation between two spellings of the same numbers:

* :class:`AdamWConfig`: AdamW's hyperparameters (decoupled weight decay);
* :class:`SGDConfig`: SGD's (torch semantics: coupled weight decay, dampening 0);
* :class:`LossScaling`: a dynamic loss scaler's settings as Megatron-Core's
  ``DynamicGradScaler`` (``megatron/core/optimizer/grad_scaler.py``); the scaler itself, whose
  scale moves, is the optimizer's (``fastgrad.optim.DynamicLossScaler``).

Each validates itself on construction: a non-number is a TypeError, a number out of range a
ValueError, both naming the field and the rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A constant loss scale is a dynamic one that never grows: a growth interval no run reaches.
CONSTANT_SCALE_WINDOW = 2**31


def _finite(owner: str, name: str, value: object, *, minimum: float, inclusive: bool) -> None:
    """``value`` a finite int or float ``>= minimum`` (``> minimum`` unless ``inclusive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}.{name} must be a float, got {type(value).__name__}")
    ok = value >= minimum if inclusive else value > minimum
    if not (math.isfinite(value) and ok):
        rule = f"{'>=' if inclusive else '>'} {minimum:g}"
        raise ValueError(f"{owner}.{name} must be finite and {rule}, got {value}")


def _int_at_least_one(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int >= 1, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{owner}.{name} must be an int >= 1, got {value}")


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW's hyperparameters (decoupled weight decay) of one param group.

    ``lr`` 0 is allowed, as torch's: a warmup (Megatron-LM's, ``LambdaLR``'s) starts there.
    """

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _finite("AdamWConfig", "lr", self.lr, minimum=0, inclusive=True)
        _finite("AdamWConfig", "eps", self.eps, minimum=0, inclusive=False)
        _finite("AdamWConfig", "weight_decay", self.weight_decay, minimum=0, inclusive=True)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _finite("AdamWConfig", name, value, minimum=0, inclusive=True)
            if not value < 1:
                raise ValueError(f"AdamWConfig.{name} must be in [0, 1), got {value}")


@dataclass(frozen=True)
class SGDConfig:
    """SGD's hyperparameters: momentum (``dampening=0``, not Nesterov) and coupled weight
    decay, torch's semantics. ``lr`` 0 is allowed, as :class:`AdamWConfig`'s."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        for name in ("lr", "momentum", "weight_decay"):
            _finite("SGDConfig", name, getattr(self, name), minimum=0, inclusive=True)


@dataclass(frozen=True)
class LossScaling:
    """A dynamic loss scaler's settings, as Megatron-Core's ``DynamicGradScaler``: the loss is
    multiplied by the scale (first ``initial_scale``) before the backward; a step whose grads
    hold a NaN/inf is skipped and, after ``hysteresis`` such steps, multiplies the scale by
    ``backoff_factor`` (not below ``min_scale``); ``growth_interval`` clean steps in a row
    multiply it by ``growth_factor`` (and restore the hysteresis). Every factor is a power of
    two, so scaling and unscaling are exact. A constant scale is :meth:`constant`.
    """

    initial_scale: float = 2.0**16
    min_scale: float = 1.0
    growth_interval: int = 1000
    hysteresis: int = 2
    growth_factor: float = 2.0
    backoff_factor: float = 0.5

    def __post_init__(self) -> None:
        for name in ("initial_scale", "min_scale", "growth_factor", "backoff_factor"):
            value = getattr(self, name)
            _finite("LossScaling", name, value, minimum=0, inclusive=False)
            if math.frexp(value)[0] != 0.5:
                raise ValueError(f"LossScaling.{name} must be a power of two (so unscaling is "
                                 f"exact), got {value!r}")
        if not self.growth_factor > 1:
            raise ValueError(f"LossScaling.growth_factor must be > 1 (it grows the scale), "
                             f"got {self.growth_factor}")
        if not self.backoff_factor < 1:
            raise ValueError(f"LossScaling.backoff_factor must be < 1 (it shrinks the scale), "
                             f"got {self.backoff_factor}")
        if self.min_scale > self.initial_scale:
            raise ValueError(f"LossScaling.min_scale ({self.min_scale}) must be <= initial_scale "
                             f"({self.initial_scale})")
        for name in ("growth_interval", "hysteresis"):
            _int_at_least_one("LossScaling", name, getattr(self, name))

    @classmethod
    def constant(cls, scale: float) -> LossScaling:
        """Megatron-Core's ``ConstantGradScaler``: a scale that never moves."""
        return cls(initial_scale=scale, min_scale=scale, growth_interval=CONSTANT_SCALE_WINDOW,
                   hysteresis=1)

    @property
    def dynamic(self) -> bool:
        """False for :meth:`constant`'s scale, which never moves."""
        return self.min_scale != self.initial_scale or self.growth_interval != CONSTANT_SCALE_WINDOW

    @property
    def megatron_factors(self) -> bool:
        """Whether the scale grows by 2 and backs off by 1/2, the factors Megatron-Core's
        ``get_megatron_optimizer`` gives its ``DynamicGradScaler`` (its ``OptimizerConfig`` has
        no field for them)."""
        return self.growth_factor == 2.0 and self.backoff_factor == 0.5


__all__ = ["CONSTANT_SCALE_WINDOW", "AdamWConfig", "LossScaling", "SGDConfig"]

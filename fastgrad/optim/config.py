"""The optimizer's config types (gradvocab's) and the dynamic loss scaler of ``fastgrad.optim``.

``AdamWConfig``, ``SGDConfig`` and the scaler's settings ``LossScaling`` are
:mod:`gradvocab.optimizer_settings`' (one type each for fastgrad, the candidate seam and the
checks); the scaler, whose scale moves step by step, is fastgrad's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradvocab import AdamWConfig, LossScaling, SGDConfig


def fp32(x: float) -> float:
    """``x`` rounded once to fp32 (nearest, ties to even; inf beyond the range), as a Python float.

    numpy's fp64 -> fp32 cast (a C cast: round to nearest even), ~50x cheaper than
    a torch scalar tensor: AdamW's scalars take two per step of the running ``beta^t``.
    """
    with np.errstate(over="ignore"):
        return float(np.float32(x))


OptimizerConfig = AdamWConfig | SGDConfig


@dataclass
class DynamicLossScaler:
    """Megatron-Core's dynamic grad scaler for fp16, driven by its :class:`gradvocab.LossScaling`
    (default: ``LossScaling()``, a scale of 2**16 that halves after 2 overflowing steps and
    doubles after 1000 clean ones; powers of two only, so unscaling is exact).

    On a step with NaN/inf grads: the growth tracker resets and the hysteresis
    counter drops; when it reaches 0 the scale is multiplied by
    ``settings.backoff_factor`` (not below ``settings.min_scale``). After
    ``settings.growth_interval`` clean steps in a row the scale is multiplied by
    ``settings.growth_factor`` and the hysteresis is restored.
    """

    settings: LossScaling = field(default_factory=LossScaling)
    scale: float = field(init=False)
    growth_tracker: int = field(init=False, default=0)
    hysteresis_tracker: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.settings, LossScaling):
            raise TypeError("DynamicLossScaler.settings must be a gradvocab.LossScaling, got "
                            f"{type(self.settings).__name__}")
        self.scale = float(self.settings.initial_scale)
        self.hysteresis_tracker = self.settings.hysteresis

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (``found_inf``: the all-reduced flag)."""
        settings = self.settings
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * settings.backoff_factor, settings.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == settings.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = settings.hysteresis
            self.scale *= settings.growth_factor

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

"""Megatron-Core's loss scaler as the twin's reference steps it (written from its source).

``megatron/core/optimizer/grad_scaler.py`` ``DynamicGradScaler.update``: an
overflow (found-inf) resets the growth count and drops the hysteresis count,
multiplying the scale by 0.5 (not below the minimum) once that count reaches 0;
``window`` clean steps in a row double the scale and restore the hysteresis
count. The constant scaler is one that never moves (min = initial, a window no
twin reaches). ``fastgrad.optim.DynamicLossScaler`` is held to this.
"""

from __future__ import annotations


class ReferenceScaler:
    """The loss scale of each reference step; ``scale`` None: no loss scaling."""

    def __init__(self, scale: float | None, *, min_scale: float | None, window: int,
                 hysteresis: int) -> None:
        self.scale, self.min_scale = scale, min_scale
        self.window, self.hysteresis = window, hysteresis
        self.clean, self.hysteresis_left = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        """After a step: ``found_inf`` when its grads held a NaN/inf (the step was skipped)."""
        if self.scale is None:
            return
        if found_inf:
            self.clean = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
            return
        self.clean += 1
        if self.clean == self.window:
            self.clean, self.hysteresis_left = 0, self.hysteresis
            self.scale *= 2

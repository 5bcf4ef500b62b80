"""Deliberately broken fastgrad optimizers shared by the ``optim`` check's and the preflight
twin's tests (module-level, so spawned ranks can unpickle them)."""

from __future__ import annotations

from fastgrad.optim import DistributedOptimizer, DynamicLossScaler


class IgnoresSchedulerChanges(DistributedOptimizer):
    """Broken on purpose: reads its param groups' lr and weight decay at its first step only (a
    config cache never refreshed), so what a scheduler writes into them later never reaches
    the update."""

    _first_groups = None

    @property
    def groups(self):
        if self._first_groups is None:
            self._first_groups = super().groups
        return self._first_groups


class _BacksOffOneEarly(DynamicLossScaler):
    """Hysteresis off by one: backs off when the tracker reaches 1 instead of 0."""

    def update(self, found_inf):
        if found_inf and self.hysteresis_tracker - 1 == 1:
            self.growth_tracker, self.hysteresis_tracker = 0, 1
            self.scale = max(self.scale * self.settings.backoff_factor, self.settings.min_scale)
            return
        super().update(found_inf)


class _BacksOffOneLate(DynamicLossScaler):
    """Hysteresis off by one: backs off only when the tracker goes below 0."""

    def update(self, found_inf):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker < 0:
                self.scale = max(self.scale * self.settings.backoff_factor, self.settings.min_scale)
            return
        super().update(found_inf)


class _ScalerSwapped(DistributedOptimizer):
    scaler_cls: type = DynamicLossScaler

    def __init__(self, ddp, config, param_groups=None, *, loss_scaler=None, **kwargs):
        if loss_scaler is not None:
            loss_scaler = self.scaler_cls(loss_scaler.settings)
        super().__init__(ddp, config, param_groups, loss_scaler=loss_scaler, **kwargs)


class HysteresisOneEarly(_ScalerSwapped):
    """Broken on purpose: its loss scaler backs off one inf step too early."""

    scaler_cls = _BacksOffOneEarly


class HysteresisOneLate(_ScalerSwapped):
    """Broken on purpose: its loss scaler backs off one inf step too late."""

    scaler_cls = _BacksOffOneLate

"""The learning rate and weight decay of every update, as a typed schedule of the optimizer seam.

:class:`HyperparameterSchedule` is Megatron-LM's ``OptimizerParamScheduler``
(``megatron/core/optimizer_param_scheduler.py``) as data: a linear warm-up from ``init_lr``
to ``max_lr`` over ``warmup_steps`` updates, then a decay (``cosine``, ``linear`` or
``constant``) to ``min_lr`` at ``decay_steps``, ``min_lr`` after it; the weight decay rising
from ``start_wd`` to ``end_wd`` over ``wd_incr_steps`` (``linear``, ``cosine`` or
``constant``). Its fields are Megatron-LM's flags (``--lr``, ``--min-lr``, ``--lr-warmup-init``,
``--lr-warmup-iters``, ``--lr-decay-iters``, ``--lr-decay-style``, ``--start-weight-decay``,
``--end-weight-decay``, ``--weight-decay-incr-style``, ``--train-iters`` for the increment).

:meth:`HyperparameterSchedule.lr` and :meth:`~HyperparameterSchedule.weight_decay` give update
``k``'s values (``k`` = the updates that happened before it: Megatron-LM's ``train_step``
advances the scheduler only after a successful update, so a step skipped on NaN/inf grads
keeps its values), in the same fp64 operations as ``get_lr`` / ``get_wd``, so that a candidate
driving Megatron's own scheduler with the same fields gets the same floats. refgrad's
trajectory steps each update with them; fastgrad's optimizer reads them from its
``param_groups`` (set before each step, as torch's LR schedulers do); Megatron-Core's adapter
builds ``OptimizerParamScheduler`` from the fields. A param that takes no weight decay
(``decay_1d_params=False``: 1-D params) gets 0 at every update (Megatron's ``wd_mult`` 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LR_DECAY_STYLES = ("constant", "linear", "cosine")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def _finite(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number, got {value!r}")


def _count(owner: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class HyperparameterSchedule:
    """Per-update learning rate and weight decay (Megatron-LM's ``OptimizerParamScheduler``;
    see the module docstring). Validated as that scheduler's ``__init__`` asserts:
    ``0 <= min_lr <= max_lr``, ``0 <= init_lr <= max_lr``, ``0 <= warmup_steps <
    decay_steps``, ``0 <= start_wd <= end_wd`` (equal for a constant increment)."""

    max_lr: float
    min_lr: float
    decay_steps: int
    start_wd: float
    end_wd: float
    wd_incr_steps: int
    init_lr: float = 0.0
    warmup_steps: int = 0
    decay_style: str = "cosine"
    wd_incr_style: str = "linear"

    def __post_init__(self) -> None:
        owner = "HyperparameterSchedule"
        for name in ("max_lr", "min_lr", "init_lr", "start_wd", "end_wd"):
            _finite(owner, name, getattr(self, name))
        _count(owner, "warmup_steps", self.warmup_steps, 0)
        _count(owner, "decay_steps", self.decay_steps, 1)
        _count(owner, "wd_incr_steps", self.wd_incr_steps, 1)
        if not 0 <= self.min_lr <= self.max_lr or self.max_lr <= 0:
            raise ValueError(f"{owner}: need 0 <= min_lr <= max_lr and max_lr > 0, got min_lr "
                             f"{self.min_lr}, max_lr {self.max_lr}")
        if not 0 <= self.init_lr <= self.max_lr:
            raise ValueError(f"{owner}.init_lr must be in [0, max_lr = {self.max_lr}], got {self.init_lr}")
        if self.warmup_steps >= self.decay_steps:
            raise ValueError(f"{owner}.warmup_steps ({self.warmup_steps}) must be < decay_steps "
                             f"({self.decay_steps})")
        if not 0 <= self.start_wd <= self.end_wd:
            raise ValueError(f"{owner}: need 0 <= start_wd <= end_wd, got {self.start_wd}, {self.end_wd}")
        if self.decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"{owner}.decay_style must be one of {LR_DECAY_STYLES}, got "
                             f"{self.decay_style!r}")
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"{owner}.wd_incr_style must be one of {WD_INCR_STYLES}, got "
                             f"{self.wd_incr_style!r}")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(f"{owner}: a constant weight decay needs start_wd == end_wd, got "
                             f"{self.start_wd} and {self.end_wd}")

    @classmethod
    def constant(cls, lr: float, weight_decay: float) -> HyperparameterSchedule:
        """The same ``lr`` and ``weight_decay`` at every update."""
        return cls(max_lr=lr, min_lr=lr, init_lr=lr, decay_steps=1, decay_style="constant",
                   start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=1,
                   wd_incr_style="constant")

    def lr(self, update: int) -> float:
        """The learning rate of update ``update`` (0: the first), as ``get_lr`` computes it."""
        _count("HyperparameterSchedule.lr", "update", update, 0)
        if self.warmup_steps > 0 and update <= self.warmup_steps:
            return self.init_lr + ((self.max_lr - self.init_lr) * float(update)
                                   / float(self.warmup_steps))
        if self.decay_style == "constant":
            return self.max_lr
        if update > self.decay_steps:
            return self.min_lr
        ratio = float(update - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def weight_decay(self, update: int) -> float:
        """The weight decay of update ``update``, as ``get_wd`` computes it."""
        _count("HyperparameterSchedule.weight_decay", "update", update, 0)
        if update > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(update) / float(self.wd_incr_steps)
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def values(self, updates: int) -> tuple[tuple[float, float], ...]:
        """``(lr, weight_decay)`` of updates ``0 .. updates - 1``."""
        return tuple((self.lr(k), self.weight_decay(k)) for k in range(updates))

    def megatron_flags(self) -> tuple[str, ...]:
        """The Megatron-LM flags of this schedule (``--train-iters``: the weight decay's
        increment horizon, which Megatron-LM takes from the run's length)."""
        return (f"--lr {self.max_lr:g}", f"--min-lr {self.min_lr:g}",
                f"--lr-warmup-init {self.init_lr:g}", f"--lr-warmup-iters {self.warmup_steps}",
                f"--lr-decay-iters {self.decay_steps}", f"--lr-decay-style {self.decay_style}",
                f"--start-weight-decay {self.start_wd:g}", f"--end-weight-decay {self.end_wd:g}",
                f"--weight-decay-incr-style {self.wd_incr_style}",
                f"--train-iters {self.wd_incr_steps}")


__all__ = ["LR_DECAY_STYLES", "WD_INCR_STYLES", "HyperparameterSchedule"]

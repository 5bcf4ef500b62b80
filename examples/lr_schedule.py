"""Megatron-LM's learning-rate schedule as a torch LR scheduler (``examples/train_gpt.py``).

Megatron-Core's ``OptimizerParamScheduler.get_lr`` (megatron/core/optimizer_param_scheduler.py),
with ``num_steps`` the number of optimizer updates so far (Megatron counts samples,
``iterations * global_batch_size``; every ratio below is the same rational number in
either unit, so the fp64 results are identical):

* warmup (``num_steps <= warmup``, when ``warmup > 0``):
  ``init + (max - init) * num_steps / warmup``;
* ``constant``: ``max``; beyond ``decay_iters``: ``min``;
* otherwise ``ratio = (num_steps - warmup) / (decay_iters - warmup)`` and
  ``min + coeff * (max - min)`` with ``coeff = 1 - ratio`` (``linear``) or
  ``0.5 * (cos(pi * ratio) + 1)`` (``cosine``).

Megatron steps the schedule after each *successful* update only (a step skipped
for a NaN/inf gradient keeps the learning rate); the training loop does the same.
:class:`MegatronLR` is a ``torch.optim.lr_scheduler.LRScheduler``: its state is
torch's (``last_epoch`` = updates so far), saved and loaded with the checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """Megatron's flags: ``--lr``, ``--min-lr``, ``--lr-warmup-init``, ``--lr-warmup-iters``,
    ``--lr-decay-iters`` (train iterations when not given), ``--lr-decay-style``."""

    max_lr: float
    min_lr: float
    warmup_init: float
    warmup_iters: int
    decay_iters: int
    decay_style: str

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {DECAY_STYLES}, got {self.decay_style!r}")
        if self.decay_style != "constant" and self.decay_iters <= self.warmup_iters:
            raise ValueError(
                f"--lr-decay-iters ({self.decay_iters}) must exceed --lr-warmup-iters "
                f"({self.warmup_iters}) for --lr-decay-style {self.decay_style}"
            )

    def lr_at(self, num_steps: int) -> float:
        """The learning rate after ``num_steps`` updates (Megatron's ``get_lr``)."""
        if self.warmup_iters > 0 and num_steps <= self.warmup_iters:
            return self.warmup_init + (
                (self.max_lr - self.warmup_init) * float(num_steps) / float(self.warmup_iters))
        if self.decay_style == "constant":
            return self.max_lr
        if num_steps > self.decay_iters:
            return self.min_lr
        ratio = float(num_steps - self.warmup_iters) / float(self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


class MegatronLR(torch.optim.lr_scheduler.LRScheduler):
    """Sets every param group's ``lr`` to ``schedule.lr_at(updates so far)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> None:
        self.schedule = schedule
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [self.schedule.lr_at(self.last_epoch)] * len(self.optimizer.param_groups)

    def state_dict(self) -> dict:
        """torch's scheduler state without the schedule itself (rebuilt from the flags)."""
        return {k: v for k, v in super().state_dict().items() if k != "schedule"}

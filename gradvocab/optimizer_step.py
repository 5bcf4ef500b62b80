"""What one optimizer step did, as every optimizer here reports it.

fastgrad's ``DistributedOptimizer.step()`` returns it, each candidate's ``TrainingOptimizer``
(fastgrad's, Megatron-Core's, torch FSDP2's) reports its step in it, and the checks compare it
with refgrad's step: one record, so that no adapter translates between two spellings of the
same facts.
"""

from __future__ import annotations

from dataclasses import dataclass


def _optional_float(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"StepOutcome.{name} must be a float or None, got {type(value).__name__}")
    return float(value)


@dataclass(frozen=True)
class StepOutcome:
    """One optimizer step: ``stepped`` (False: skipped, e.g. on NaN/inf grads); the global grad
    norm it took (None: it took none, e.g. no clipping, no loss scaling and no NaN check); the
    clip coefficient ``max_norm / (norm + eps)`` (None: no clipping configured); the loss
    scale the step's grads carried (None: unscaled); and ``reason``, what the optimizer says
    about the step (why it skipped, a clip, params written behind its back; empty: nothing).
    """

    stepped: bool
    grad_norm: float | None
    clip_coefficient: float | None
    loss_scale: float | None
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.stepped, bool):
            raise TypeError(f"StepOutcome.stepped must be a bool, got {type(self.stepped).__name__}")
        if not isinstance(self.reason, str):
            raise TypeError(f"StepOutcome.reason must be a str, got {type(self.reason).__name__}")
        for name in ("grad_norm", "clip_coefficient", "loss_scale"):
            object.__setattr__(self, name, _optional_float(name, getattr(self, name)))


__all__ = ["StepOutcome"]

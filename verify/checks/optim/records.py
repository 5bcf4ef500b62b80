"""What the ``optim`` check's ranks send back to the check: typed records, pickled from a rank.

``gradvocab.RankResult`` is the pipelined runs' record (a rank's place in a grid, per-step
grads and params, an ``OptimizerRecord``); a rank of this check instead trains several cases,
resumes a checkpoint and reports, per step, what only this check compares (the peers'
agreement, the loss scaler, whether a forward read params still being gathered). So its
records are its own, built on the shared vocabulary where it applies (each step's
``gradvocab.StepOutcome``). A case or a checkpoint the candidate refuses (``Unsupported``) is a
:class:`Refused`, a value the comparisons match on, not a key to look for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gradvocab import StepOutcome
from verify.candidates.interfaces import OptimizerCheckpoint


@dataclass(frozen=True)
class Refused:
    """The candidate refused (raised ``Unsupported``): ``reason``, as the report's SKIP says it."""

    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason:
            raise ValueError(f"Refused.reason must be a non-empty str, got {self.reason!r}")


@dataclass(frozen=True)
class Snapshot:
    """The model after a step, once its param all-gathers arrived: ``params`` (full, by name)
    and ``state`` (the optimizer's full state: by param name, then by key, e.g. ``master``)."""

    params: dict[str, torch.Tensor]
    state: dict[str, dict[str, torch.Tensor]]

    def __post_init__(self) -> None:
        for name in ("params", "state"):
            if not isinstance(getattr(self, name), dict):
                raise TypeError(f"Snapshot.{name} must be a dict by param name, "
                                f"got {type(getattr(self, name)).__name__}")


@dataclass(frozen=True)
class StepRecord:
    """One step on one rank: the optimizer's ``outcome``; ``agreed`` (the case's ranks
    exchanged outcomes and all stepped, or all skipped; True where nothing was exchanged);
    ``scaler`` (the loss scaler's state after the step, ``LossScalerState.as_dict()``; None:
    no loss scaling); ``read_in_flight`` (the step's forward read a param whose all-gather was
    still in flight); ``launched`` (a param all-gather in flight after the step)."""

    outcome: StepOutcome
    agreed: bool
    scaler: dict[str, float | int] | None
    read_in_flight: bool
    launched: bool

    def __post_init__(self) -> None:
        if not isinstance(self.outcome, StepOutcome):
            raise TypeError(f"StepRecord.outcome must be a StepOutcome, got {type(self.outcome).__name__}")
        for name in ("agreed", "read_in_flight", "launched"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"StepRecord.{name} must be a bool, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class CaseRun:
    """One case (or resume) trained to its end on one rank. ``steps`` and ``snapshots``: one
    per step run (a snapshot None: not taken). ``final_read_in_flight``: the forward after
    the last step read a param still being gathered. ``loaded``: after loading a checkpoint
    (None: not resumed). ``checkpoint``: the one taken (None: none asked for), or the
    candidate's refusal to take one."""

    steps: tuple[StepRecord, ...]
    snapshots: tuple[Snapshot | None, ...]
    final_read_in_flight: bool
    loaded: Snapshot | None = None
    checkpoint: OptimizerCheckpoint | Refused | None = None

    def __post_init__(self) -> None:
        if len(self.steps) != len(self.snapshots):
            raise ValueError(f"CaseRun: one snapshot per step, got {len(self.snapshots)} snapshots "
                             f"for {len(self.steps)} steps")
        if not isinstance(self.final_read_in_flight, bool):
            raise TypeError(f"CaseRun.final_read_in_flight must be a bool, got {self.final_read_in_flight!r}")

    def step(self, index: int) -> StepRecord | None:
        """Step ``index``'s record (None: the run has no such step)."""
        return self.steps[index] if 0 <= index < len(self.steps) else None


# What a rank reports for a case: its run, or the candidate's refusal to run it.
CaseResult = CaseRun | Refused


@dataclass(frozen=True)
class RankRuns:
    """Everything one rank of the check ran: ``cases`` by index in the case matrix;
    ``checkpoint``, the one the resumes loaded (None: no resume here, or none taken);
    the checkpoint case resumed at DP=2 and at DP=3 (None: not on this rank); ``mxfp8``, the
    MXFP8 runs (``verify.checks.optim.mxfp8.train_mxfp8``'s; None: not on this rank)."""

    cases: dict[int, CaseResult] = field(default_factory=dict)
    checkpoint: OptimizerCheckpoint | None = None
    dp2_resumed: CaseResult | None = None
    dp3_resumed: CaseResult | None = None
    mxfp8: list[dict] | None = None


__all__ = ["CaseResult", "CaseRun", "RankRuns", "Refused", "Snapshot", "StepRecord"]

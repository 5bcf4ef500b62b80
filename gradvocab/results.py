"""What one rank of a multi-rank training run reports back to its launcher: one record.

The ``pipeline`` check and the preflight twin train the same pipelined model on every rank of
a grid and hold each rank's per-step observations to refgrad; whether the steps were SGD
updates (the check, the SGD twin) or a candidate's own optimizer (the optimizer twins), a rank
reports a :class:`RankResult`. What only an optimizer run has (its state, each step's outcome,
the param gathers, MXFP8 bits) is its :class:`OptimizerRecord`, present exactly when the rank
trained under an optimizer. The record is pickled back from the rank: plain data, no groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gradvocab.optimizer_step import StepOutcome
from gradvocab.timeline import TimelineEvent

# Where a bucket's reduction was launched (RankResult.launch_sites): by the hook of its last
# ready parameter, by the schedule's dispatch in the cooldown, by finish_grad_sync, or never.
LAUNCH_SITES = ("hook", "dispatch", "finish", "never")


def _non_negative_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner}.{name} must be an int >= 0, got {value!r}")


@dataclass
class OptimizerRecord:
    """Per step under a candidate's optimizer: ``state`` (its state by param name, then by
    key), ``steps`` (each step's :class:`StepOutcome`, as the candidate's optimizer reported
    it), ``gathers_waited_in_hooks`` (with overlap_param_gather at DP > 1: a gather in flight
    after the step, and every gather waited for by the next forward's pre-hooks), ``mxfp8`` (MXFP8 params: each param's
    ``(scale_bits, element_bits)`` by name) and ``buffer_shared`` (whether the param all-gather
    went through the grad buffer's bytes)."""

    state: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    steps: list[StepOutcome] = field(default_factory=list)
    gathers_waited_in_hooks: list[tuple[bool, bool]] = field(default_factory=list)
    mxfp8: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    buffer_shared: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.buffer_shared, bool):
            raise TypeError(f"OptimizerRecord.buffer_shared must be a bool, got {self.buffer_shared!r}")


@dataclass
class RankResult:
    """What one rank observed for one case (lists: one entry per step).

    ``stage``, ``dp_rank``, ``tp_rank``: the rank's place in the grid. ``grads``/``params``:
    this rank's parameters by global name (``refgrad.pipeline.stage_param_name``), the grads
    whole (with a distributed optimizer the other shards gathered). ``launch_sites``: per
    bucket, one of :data:`LAUNCH_SITES`. ``relearn_count``: how often the DDP relearned which
    params each bucket waits for (freezing and unfreezing a param; None: the candidate does
    not learn them). ``events``: the timeline, the rank's ``TimelineEvent`` records (empty: not
    recorded). ``chunk_enables`` (interleaved): at each chunk's grad-sync enable, the chunk and
    which chunks had a reduction in flight (empty: not recorded). ``errors``: what the candidate raised in a step
    it then finished anyway (``"step N: ..."``; that step's losses are NaN), so that its peers
    were not left waiting and the later steps still ran. ``drained_in_flight`` (per step;
    empty: not observed): whether this rank's deferred output-layer wgrads were drained while
    their bucket's DP reduction was already in flight (None: no drain on this rank).
    ``optimizer``: what the candidate's optimizer did (None: SGD steps, no optimizer).
    """

    stage: int
    dp_rank: int
    tp_rank: int = 0
    losses: list[list[float]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    launch_sites: list[tuple[str, ...]] = field(default_factory=list)
    relearn_count: int | None = 0
    events: list[list[TimelineEvent]] = field(default_factory=list)
    chunk_enables: list[list[tuple[int, tuple[bool, ...]]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    drained_in_flight: list[bool | None] = field(default_factory=list)
    optimizer: OptimizerRecord | None = None

    def __post_init__(self) -> None:
        for name in ("stage", "dp_rank", "tp_rank"):
            _non_negative_int("RankResult", name, getattr(self, name))
        if self.relearn_count is not None:
            _non_negative_int("RankResult", "relearn_count", self.relearn_count)
        if self.optimizer is not None and not isinstance(self.optimizer, OptimizerRecord):
            raise TypeError("RankResult.optimizer must be an OptimizerRecord or None, "
                            f"got {type(self.optimizer).__name__}")


__all__ = ["LAUNCH_SITES", "OptimizerRecord", "RankResult"]

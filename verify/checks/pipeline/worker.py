"""The pipeline check's spawned entry point: every rank asks the candidate for its
:class:`~verify.candidates.api.pipeline.PipelineTraining` and, inside its ``with`` scope,
builds each phase's grids side by side, then trains each of its cases with overlap on and
off."""

from __future__ import annotations

import traceback
from contextlib import ExitStack
from dataclasses import dataclass

import torch.distributed as dist

from verify.candidates.api import Candidate, Unsupported
from verify.candidates.api.pipeline import (
    PipelineCase,
    PipelineTraining,
    RankResult,
    StepProgress,
)


@dataclass(frozen=True)
class Raised:
    """What the candidate raised in a case on this rank (the case fails; the others run)."""

    detail: str


CaseOutcome = dict[bool, RankResult] | str | Raised
"""One case on one rank: its results by overlap setting, why the candidate cannot run it, or
what it raised."""


def pipeline_worker(rank: int, world_size: int, candidate: Candidate,
                    phases: list[list[PipelineCase]], *,
                    progress: StepProgress | None = None) -> dict[str, CaseOutcome]:
    """Run every phase's grids side by side; outcomes by case name (ranks outside a case's
    grid have none). A case the candidate cannot run maps to the reason (the candidate
    raises :class:`Unsupported` on every rank alike). The harness passes ``progress``: a rank
    that stalls is reported with its case, stage, step and last schedule event."""
    del rank, world_size  # the grid is read from torch.distributed
    try:
        training = candidate.pipeline()
    except Unsupported as unsupported:
        return {case.name: str(unsupported) for phase in phases for case in phase}
    with training:  # the candidate's per-process setup holds for every phase
        return _run_phases(training, phases, progress)


def _run_phases(training: PipelineTraining, phases: list[list[PipelineCase]],
                progress: StepProgress | None) -> dict[str, CaseOutcome]:
    out: dict[str, CaseOutcome] = {}
    for phase in phases:
        with ExitStack() as grids:  # each grid torn down (candidate's way) after the phase
            mine = []
            for case in phase:  # group creation is collective: every rank enters every grid
                try:
                    grid = grids.enter_context(training.grid(case.dims))
                except Unsupported as unsupported:
                    out[case.name] = str(unsupported)
                    continue
                if grid is not None:
                    mine.append((case, grid))
            for case, grid in mine:
                try:
                    out[case.name] = {overlap: training.train(case, grid, overlap=overlap,
                                                              progress=progress)
                                      for overlap in (True, False)}
                except Unsupported as unsupported:
                    out[case.name] = str(unsupported)
                except Exception as exc:  # noqa: BLE001 - the case's failure, with its type
                    # Every rank of a grid runs the same case, so a candidate that raises does
                    # so on every rank alike; one left waiting ends the run at the deadline.
                    where = traceback.extract_tb(exc.__traceback__)[-1]
                    out[case.name] = Raised(
                        f"{type(exc).__name__}: {exc} (raised at "
                        f"{where.filename.split('site-packages/')[-1]}:{where.lineno} {where.name})")
            dist.barrier()
    return out

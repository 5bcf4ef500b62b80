"""The pipeline check's rank side: one case trained with overlap on or off, on a world that is
exactly the case's grid.

Each (case, overlap) is one item of :func:`verify.distributed.spawn_each`: a candidate that
keeps process-wide state gets fresh processes for each, and a rank that raises ends its world
within seconds (its peers waiting in the schedule's collectives are stopped): the item's
outcome is then the crash, with its root cause. Nothing here catches the candidate's errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradvocab import RankResult
from verify.candidates.interfaces import Candidate, PipelineCase, StepProgress, Unsupported


@dataclass(frozen=True)
class PipelineRun:
    """One item: ``case`` (on ranks ``0..world-1``) trained with overlap on or off."""

    case: PipelineCase
    overlap: bool

    @property
    def label(self) -> str:
        return f"{self.case.name}, overlap {'on' if self.overlap else 'off'}"


def pipeline_worker(rank: int, world_size: int, run: PipelineRun, candidate: Candidate, *,
                    progress: StepProgress | None = None) -> RankResult | str:
    """Train ``run`` on this rank; why the candidate cannot run it (it raises
    :class:`Unsupported` on every rank alike, before any collective of the case) otherwise.
    The harness passes ``progress``: a rank that stalls is reported with its case, stage,
    step and last schedule event."""
    del rank, world_size  # the grid is read from torch.distributed
    try:
        training = candidate.pipeline()
    except Unsupported as unsupported:
        return str(unsupported)
    with training:
        try:
            with training.grid(run.case.dims) as grid:
                if grid is None:
                    raise RuntimeError(f"{run.label}: this rank is outside the case's grid, "
                                       f"though the world is the grid")
                return training.train(run.case, grid, overlap=run.overlap, progress=progress)
        except Unsupported as unsupported:
            return str(unsupported)

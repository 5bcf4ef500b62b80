"""The twin's rank side: train the case through the candidate seam, and the spawned entry points.

A :class:`TwinRun` names what one grid trains: the case, the overlap, the training variant
and the :class:`~verify.candidates.interfaces.Candidate` that trains it (fastgrad by default; a
deliberately broken one is a test's subclass, ``tests/candidates/fastgrad_faults.py``).
Inside the rank the twin reaches the implementation only through the candidate's interfaces,
each used inside its ``with`` scope (:class:`verify.candidates.interfaces.TechniqueScope`):
``candidate.pipeline()`` (its grid, its model chunks under its DDP and schedules) and, for
the AdamW variants, ``candidate.optimizer()`` built over those chunks.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field

import torch.distributed as dist

from gradvocab import OptimizerRecord, ParallelDims, RankResult
from verify.candidates.interfaces import (
    Candidate,
    DistributedOptimizerStep,
    OptimizerSettings,
    PipelineCase,
    PipelineModel,
    PipelineTraining,
    StageSettings,
)
from verify.candidates.registry import default_candidate
from verify.preflight.twin.variants import TWIN_TRAININGS, TwinTraining


@dataclass(frozen=True)
class TwinRun:
    """One twin on its grid (``case.dims.first_rank`` on): trained as ``training`` says, with
    ``overlap_grad_reduce`` = ``overlap``, by ``candidate``."""

    case: PipelineCase
    overlap: bool
    training: TwinTraining
    candidate: Candidate = field(default_factory=default_candidate)

    def __post_init__(self) -> None:
        if not isinstance(self.case, PipelineCase):
            raise TypeError("TwinRun.case must be a PipelineCase")
        if not isinstance(self.training, TWIN_TRAININGS):
            raise TypeError(f"TwinRun.training must be one of {[t.__name__ for t in TWIN_TRAININGS]}, "
                            f"got {type(self.training).__name__}")
        if not isinstance(self.candidate, Candidate):
            raise TypeError(f"TwinRun.candidate must be a Candidate, got {type(self.candidate).__name__}")


def _snapshot(result: RankResult, optimizer: OptimizerRecord, model: PipelineModel,
              optimizer_state: dict, mxfp8: bool) -> None:
    """The params as the forward uses them, the optimizer state, and the MXFP8 bits."""
    result.params.append({n: p.detach().clone() for n, p in model.named_parameters().items()})
    optimizer.state.append({n: s.as_dict() for n, s in optimizer_state.items()})
    if mxfp8:
        optimizer.mxfp8.append(model.mxfp8_bits())


def train_with_optimizer(run: TwinRun, training: PipelineTraining,
                         optimizer: DistributedOptimizerStep, grid: ParallelDims,
                         stage: StageSettings, settings: OptimizerSettings) -> RankResult:
    """Train ``run.case`` on this rank with the candidate's DDP, schedules and optimizer,
    recording every step. The params and state of step ``k`` are read after the forward of
    step ``k + 1`` (the param all-gather, overlapped or not, is done by then; reading the
    state earlier would wait in the forward pre-hooks' place), the last step's after
    ``finish_param_sync``."""
    model = training.model(run.case, grid, stage)
    opt = optimizer.build(model, settings)
    record = OptimizerRecord()
    result = RankResult(stage=grid.stage, dp_rank=grid.dp_rank, tp_rank=grid.tp_rank,
                        optimizer=record)
    mxfp8 = stage.mxfp8 is not None
    watch_gathers = stage.overlap_param_gather and grid.dp_size > 1 and not mxfp8
    try:
        for step in range(len(run.case.plans)):
            scale = opt.loss_scale
            launched = opt.param_gather_in_flight
            losses = model.train_step(step, loss_scale=1.0 if scale is None else scale)
            if step > 0:
                if watch_gathers:
                    record.gathers_waited_in_hooks.append((launched, not opt.param_gather_in_flight))
                _snapshot(result, record, model, opt.state(), mxfp8)
            result.launch_sites.append(model.launch_sites())
            result.losses.append(losses)
            result.grads.append(model.reduced_grads())
            record.steps.append(opt.step())
        opt.finish_param_sync()  # the last step's gather: no forward follows it
        _snapshot(result, record, model, opt.state(), mxfp8)
        record.buffer_shared = model.mxfp8_grad_buffer_shared
    finally:
        opt.close()
        model.close()
    return result


def train_on_grid(run: TwinRun, training: PipelineTraining,
                  optimizer: DistributedOptimizerStep | None,
                  grid: ParallelDims) -> RankResult:
    """One rank's training of ``run`` on its entered ``grid``: the candidate's own SGD
    training (the ``pipeline`` check's), or its model under its optimizer."""
    stage = run.training.stage_settings(run.overlap)
    settings = run.training.optimizer_settings()
    if stage is None or settings is None or optimizer is None:
        return training.train(run.case, grid, overlap=run.overlap)
    return train_with_optimizer(run, training, optimizer, grid, stage, settings)


def train_phase(phase: list[TwinRun]) -> list[RankResult | None]:
    """Several twins side by side in the world, each on its own grid: every rank enters every
    grid (its groups are collective over the world), then trains its own; None elsewhere."""
    with ExitStack() as stack:
        scopes = []
        for run in phase:
            training = stack.enter_context(run.candidate.pipeline())
            optimizer = None
            if run.training.optimizer_settings() is not None:
                optimizer = stack.enter_context(run.candidate.optimizer())
            scopes.append((training, optimizer))
        grids = [stack.enter_context(training.grid(run.case.dims))
                 for run, (training, _) in zip(phase, scopes)]
        return [None if grid is None else train_on_grid(run, training, optimizer, grid)
                for run, (training, optimizer), grid in zip(phase, scopes, grids)]


def twin_phases_worker(rank: int, world_size: int, phases: list[list[TwinRun]]
                       ) -> list[list[RankResult | None]]:
    """Spawned entry point for several twins in one world (``verify.distributed.spawn``):
    one phase after another, each grid on ranks ``[case.first_rank, case.first_rank +
    case.world)``. A broken candidate breaks only its own grid's case."""
    del rank, world_size  # each grid is read from torch.distributed
    out = []
    for phase in phases:
        out.append(train_phase(phase))
        dist.barrier()
    return out


def run_twin_rank(run: TwinRun) -> RankResult | None:
    """Train the twin on this rank of the current world (None outside its grid)."""
    return train_phase([run])[0]


def twin_worker(rank: int, world_size: int, run: TwinRun) -> RankResult | None:
    """Spawned entry point (``verify.distributed.spawn``): one rank's results."""
    del rank, world_size  # the grid is read from torch.distributed
    return run_twin_rank(run)

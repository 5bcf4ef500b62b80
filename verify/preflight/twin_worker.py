"""The twin's rank side: which fastgrad it runs, and the spawned (or torchrun) entry point.

A :class:`TwinCandidate` names the fastgrad the twin trains with. Production's
is the default; tests hand in a deliberately broken one (a drain that runs its
deferred GEMMs last-in first-out) to prove that preflight notices. The broken
pieces are installed inside the rank's own process only (spawned children, or
the caller's process under torchrun, where a test may ask for it), never in the
parent that compares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DRAIN_ORDERS = ("fifo", "lifo")


@dataclass(frozen=True)
class TwinCandidate:
    """The fastgrad under test. ``drain_order="lifo"`` breaks the deferred-wgrad drain on purpose."""

    name: str = "fastgrad"
    drain_order: str = "fifo"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TwinCandidate.name must be a non-empty string, got {self.name!r}")
        if self.drain_order not in DRAIN_ORDERS:
            raise ValueError(f"TwinCandidate.drain_order must be one of {DRAIN_ORDERS}, "
                             f"got {self.drain_order!r}")

    @property
    def is_production(self) -> bool:
        return self.drain_order == "fifo"


def _lifo_drain(layer: Any, reduce_in_flight: Any = None) -> int:
    """A wrong drain: the deferred GEMMs run newest first (a different fp32 sum order)."""
    from fastgrad.deferred_wgrad import ColumnParallelOutputLayer

    layer.activation_buffer.reverse()
    layer.grad_output_buffer.reverse()
    return _PRODUCTION_DRAIN[ColumnParallelOutputLayer](layer, reduce_in_flight)


_PRODUCTION_DRAIN: dict[type, Any] = {}


def install_candidate(candidate: TwinCandidate) -> None:
    """Swap the broken pieces of ``candidate`` into fastgrad, in this process only."""
    if candidate.is_production:
        return
    from fastgrad.deferred_wgrad import ColumnParallelOutputLayer

    _PRODUCTION_DRAIN.setdefault(ColumnParallelOutputLayer,
                                 ColumnParallelOutputLayer.drain_deferred_wgrad)
    ColumnParallelOutputLayer.drain_deferred_wgrad = _lifo_drain


def run_on_grid(case: Any, groups: Any, overlap: bool, optimizer: str) -> Any:
    """One rank's training: SGD (``verify.checks.pipeline``) or fastgrad.optim's AdamW."""
    if optimizer != "sgd":  # "adamw", or its AdamWTwin settings (TwinPlan.rank_optimizer)
        from verify.preflight.twin_optim import run_optimizer_rank

        return run_optimizer_rank(case, groups, overlap, None if optimizer == "adamw" else optimizer)
    from verify.checks.pipeline import run_case_on_rank

    return run_case_on_rank(case, groups, overlap)


def run_twin_rank(case: Any, overlap: bool, optimizer: str = "sgd") -> Any:
    """Train the twin's case on this rank of the current world; None outside its grid."""
    from fastgrad.pipeline import build_parallel_groups

    groups = build_parallel_groups(case.pp_size, case.dp_size, first_rank=case.first_rank)
    if groups is None:
        return None
    return run_on_grid(case, groups, overlap, optimizer)


def twin_phases_worker(rank: int, world_size: int,
                       phases: list[list[tuple[Any, bool, TwinCandidate, str]]]) -> list[list[Any]]:
    """Several twins side by side in one world: ``(case, overlap, candidate, optimizer)`` per grid,
    each grid on ranks ``[case.first_rank, case.first_rank + case.world)``, one phase after
    another. A candidate is installed only on its grid's ranks (and stays for later phases)."""
    del world_size
    import torch.distributed as dist

    from fastgrad.pipeline import build_parallel_groups

    out = []
    for phase in phases:
        # new_group is collective over the whole world: every rank builds every grid first.
        groups = [build_parallel_groups(case.pp_size, case.dp_size, first_rank=case.first_rank)
                  for case, *_ in phase]
        results = []
        for (case, overlap, candidate, optimizer), grid in zip(phase, groups):
            if grid is None:
                results.append(None)
                continue
            install_candidate(candidate)
            results.append(run_on_grid(case, grid, overlap, optimizer))
        out.append(results)
        dist.barrier()
    return out


def twin_worker(rank: int, world_size: int, case: Any, overlap: bool,
                candidate: TwinCandidate, optimizer: str = "sgd") -> Any:
    """Spawned entry point (``verify.distributed.spawn``): one rank's results."""
    del rank, world_size  # the grid is read from torch.distributed
    install_candidate(candidate)
    return run_twin_rank(case, overlap, optimizer)

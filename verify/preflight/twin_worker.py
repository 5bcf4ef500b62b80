"""The twin's rank side: which fastgrad it runs, and the spawned (or torchrun) entry point.

A :class:`TwinCandidate` names the fastgrad the twin trains with. Production's
is the default; tests hand in deliberately broken ones (a drain that runs its
deferred GEMMs last-in first-out, a tied embedding all-reduced with the
other TP rank's output layer, or, tied at PP 1, the shared weight's two grads
added in the wrong order or one dropped) to prove that preflight notices. Each
is a :class:`verify.candidates.api.Fault` its ranks apply (as fastgrad's pipeline adapter,
``verify.candidates.fastgrad.pipeline``, does): each rank builds its own output
layer with the wrong drain or wgrad, or its own wrong embedding group; no
library class is changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verify.candidates.api import Fault

DRAIN_ORDERS = ("fifo", "lifo")
EMBEDDING_GROUPS = ("same_tp_rank", "other_tp_rank")
# Tied at PP 1 (one shared weight): per microbatch the output layer's wgrad, then the first
# layer's grad (production); the other order, or the output layer's wgrad dropped (broken).
SHARED_WEIGHT_GRADS = ("head_first", "embedding_first", "head_dropped")
_SHARED_WEIGHT_FAULTS = {"embedding_first": "embedding_grad_first",
                         "head_dropped": "dropped_head_wgrad"}


@dataclass(frozen=True)
class TwinCandidate:
    """The fastgrad under test. ``drain_order="lifo"`` breaks the deferred-wgrad drain on purpose;
    ``embedding_group="other_tp_rank"`` all-reduces each tied embedding shard (TP 2) with the
    other TP rank's output-layer shard; ``shared_weight_grads`` (tied at PP 1, one weight)
    ``"embedding_first"`` adds the output layer's wgrad after the first layer's grad,
    ``"head_dropped"`` never adds it."""

    name: str = "fastgrad"
    drain_order: str = "fifo"
    embedding_group: str = "same_tp_rank"
    shared_weight_grads: str = "head_first"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TwinCandidate.name must be a non-empty string, got {self.name!r}")
        if self.drain_order not in DRAIN_ORDERS:
            raise ValueError(f"TwinCandidate.drain_order must be one of {DRAIN_ORDERS}, "
                             f"got {self.drain_order!r}")
        if self.embedding_group not in EMBEDDING_GROUPS:
            raise ValueError(f"TwinCandidate.embedding_group must be one of {EMBEDDING_GROUPS}, "
                             f"got {self.embedding_group!r}")
        if self.shared_weight_grads not in SHARED_WEIGHT_GRADS:
            raise ValueError(f"TwinCandidate.shared_weight_grads must be one of "
                             f"{SHARED_WEIGHT_GRADS}, got {self.shared_weight_grads!r}")
        if len(self._faults()) > 1:
            raise ValueError("TwinCandidate: one fault at a time (drain_order, embedding_group "
                             "or shared_weight_grads)")

    def _faults(self) -> list[str]:
        """The fault of each setting that departs from production."""
        faults = ["lifo_drain" if self.drain_order == "lifo" else None,
                  "crossed_embedding_group" if self.embedding_group == "other_tp_rank" else None,
                  _SHARED_WEIGHT_FAULTS.get(self.shared_weight_grads)]
        return [f for f in faults if f is not None]

    @property
    def fault(self) -> Fault | None:
        """The fault its ranks apply; None: production's fastgrad."""
        faults = self._faults()
        return Fault(faults[0]) if faults else None

    @property
    def is_production(self) -> bool:
        return self.fault is None


def run_on_grid(case: Any, groups: Any, overlap: bool, optimizer: Any,
                fault: Fault | None = None) -> Any:
    """One rank's training: SGD (the ``pipeline`` check's), fastgrad.optim's AdamW
    (``"adamw"`` or an ``AdamWTwin``), or AdamW over MXFP8 params (an ``MXFP8Twin``), broken
    as ``fault`` says (a wrong group is applied here)."""
    from verify.candidates.fastgrad.pipeline import with_fault_groups
    from verify.preflight.twin_mxfp8 import MXFP8Twin, run_mxfp8_rank

    groups = with_fault_groups(case, groups, fault)
    if isinstance(optimizer, MXFP8Twin):  # MXFP8 params under fastgrad.optim's AdamW
        return run_mxfp8_rank(case, groups, overlap, optimizer)
    if optimizer != "sgd":  # "adamw", or its AdamWTwin settings (TwinPlan.rank_optimizer)
        from verify.preflight.twin_optim import run_optimizer_rank

        return run_optimizer_rank(case, groups, overlap, None if optimizer == "adamw" else optimizer,
                                  fault)
    from verify.candidates.fastgrad.pipeline import run_case_on_rank

    return run_case_on_rank(case, groups, overlap, fault=fault)


def run_twin_rank(case: Any, overlap: bool, optimizer: str = "sgd",
                  candidate: TwinCandidate | None = None) -> Any:
    """Train the twin's case (as ``candidate`` runs it) on this rank of the current world;
    None outside its grid."""
    groups = case.dims.build()
    if groups is None:
        return None
    return run_on_grid(case, groups, overlap, optimizer, (candidate or TwinCandidate()).fault)


def twin_phases_worker(rank: int, world_size: int,
                       phases: list[list[tuple[Any, bool, TwinCandidate, str]]]) -> list[list[Any]]:
    """Several twins side by side in one world: ``(case, overlap, candidate, optimizer)`` per grid,
    each grid on ranks ``[case.first_rank, case.first_rank + case.world)``, one phase after
    another. A broken candidate breaks only its own grid's case."""
    del world_size
    import torch.distributed as dist

    out = []
    for phase in phases:
        # new_group is collective over the whole world: every rank builds every grid first.
        groups = [case.dims.build() for case, *_ in phase]
        results = []
        for (case, overlap, candidate, optimizer), grid in zip(phase, groups):
            if grid is None:
                results.append(None)
                continue
            results.append(run_on_grid(case, grid, overlap, optimizer, candidate.fault))
        out.append(results)
        dist.barrier()
    return out


def twin_worker(rank: int, world_size: int, case: Any, overlap: bool,
                candidate: TwinCandidate, optimizer: str = "sgd") -> Any:
    """Spawned entry point (``verify.distributed.spawn``): one rank's results."""
    del rank, world_size  # the grid is read from torch.distributed
    return run_twin_rank(case, overlap, optimizer, candidate)

"""Shared by the preflight twin tests: several twin layouts trained in one spawned world.

A layout maps a name to ``(flags, first rank[, phase])``: each twin's ranks start at
``first rank`` of the world, and twins of one phase run side by side on disjoint ranks
(``verify.preflight.twin.rank.twin_phases_worker``); phases run one after another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tests.distributed_utils import run_distributed
from verify.candidates import FastgradCandidate
from verify.candidates.interfaces import Candidate
from verify.preflight.twin import TwinOptions, finish_twin_report, plan_twin
from verify.preflight.twin.rank import TwinRun, twin_phases_worker


def plan_layout(layout: dict, config_for: Callable[[list[str]], tuple[Any, dict]],
                options: TwinOptions) -> dict:
    """name -> (config, report, plan, phase, index in its phase)."""
    plans, counts = {}, {}
    for name, (flags, first, *phase) in layout.items():
        config, report = config_for(flags)
        plan = plan_twin(config, options)
        phase = phase[0] if phase else 0
        counts[phase] = counts.get(phase, -1) + 1
        plans[name] = (config, report, replace(plan, case=plan.case.at(first)),
                       phase, counts[phase])
    return plans


def phases_of(plans: dict, candidates: dict[str, Candidate]) -> list[list[TwinRun]]:
    """The ``twin_phases_worker`` argument: per phase, each twin's run by its candidate."""
    phases: list[list[TwinRun]] = [[] for _ in range(1 + max(p[3] for p in plans.values()))]
    for name, (_, _, plan, phase, _) in plans.items():
        phases[phase].append(TwinRun(plan.case, plan.overlap, plan.training, candidates[name]))
    return phases


def finish(plans: dict, ranks: list, candidates: dict[str, Candidate]) -> dict:
    """name -> (report, plan, passed, results of the twin's ranks): each compared with refgrad.
    ``passed`` is the twin's own verdict (it matched refgrad); the launch's may still FAIL on
    a Megatron-Core finding its flags reach (``report["findings"]``)."""
    out = {}
    for name, (config, report, plan, phase, index) in plans.items():
        results = [r[phase][index] for r in ranks]
        finish_twin_report(config, plan, results, report, where="test world",
                           candidate=candidates[name])
        out[name] = (report, plan, report["twin"]["passed"], [r for r in results if r is not None])
    return out


def train_and_compare(plans: dict, world_size: int,
                      candidate: Candidate | dict[str, Candidate] | None = None,
                      worker: Callable[..., list] = twin_phases_worker, *worker_args: Any) -> dict:
    """Train every twin of ``plans`` by ``candidate`` (one for all, or one per name; fastgrad's
    by default; a deliberately broken one goes through the same seam) in one spawned world of
    ``world_size`` gloo ranks (``worker(rank, world_size, phases, *worker_args)``), then
    compare each with refgrad (:func:`finish`)."""
    if not isinstance(candidate, dict):
        candidate = {name: candidate or FastgradCandidate() for name in plans}
    ranks = run_distributed(worker, world_size, phases_of(plans, candidate), *worker_args,
                            timeout_s=300)
    return finish(plans, ranks, candidate)

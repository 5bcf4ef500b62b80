"""Stage 3 of ``verify preflight``: plan, run and compare the twin for each candidate; decide the hazards.

Each candidate (``--candidate``, fastgrad by default) gets its own plan
(:func:`prepare_twin`: the case scaled down to what it can build here, what it cannot listed
with the reason) and its own run. Without torchrun the twin spawns ``TP x PP x DP`` gloo
ranks on the CPU (TP capped at 2; ``verify.distributed.spawn``); under torchrun (``RANK`` and
``WORLD_SIZE`` set) it runs in this process on the real world (ranks beyond the twin's
stand by) and rank 0 compares and reports. A candidate whose ranks fail does not take the
others' results with it: its section says why.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from gradvocab import RankResult
from verify.candidates.interfaces import (
    OPTIMIZER_BEHAVIOURS,
    Behaviour,
    Candidate,
    DocumentedBehaviour,
    Unsupported,
)
from verify.candidates.registry import default_candidate
from verify.distributed import DistributedRunError, RankCrashed, RankLauncher, spawn
from verify.preflight.config import PreflightConfig
from verify.preflight.twin.figures import apply_figures, figure_check
from verify.preflight.twin.plan import TwinOptions, TwinPlan, plan_twin
from verify.preflight.twin.rank import TwinRun, run_twin_rank, twin_worker
from verify.preflight.twin.variants import adamw_of
from verify.preflight.twin.verdict import (
    crash_section,
    not_run_section,
    twin_section,
    write_sections,
)


class TwinRunError(RuntimeError):
    """The twin could not run (a rank failed or timed out): exit code 3."""


@dataclass(frozen=True)
class PreparedTwin:
    """One candidate's twin, planned for what it can build here, and how its optimizer
    departs from refgrad's spec by design."""

    candidate: Candidate
    plan: TwinPlan
    behaviour: dict[Behaviour, DocumentedBehaviour] = field(default_factory=dict)

    def run(self) -> TwinRun:
        return TwinRun(self.plan.case, self.plan.overlap, self.plan.training, self.candidate)


@dataclass(frozen=True)
class UnsupportedTwin:
    """A candidate that cannot train the twin here at all, and why."""

    candidate: Candidate
    reason: str


def prepare_twin(config: PreflightConfig, options: TwinOptions, candidate: Candidate
                 ) -> PreparedTwin | UnsupportedTwin:
    """Ask ``candidate`` what it can build here and plan its twin (TwinSizeError when the
    twin needs too many ranks)."""
    try:
        with candidate.pipeline() as training:
            support = training.model_support()
        plan = plan_twin(config, options, support, candidate.label)
        behaviour = {}
        if adamw_of(plan.training) is not None:
            with candidate.optimizer():  # Unsupported where it has none
                behaviour = candidate.departures(OPTIMIZER_BEHAVIOURS)
    except Unsupported as exc:
        return UnsupportedTwin(candidate, str(exc))
    return PreparedTwin(candidate, plan, behaviour)


def under_torchrun(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("RANK")) and bool(environ.get("WORLD_SIZE"))


def _run_in_torchrun(plan: TwinPlan, run: TwinRun) -> tuple[list[RankResult | None] | None, str]:
    """Run on the torchrun world; rank 0 gets every rank's result, others None."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world < plan.world_size:
        raise TwinRunError(f"the twin needs {plan.world_size} ranks (TP x PP x DP), torchrun gave {world}")
    mine = run_twin_rank(run)
    rank = dist.get_rank()
    gathered: list[RankResult | None] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    backend = dist.get_backend()
    if created:
        # Leave together: a rank that exits while its peer still reads from it makes
        # gloo abort the peer (SIGABRT) at interpreter exit.
        dist.barrier()
        dist.destroy_process_group()
    return (gathered if rank == 0 else None), f"torchrun, {world} ranks, {backend}"


class _PlainStatus:
    """One line per twin stage on stderr, where it is not a terminal (CI logs, pipes)."""

    def __enter__(self) -> _PlainStatus:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, text: str) -> None:
        print(f"[verify preflight] {text}", file=sys.stderr, flush=True)


def _progress(enabled: bool | None):
    """A spinner on a terminal, plain lines elsewhere; nothing with ``enabled=False``."""
    if enabled is False:
        return nullcontext(None)
    if not sys.stderr.isatty():
        return _PlainStatus()
    from rich.console import Console

    return Console(stderr=True).status("twin: starting", spinner="dots")


def run_twin_stage(config: PreflightConfig, options: TwinOptions, report: dict, *,
                   environ: Mapping[str, str],
                   candidates: Sequence[Candidate] | None = None,
                   progress: bool | None = None) -> bool | None:
    """Fill ``report["twins"]`` (``report["twin"]``: the first candidate's) and
    ``report["hazards"]``; the verdict (None: not rank 0). A single candidate whose ranks
    fail raises TwinRunError; with several, that candidate's section holds the error."""
    if candidates is None:
        candidates = (default_candidate(),)
    if not candidates:
        raise ValueError("run_twin_stage needs at least one candidate")
    # TwinSizeError -> exit 2, raised before anything runs
    prepared = [prepare_twin(config, options, c) for c in candidates]
    sections: list[dict] = []
    rank_zero = True
    reports = not under_torchrun(environ) or environ.get("RANK") == "0"
    with (_progress(progress) as status,
          figure_check(config, timeout_s=options.timeout_s, start=reports) as figures):
        def say(text: str) -> None:
            if status is not None:
                status.update(f"twin: {text}")

        for twin in prepared:
            if isinstance(twin, UnsupportedTwin):
                sections.append(not_run_section(twin.candidate, twin.reason, error=False))
                continue
            try:
                ranks, where, plan = _train(twin, environ, options, say)
            except RankCrashed as crash:
                if crash.first.raised_in(twin.candidate.own_modules):
                    # The candidate's own code raised: a crash of the launch, not the harness's.
                    sections.append(crash_section(config, twin.plan, twin.candidate, crash))
                    continue
                if len(prepared) == 1:
                    raise TwinRunError(f"the twin's ranks failed: {crash}") from None
                sections.append(not_run_section(twin.candidate, f"the twin's ranks failed: "
                                                f"{crash.summary()}", error=True))
                continue
            except (DistributedRunError, TwinRunError) as exc:
                reason = (f"the twin's ranks failed: {exc}" if isinstance(exc, DistributedRunError)
                          else str(exc))
                if len(prepared) == 1:
                    raise TwinRunError(reason) from None
                sections.append(not_run_section(twin.candidate, reason, error=True))
                continue
            if ranks is None:  # a torchrun rank other than 0: rank 0 reports
                rank_zero = False
                continue
            say(f"{twin.candidate.label}: refgrad's single-process model, comparing every step")
            section = twin_section(config, plan, ranks, where=where, candidate=twin.candidate,
                                   behaviour=twin.behaviour)
            apply_figures(section, figures.result())  # preflight's figures vs Megatron-Core's
            sections.append(section)
    if not rank_zero:
        return None
    passed = write_sections(config, report, sections)
    if any("error" in s for s in sections):
        report["twin_error"] = "; ".join(f"{s['candidate']}: {s['error']}" for s in sections
                                         if "error" in s)
    return passed


def _train(twin: PreparedTwin, environ: Mapping[str, str], options: TwinOptions,
           say: Callable[[str], None]) -> tuple[list[RankResult | None] | None, str, TwinPlan]:
    """Train ``twin`` on its ranks: (every rank's results or None off rank 0, where, the plan
    as it ran)."""
    plan, label = twin.plan, twin.candidate.label
    if under_torchrun(environ):
        if torch.cuda.is_available():
            plan = replace(plan, not_twinned=plan.not_twinned + (
                "NCCL: the twin's tensors live on the CPU, so on the torchrun world it "
                "runs gloo (same ranks, same groups)",))
        say(f"{label}: training {len(plan.case.plans)} steps on the torchrun world")
        return (*_run_in_torchrun(plan, twin.run()), plan)
    # The line a user would interrupt at comes once the ranks have started: the fork server
    # ignores Ctrl-C while it starts (verify.distributed.launcher).
    ranks = spawn(twin_worker, plan.world_size, twin.run(), timeout_s=options.timeout_s,
                  launcher=RankLauncher().preloading("verify.preflight.twin",
                                                     *twin.candidate.preload_modules),
                  on_started=lambda: say(f"{label}: training {len(plan.case.plans)} steps on "
                                         f"{plan.world_size} gloo ranks"))
    return ranks, f"spawned, {plan.world_size} gloo ranks on the CPU", plan

"""Stage 3 of ``verify preflight``: plan, run and compare the twin; decide the hazards.

Without torchrun the twin spawns ``TP x PP x DP`` gloo ranks on the CPU (TP
capped at 2; ``verify.distributed.spawn``); under torchrun (``RANK`` and
``WORLD_SIZE`` set) it runs in this process on the real world (ranks beyond
the twin's stand by) and rank 0 compares and reports.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import asdict, replace
from typing import Any

from verify.preflight.config import PreflightConfig
from verify.preflight.hazards import FINDING, decide_hazards
from verify.preflight.twin import TwinOptions, TwinPlan, plan_twin
from verify.preflight.twin_compare import compare_steps, reference_for
from verify.preflight.twin_worker import (
    TwinCandidate,
    run_twin_rank,
    twin_worker,
)

OPTIM_NOTE = (", and fastgrad.optim.DistributedOptimizer's AdamW master weights and state "
              "(vs refgrad.optim, exact arithmetic),")

MXFP8_NOTE = (" and the MXFP8 params' scale and element bits (vs refgrad.mxfp8 of the masters "
              "staged as bf16),")


class TwinRunError(RuntimeError):
    """The twin could not run (a rank failed or timed out): exit code 3."""


def under_torchrun(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("RANK")) and bool(environ.get("WORLD_SIZE"))


def _run_in_torchrun(plan: TwinPlan, candidate: TwinCandidate) -> tuple[list[Any] | None, str]:
    """Run on the torchrun world; rank 0 gets every rank's result, others None."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world < plan.world_size:
        raise TwinRunError(f"the twin needs {plan.world_size} ranks (TP x PP x DP), torchrun gave {world}")
    mine = run_twin_rank(plan.case, plan.overlap, plan.rank_optimizer, candidate)
    rank = dist.get_rank()
    gathered: list[Any] = [None] * world if rank == 0 else None
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
                   environ: Mapping[str, str], candidate: TwinCandidate | None = None,
                   progress: bool | None = None) -> bool | None:
    """Fill ``report["twin"]`` and ``report["hazards"]``; the verdict (None: not rank 0)."""
    from verify.distributed import DistributedRunError, spawn

    candidate = candidate or TwinCandidate()
    plan = plan_twin(config, options)  # TwinSizeError -> exit 2, raised before anything runs
    with _progress(progress) as status:
        def say(text: str) -> None:
            if status is not None:
                status.update(f"twin: {text}")

        try:
            if under_torchrun(environ):
                import torch

                if torch.cuda.is_available():
                    plan = replace(plan, not_twinned=plan.not_twinned + (
                        "NCCL: the twin's tensors live on the CPU, so on the torchrun world it "
                        "runs gloo (same ranks, same groups)",))
                say(f"training {len(plan.case.plans)} steps on the torchrun world")
                ranks, where = _run_in_torchrun(plan, candidate)
                if ranks is None:
                    return None
            else:
                # The line a user would interrupt at comes once the ranks have started:
                # the fork server ignores Ctrl-C while it starts (verify.distributed.launcher).
                ranks = spawn(twin_worker, plan.world_size, plan.case, plan.overlap, candidate, plan.rank_optimizer,
                              timeout_s=options.timeout_s,
                              on_started=lambda: say(f"training {len(plan.case.plans)} steps on "
                                                     f"{plan.world_size} gloo ranks"))
                where = f"spawned, {plan.world_size} gloo ranks on the CPU"
        except DistributedRunError as exc:
            raise TwinRunError(f"the twin's ranks failed: {exc}") from None
        say("refgrad's single-process model, comparing every step")
        return finish_twin_report(config, plan, ranks, report, where=where, candidate=candidate)


def finish_twin_report(config: PreflightConfig, plan: TwinPlan, ranks: list[Any], report: dict,
                       *, where: str, candidate: TwinCandidate) -> bool:
    """Compare the ranks' results with refgrad, decide the hazards, write the verdict."""
    rows = compare_steps(plan, ranks, reference_for(plan))
    for row in rows:  # a comparison of nothing is no pass (ranks that reported nothing)
        empty = [kind for kind, total in (("reduced gradient", row.grads_total),
                                          ("updated parameter", row.params_total),
                                          ("MXFP8 param bits", row.mxfp8_total if plan.mxfp8 else 1))
                 if total == 0]
        if empty:
            row.failures.append(f"step {row.step}: no {' and no '.join(empty)} was compared: the "
                                "ranks reported none")
    failures = [f for row in rows for f in row.failures]
    passed = not failures
    hazards = decide_hazards(
        config, padding_elements=_padding_per_rank(report), twin_ran=True, twin_passed=passed, twin_has_head=plan.case.spec.output_head)
    report["twin"] = {
        "run": True,
        "passed": passed,
        "candidate": candidate.name,
        "optimizer": plan.optimizer,
        "where": where,
        "bitwise": plan.bitwise,
        "order_note": plan.order_note,
        "mapping": [list(m) for m in plan.mapping],
        "not_twinned": list(plan.not_twinned),
        "steps": [asdict(row) for row in rows],
        "failures": failures,
        "note": (f"Scaled twin ({where}): losses, every reduced gradient and every updated "
                 f"parameter{OPTIM_NOTE if plan.optimizer == 'adamw' else ''}"
                 f"{MXFP8_NOTE if plan.mxfp8 is not None else ''} compared with "
                 f"refgrad after each step, "
                 f"{'bitwise' if plan.bitwise else 'within the stated bound'}."),
    }
    report["hazards"] = [h.to_dict() for h in hazards]
    findings = sum(h.status == FINDING for h in hazards)
    shape = f"{config.shape}, {config.num_microbatches} microbatches"
    left_out = len(plan.not_twinned)
    gaps = f"; {left_out} part{'s' if left_out != 1 else ''} not twinned (listed)"
    if rows and all(row.stepped is False for row in rows):
        # Both sides skipping every step agree trivially on the update: say so up front.
        gaps += ("; every step was skipped on NaN/inf grads, so no update was checked (a "
                 "smaller --initial-loss-scale or more --twin-steps reach a clean step)")
    if passed:
        ranks = f"{plan.world_size} rank{'s' if plan.world_size != 1 else ''}"
        report["verdict"] = (f"PASS: {shape}; twin ({ranks}, "
                             f"{len(rows)} steps) matches refgrad "
                             f"{'bitwise' if plan.bitwise else 'within the stated bound'}"
                             f"{gaps}; {findings} hazard finding{'s' if findings != 1 else ''}")
    else:
        report["verdict"] = f"FAIL: {shape}; twin differs from refgrad: {failures[0]}"
    report["passed"] = passed
    return passed


def _padding_per_rank(report: dict) -> int:
    """Largest padding a rank holds (all its chunks), from the paper layout."""
    per_stage: dict[int, int] = {}
    for row in report.get("layout", []):
        per_stage[row["stage"]] = per_stage.get(row["stage"], 0) + row["padding_elements"]
    return max(per_stage.values(), default=0)


def paper_only_hazards(config: PreflightConfig, report: dict) -> None:
    """Hazards decided from the configuration alone (the twin did not run)."""
    hazards = decide_hazards(config, padding_elements=_padding_per_rank(report))
    report["hazards"] = [h.to_dict() for h in hazards]

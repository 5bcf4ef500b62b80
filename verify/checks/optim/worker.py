"""The multi-rank part of the ``optim`` check: the case matrix on gloo ranks, through the candidate.

Every rank asks the candidate for its optimizer (``with candidate.optimizer() as optimizer``),
wraps each case's model in the candidate's DDP (:meth:`DistributedOptimizerStep.data_parallel`)
and builds the optimizer over it. Where a candidate's optimizer can share a world
(``shares_a_world``: fastgrad), one spawn of 4 ranks runs every case on its sub-group (DP=1 on
one rank, DP=2 on two pairs, DP=3, DP=4 = the world); otherwise (Megatron-Core builds its
optimizer with collectives over the whole default group) each DP size runs in a world of its
own, its cases on ranks ``0..DP-1`` (:func:`world_plans`). Either way the results come back
laid out by the 4-rank plan, so the comparisons are the same. Phase 2 resumes the DP=2
checkpoint (taken after step 2) at DP=2 on other ranks (uninterrupted training must be
reproduced bitwise) and at DP=3 (resharding); then, where the candidate has them, the MXFP8
runs on ranks 0-1.

Per step a rank records what the check compares: the step's outcome, global norm and loss
scale, the loss scaler's state after it, whether a leaf's forward read params whose all-gather
was still in flight (``Leaf.probe``), and any error the optimizer raised (recorded, and the
run goes on: a stale published shard must show in the numbers, not only as a crash). With
``overlap_param_gather`` the ranks also exchange their step outcomes over a bookkeeping group
of their own: when they disagree (a skip decided per rank), the ranks that skipped pair the
others' in-flight param all-gathers with ``publish_params()``, so the run ends with numbers
(and a FAIL) instead of ranks blocked in unmatched collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verify.candidates import Candidate, Unsupported
from verify.candidates.interfaces import DistributedOptimizerStep, OptimizerCheckpoint
from verify.checks.optim.cases import CHECKPOINT_CASE, OptimCase, coefficients
from verify.checks.optim.mxfp8 import train_mxfp8
from verify.checks.optim.records import (
    CaseResult,
    CaseRun,
    RankRuns,
    Refused,
    Snapshot,
    StepRecord,
)

WORLD = 4
RESUME_AFTER = 2  # the checkpoint is taken after this many steps of CHECKPOINT_CASE
DP2_RESUMED_ON = (2, 3)  # the ranks (of the 4-rank plan) that resume at DP=2
DP3_RESUMED_ON = (0, 1, 2)  # ... and at DP=3
EXTRAS_ON = (0, 1)  # the MXFP8 runs


@dataclass(frozen=True)
class WorldPlan:
    """What one spawn runs: ``cases`` as ``(index in the matrix, the case on this world's
    ranks)``, the resumes (on these ranks; empty: not here), and whether the MXFP8 runs run
    here (on ranks 0-1)."""

    world: int
    cases: tuple[tuple[int, OptimCase], ...]
    dp2_resume_ranks: tuple[int, ...] = ()
    dp3_resume_ranks: tuple[int, ...] = ()
    extras: bool = False


def world_plans(cases: list[OptimCase], shares_a_world: bool, *, extras: bool = True
                ) -> list[WorldPlan]:
    """One 4-rank plan (every case on its sub-group), or, for a candidate whose optimizer
    cannot share a world, one world per case (its ranks ``0..DP-1``) and one per resume and
    for the extras, so that no configuration runs where an earlier one ran. The checkpoint
    case comes first: the resumes load its checkpoint."""
    if shares_a_world:
        return [WorldPlan(WORLD, tuple(enumerate(cases)), DP2_RESUMED_ON, DP3_RESUMED_ON, extras)]
    order = sorted(range(len(cases)), key=lambda i: cases[i] != CHECKPOINT_CASE)
    plans = [WorldPlan(cases[i].dp, ((i, dataclasses.replace(cases[i], ranks=tuple(range(cases[i].dp)))),))
             for i in order]
    plans += [WorldPlan(2, (), dp2_resume_ranks=(0, 1)), WorldPlan(3, (), dp3_resume_ranks=(0, 1, 2))]
    if extras:
        plans.append(WorldPlan(2, (), extras=True))
    return plans


def _groups(world: int, plan: WorldPlan) -> tuple[dict, dict]:
    """The group of every rank set the plan uses, and a bookkeeping group per multi-rank set
    (created in the same order on all ranks)."""
    sets = sorted({c.ranks for _, c in plan.cases} | {r for r in (plan.dp2_resume_ranks,
                                                                   plan.dp3_resume_ranks,
                                                                   EXTRAS_ON if plan.extras else ())
                                                      if r}, key=lambda r: (len(r), r))
    whole = tuple(range(world))
    groups = {ranks: dist.group.WORLD if ranks == whole else dist.new_group(list(ranks))
              for ranks in sets}
    books = {ranks: dist.new_group(list(ranks)) for ranks in sets if len(ranks) > 1}
    return groups, books


def _leaf_probe(opt, seen: list[bool]):
    """``Leaf.probe``: record whether a bucket holding one of the leaf's params is still being
    all-gathered when the leaf's forward starts (its pre-hook should have waited)."""
    def probe(leaf) -> None:
        seen.append(opt.gather_in_flight(leaf.parameters()))
    return probe


def _agree(opt, result, bookkeeping, dp: int) -> bool:
    """Exchange the step outcome; on disagreement the skipping ranks pair the others' gathers."""
    flags: list = [None] * dp
    dist.all_gather_object(flags, bool(result.stepped), group=bookkeeping)
    if len(set(flags)) == 1:
        return True
    if not result.stepped:
        opt.publish_params()
    return False


def snapshot(model, opt) -> Snapshot:
    """Full params (after the gather) and the optimizer's full state by name."""
    opt.finish_param_sync()
    return Snapshot(params={n: p.detach().clone() for n, p in model.named_parameters()},
                    state=opt.named_state())


def _train(case: OptimCase, group, local_rank: int, optimizer: DistributedOptimizerStep, seed: int,
           *, bookkeeping=None, start: int = 0, load: OptimizerCheckpoint | None = None,
           keep_checkpoint_after: int | None = None) -> CaseResult:
    """Train ``case`` as a training loop does: step k's forward reads the params step k-1
    published (their all-gathers in flight with ``overlap_param_gather``), and the snapshot of
    step k-1 is taken once that forward has run; a forward after the last step checks its
    gathers too."""
    model = case.model(seed)
    try:
        ddp = optimizer.data_parallel(model, case.ddp_config(), group, averaging=case.averaging)
        opt = optimizer.build(ddp, case.optimizer_settings())
    except Unsupported as unsupported:  # the same on every rank of the case: a SKIP
        return Refused(unsupported.reason)
    loaded = None
    if load is not None:
        opt.load_checkpoint(load)
        loaded = snapshot(model, opt)
    snaps: dict[int, Snapshot] = {}
    checkpoint: OptimizerCheckpoint | Refused | None = None

    def take(step: int) -> None:
        nonlocal checkpoint
        snaps[step] = snapshot(model, opt)
        if keep_checkpoint_after is not None and step + 1 == keep_checkpoint_after:
            try:
                checkpoint = opt.checkpoint()
            except Unsupported as unsupported:  # the resumes become a SKIP
                checkpoint = Refused(unsupported.reason)

    seen: list[bool] = []
    steps: list[StepRecord] = []
    model.set_probe(_leaf_probe(opt, seen))
    # What the optimizer raises is not caught: it ends the world (its peers waiting in a
    # collective are stopped at once) and is reported as the case's crash.
    for step in range(start, case.steps):
        seen.clear()
        scale = opt.loss_scale if opt.loss_scale is not None else 1.0
        ddp.zero_grad_buffer()
        model(coefficients(local_rank, step, case.inf_at, seed, scale)).backward()
        read_in_flight = any(seen)  # the forward pre-hooks waited, or not
        ddp.finish_grad_sync()
        if step > start:
            take(step - 1)  # the forward has waited for the previous step's gathers
        result = opt.step()
        launched = opt.param_gather_in_flight
        agreed = True if bookkeeping is None else _agree(opt, result, bookkeeping, case.dp)
        scaler = opt.loss_scaler_state()
        steps.append(StepRecord(outcome=result, agreed=agreed,
                                scaler=None if scaler is None else scaler.as_dict(),
                                read_in_flight=read_in_flight, launched=launched))
    seen.clear()
    # the next iteration's start: its forward awaits the last step's gathers too
    ddp.zero_grad_buffer()
    with torch.no_grad():
        model(coefficients(local_rank, 0, None, seed, 0.0))
    final_read_in_flight = any(seen)
    take(case.steps - 1)
    model.set_probe(None)
    opt.close()
    return CaseRun(steps=tuple(steps), snapshots=tuple(snaps.get(step) for step in range(start, case.steps)),
                   final_read_in_flight=final_read_in_flight, loaded=loaded, checkpoint=checkpoint)


def rank_worker(rank: int, world: int, plan: WorldPlan, candidate: Candidate, seed: int,
                mxfp8_runs: list[tuple[str, bool, bool]],
                checkpoint: OptimizerCheckpoint | None) -> RankRuns:
    """One rank of ``plan``: phase 1 (its cases), phase 2 (the resumes: the checkpoint is the
    one this world's checkpoint case took, or ``checkpoint`` given from another world), then,
    where ``plan.extras``, the MXFP8 runs ``(algorithm, sharing, grad_fp32)`` at DP=2 on
    ranks 0-1."""
    groups, books = _groups(world, plan)

    def book(case: OptimCase):
        return books.get(case.ranks) if case.overlap and case.dp > 1 else None

    cases: dict[int, CaseResult] = {}
    resumed: dict[str, CaseResult] = {}
    mxfp8 = None
    with candidate.optimizer() as optimizer:
        for index, case in plan.cases:
            if rank in case.ranks:
                keep = RESUME_AFTER if case.label == CHECKPOINT_CASE.label else None
                with _naming(case.label):
                    cases[index] = _train(case, groups[case.ranks], case.ranks.index(rank),
                                          optimizer, seed, bookkeeping=book(case),
                                          keep_checkpoint_after=keep)
        resuming = bool(plan.dp2_resume_ranks or plan.dp3_resume_ranks)
        if resuming:
            holders = [(i, c.ranks[0]) for i, c in plan.cases if c.label == CHECKPOINT_CASE.label]
            if checkpoint is None and holders:  # this world's checkpoint case took it
                index, holder = holders[0]
                box = [taken_checkpoint(cases[index]) if rank == holder else None]
                dist.broadcast_object_list(box, src=holder)
                checkpoint = box[0]
        for key, ranks in (("dp3_resumed", plan.dp3_resume_ranks), ("dp2_resumed", plan.dp2_resume_ranks)):
            resumed_case = dataclasses.replace(CHECKPOINT_CASE, ranks=ranks) if ranks else None
            if resumed_case is not None and rank in ranks and checkpoint is not None:
                with _naming(resumed_label(ranks)):
                    resumed[key] = _train(resumed_case, groups[ranks], ranks.index(rank), optimizer,
                                          seed, bookkeeping=book(resumed_case), start=RESUME_AFTER,
                                          load=checkpoint)
        if plan.extras and rank in EXTRAS_ON:
            pair = groups[EXTRAS_ON]
            if mxfp8_runs:
                mxfp8_optimizer = optimizer.mxfp8()
                with _naming(MXFP8_LABEL):
                    mxfp8 = [train_mxfp8(mxfp8_optimizer, rank, kind, sharing, grad_fp32,
                                         dp_group=pair, seed=seed)
                             for kind, sharing, grad_fp32 in mxfp8_runs]
    return RankRuns(cases=cases, checkpoint=checkpoint if resuming else None,
                    dp2_resumed=resumed.get("dp2_resumed"), dp3_resumed=resumed.get("dp3_resumed"),
                    mxfp8=mxfp8)


def taken_checkpoint(result: CaseResult | None) -> OptimizerCheckpoint | None:
    """The checkpoint a case's run took (None: it took none, was refused one, or did not run)."""
    if isinstance(result, CaseRun) and isinstance(result.checkpoint, OptimizerCheckpoint):
        return result.checkpoint
    return None


def world_checkpoint(plan: WorldPlan, per_rank: list[RankRuns]) -> OptimizerCheckpoint | None:
    """The checkpoint a world passes on to later worlds' resumes: the one its resumes loaded,
    else the one its checkpoint case took (a world of its own for a candidate that cannot
    share one: it runs no resume, so it loaded none)."""
    if per_rank and per_rank[0].checkpoint is not None:
        return per_rank[0].checkpoint
    for index, case in plan.cases:
        if case.label == CHECKPOINT_CASE.label:
            return taken_checkpoint(per_rank[case.ranks[0]].cases.get(index))
    return None


MXFP8_LABEL = "optim MXFP8 DP=2"


def resumed_label(ranks: tuple[int, ...]) -> str:
    """How the report names a resume of the checkpoint case's checkpoint at DP=len(ranks)."""
    return f"{CHECKPOINT_CASE.label} resumed at DP={len(ranks)}"


@contextmanager
def _naming(label: str) -> Iterator[None]:
    """What the block raises carries ``in <label>`` (a note): the report names the case a
    crash of a shared world happened in."""
    try:
        yield
    except BaseException as exc:
        exc.add_note(f"in {label}")
        raise


def as_four_ranks(cases: list[OptimCase], plans: list[WorldPlan],
                  results: list[list[RankRuns] | None]) -> list[RankRuns]:
    """The per-rank results of every plan laid out as the 4-rank plan lays them out (the
    matrix ``cases`` say which ranks each case has there); a plan without results (its world
    crashed, or it did not run) adds nothing."""
    if len(plans) == 1 and plans[0].world == WORLD and results[0] is not None:
        return results[0]
    per_rank: list[dict] = [{"cases": {}} for _ in range(WORLD)]  # RankRuns' fields, filled in
    for plan, ranks in zip(plans, results):
        if ranks is None:
            continue
        for index, case in plan.cases:
            for local, result in enumerate(ranks[:case.dp]):
                per_rank[cases[index].ranks[local]]["cases"][index] = result.cases[index]
        for key, on in (("dp2_resumed", DP2_RESUMED_ON), ("dp3_resumed", DP3_RESUMED_ON)):
            for local, result in enumerate(ranks):
                if getattr(result, key) is not None:
                    per_rank[on[local]][key] = getattr(result, key)
        if plan.extras:
            for local in EXTRAS_ON:
                if ranks[local].mxfp8 is not None:
                    per_rank[local]["mxfp8"] = ranks[local].mxfp8
    return [RankRuns(**fields) for fields in per_rank]

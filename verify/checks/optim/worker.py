"""The multi-rank part of the ``optim`` check: one spawn of 4 gloo ranks.

Every rank creates the same sub-groups (DP=1 on one rank, DP=2 on two pairs, DP=3,
DP=4 = the world), then runs, in matrix order, the cases whose ranks include it.
Phase 2 resumes the DP=2 checkpoint (broadcast from rank 0) at DP=2 (uninterrupted
training must be reproduced bitwise) and at DP=3 (resharding), and provokes the
"param modified while its all-gather is in flight" error.

Per step a rank records what the check compares: the step's outcome, global norm
and loss scale, the loss scaler's state after it, whether a leaf's forward read
params whose all-gather was still in flight (``Leaf.probe``), and any error the
optimizer raised (recorded, and the run goes on: a stale published shard must show
in the numbers, not only as a crash). With ``overlap_param_gather`` the ranks also
exchange their step outcomes over a bookkeeping group of their own: when they
disagree (a skip decided per rank), the ranks that skipped pair the others'
in-flight param all-gathers with ``publish_params()``, so the run ends with
numbers (and a FAIL) instead of ranks blocked in unmatched collectives.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from verify.checks.optim.cases import (
    CHECKPOINT_CASE,
    FP32,
    OptimCase,
    build,
    coefficients,
    snapshot,
    train_step,
)
from verify.checks.optim.mxfp8 import train_mxfp8

WORLD = 4
RESUME_AFTER = 2  # the checkpoint is taken after this many steps of CHECKPOINT_CASE


def _groups(world: int) -> tuple[dict[tuple[int, ...], object], dict[tuple[int, ...], object]]:
    """The sub-groups of every rank set the matrix uses, and a bookkeeping group per
    multi-rank set (created in the same order on all ranks)."""
    multi = [(0, 1), (2, 3), (0, 1, 2)]
    groups = {ranks: dist.new_group(list(ranks)) for ranks in [(r,) for r in range(world)] + multi}
    groups[tuple(range(world))] = dist.group.WORLD
    books = {ranks: dist.new_group(list(ranks)) for ranks in [*multi, tuple(range(world))]}
    return groups, books


def _leaf_probe(opt, seen: list[bool]):
    """``Leaf.probe``: record whether a bucket holding one of the leaf's params is still being
    all-gathered when the leaf's forward starts (its pre-hook should have waited)."""
    def probe(leaf) -> None:
        mine = {id(p) for p in leaf.parameters()}
        seen.append(any(s.gather_handle is not None for s in opt.shards
                        if any(id(p) in mine for p in s.bucket.params)))
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


def _drain(opt) -> None:
    """Wait for every param all-gather still in flight, whatever the optimizer raises."""
    for _ in range(len(opt.shards) + 1):
        try:
            opt.finish_param_sync()
            return
        except Exception:  # noqa: BLE001 - the first error is already recorded
            continue


def _train(case: OptimCase, group, local_rank: int, optimizer_cls, seed: int, *, bookkeeping=None,
           start: int = 0, load: dict | None = None, keep_checkpoint_after: int | None = None) -> dict:
    """Train ``case`` as a training loop does: step k's forward reads the params step k-1
    published (their all-gathers in flight with ``overlap_param_gather``), and the snapshot of
    step k-1 is taken once that forward has run; a forward after the last step checks its
    gathers too. ``snapshots[k]`` is None where an error left no state to compare."""
    model, ddp, opt = case.build(group, optimizer_cls, seed)
    out: dict = {"results": [], "errors": []}
    if load is not None:
        opt.load_state_dict(load)
        out["loaded"] = snapshot(model, opt)
    snaps: dict[int, dict] = {}

    def take(step: int) -> None:
        snaps[step] = snapshot(model, opt)
        if keep_checkpoint_after is not None and step + 1 == keep_checkpoint_after:
            out["checkpoint"] = snaps[step]["state"]

    seen: list[bool] = []
    model.set_probe(_leaf_probe(opt, seen))
    for step in range(start, case.steps):
        record: dict = {"stepped": None, "reason": None, "loss_scale": None, "grad_norm": None,
                        "agreed": True, "scaler": None, "read_in_flight": None, "launched": None}
        out["results"].append(record)
        seen.clear()
        stepping = False
        try:
            scale = opt.loss_scaler.scale if opt.loss_scaler is not None else 1.0
            ddp.zero_grad_buffer()
            model(coefficients(local_rank, step, case.inf_at, seed, scale)).backward()
            record["read_in_flight"] = any(seen)  # the forward pre-hooks waited, or not
            ddp.finish_grad_sync()
            if step > start:
                take(step - 1)  # the forward has waited for the previous step's gathers
            stepping = True
            result = opt.step()
            record.update(stepped=result.stepped, reason=result.reason, loss_scale=result.loss_scale,
                          grad_norm=result.grad_norm, launched=opt.param_gather_in_flight)
            if bookkeeping is not None:
                record["agreed"] = _agree(opt, result, bookkeeping, case.dp)
            if opt.loss_scaler is not None:
                record["scaler"] = dict(opt.loss_scaler.state_dict())
        except Exception as exc:  # noqa: BLE001 - recorded; the numbers must still be compared
            out["errors"].append((step, f"{type(exc).__name__}: {exc}"[:300]))
            _drain(opt)
            try:
                take(step if stepping or step == start else step - 1)
            except Exception as again:  # noqa: BLE001 - no numbers from here on
                out["errors"].append((step, f"{type(again).__name__}: {again}"[:300]))
            break
    else:
        seen.clear()
        try:
            with torch.no_grad():  # a forward after the last step: its gathers awaited too
                model(coefficients(local_rank, 0, None, seed, 0.0))
            out["final_read_in_flight"] = any(seen)
            take(case.steps - 1)
        except Exception as exc:  # noqa: BLE001 - recorded
            out["errors"].append((case.steps - 1, f"{type(exc).__name__}: {exc}"[:300]))
            _drain(opt)
            take(case.steps - 1)
    model.set_probe(None)
    out["snapshots"] = [snaps.get(step) for step in range(start, case.steps)]
    return out


def _modified_during_gather(group, local_rank: int, optimizer_cls, seed: int) -> str:
    """Write a param while its bucket's all-gather is in flight; the forward's wait must refuse."""
    model, ddp, opt = build(FP32, "adamw", overlap_param_gather=True, dp_group=group, seed=seed,
                            optimizer_cls=optimizer_cls)
    train_step(model, ddp, opt, local_rank, 0, seed=seed)
    with torch.no_grad():
        model.layer.weight.add_(1.0)
    try:
        model.layer({"layer.weight": torch.zeros(1), "layer.bias": torch.zeros(1)})
    except Exception as exc:  # noqa: BLE001 - the type and message are the result
        outcome = f"{type(exc).__name__}: {exc}"
    else:
        outcome = "no error"
    try:  # leave the group usable: drain whatever is still in flight
        opt.finish_param_sync()
    except Exception:  # noqa: BLE001 - already reported above
        pass
    return outcome


def rank_worker(rank: int, world: int, cases: list[OptimCase], optimizer_cls, seed: int,
                mxfp8_runs: list[tuple[str, bool, bool]]) -> dict:
    """One rank: phase 1 (the matrix), phase 2 (resume at DP=2 and DP=3, the race), then
    the MXFP8 runs ``(algorithm, sharing, grad_fp32)`` at DP=2 on ranks 0-1."""
    groups, books = _groups(world)

    def book(case: OptimCase):
        return books[case.ranks] if case.overlap and case.dp > 1 else None

    out: dict = {"cases": {}}
    for index, case in enumerate(cases):
        if rank in case.ranks:
            keep = RESUME_AFTER if case == CHECKPOINT_CASE else None
            out["cases"][index] = _train(case, groups[case.ranks], case.ranks.index(rank),
                                         optimizer_cls, seed, bookkeeping=book(case),
                                         keep_checkpoint_after=keep)
    checkpoint_index = cases.index(CHECKPOINT_CASE)
    box = [out["cases"][checkpoint_index].get("checkpoint") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    checkpoint = box[0]
    resharded = dataclasses.replace(CHECKPOINT_CASE, ranks=(0, 1, 2))
    if rank in resharded.ranks:
        out["dp3_resumed"] = _train(resharded, groups[resharded.ranks], rank, optimizer_cls, seed,
                                    bookkeeping=book(resharded), start=RESUME_AFTER, load=checkpoint)
    resumed = dataclasses.replace(CHECKPOINT_CASE, ranks=(2, 3))
    if rank in resumed.ranks:
        out["dp2_resumed"] = _train(resumed, groups[resumed.ranks], resumed.ranks.index(rank),
                                    optimizer_cls, seed, bookkeeping=book(resumed),
                                    start=RESUME_AFTER, load=checkpoint)
    if rank in (0, 1):
        out["modified"] = _modified_during_gather(groups[(0, 1)], rank, optimizer_cls, seed)
        out["mxfp8"] = [train_mxfp8(rank, kind, sharing, grad_fp32, dp_group=groups[(0, 1)],
                                    seed=seed, optimizer_cls=optimizer_cls)
                        for kind, sharing, grad_fp32 in mxfp8_runs]
    return out

"""The multi-rank part of the ``optim`` check: one spawn of 4 gloo ranks.

Every rank creates the same sub-groups (DP=1 on one rank, DP=2 on two pairs, DP=3,
DP=4 = the world), then runs, in matrix order, the cases whose ranks include it.
Phase 2 resumes the DP=2 checkpoint (broadcast from rank 0) at DP=2 (uninterrupted
training must be reproduced bitwise) and at DP=3 (resharding), and provokes the
"param modified while its all-gather is in flight" error.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from verify.checks.optim.cases import (
    CHECKPOINT_CASE,
    FP32,
    INF_AT,
    OptimCase,
    build,
    snapshot,
    train_step,
)
from verify.checks.optim.mxfp8 import train_mxfp8

WORLD = 4
RESUME_AFTER = 2  # the checkpoint is taken after this many steps of CHECKPOINT_CASE


def _groups(world: int) -> dict[tuple[int, ...], object]:
    """The sub-groups of every rank set the matrix uses (created in the same order on all ranks)."""
    wanted = [(r,) for r in range(world)] + [(0, 1), (2, 3), (0, 1, 2)]
    groups = {ranks: dist.new_group(list(ranks)) for ranks in wanted}
    groups[tuple(range(world))] = dist.group.WORLD
    return groups


def _train(case: OptimCase, group, local_rank: int, optimizer_cls, seed: int, *,
           start: int = 0, load: dict | None = None, keep_checkpoint_after: int | None = None) -> dict:
    model, ddp, opt = case.build(group, optimizer_cls, seed)
    out: dict = {"snapshots": [], "results": [], "gather_waited_in_hook": []}
    if load is not None:
        opt.load_state_dict(load)
        out["loaded"] = snapshot(model, opt)
    for step in range(start, case.steps):
        scale = opt.loss_scaler.scale if opt.loss_scaler is not None else 1.0
        result = train_step(model, ddp, opt, local_rank, step, loss_scale=scale,
                            inf_at=INF_AT if case.scaled else None, seed=seed)
        out["results"].append((result.stepped, result.reason, result.loss_scale))
        if case.overlap and case.dp > 1:
            launched = opt.param_gather_in_flight
            model.embed({"embed.weight": torch.zeros(1)})  # its pre-hook waits for the gather
            embed = model.embed.weight
            waited = all(s.gather_handle is None for s in opt.shards
                         if any(p is embed for p in s.bucket.params))
            out["gather_waited_in_hook"].append((launched, waited))
        snap = snapshot(model, opt)
        out["snapshots"].append(snap)
        if keep_checkpoint_after is not None and step + 1 == keep_checkpoint_after:
            out["checkpoint"] = snap["state"]
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
    groups = _groups(world)
    out: dict = {"cases": {}}
    for index, case in enumerate(cases):
        if rank in case.ranks:
            keep = RESUME_AFTER if case == CHECKPOINT_CASE else None
            out["cases"][index] = _train(case, groups[case.ranks], case.ranks.index(rank),
                                         optimizer_cls, seed, keep_checkpoint_after=keep)
    checkpoint_index = cases.index(CHECKPOINT_CASE)
    box = [out["cases"][checkpoint_index].get("checkpoint") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    checkpoint = box[0]
    resharded = dataclasses.replace(CHECKPOINT_CASE, ranks=(0, 1, 2))
    if rank in resharded.ranks:
        out["dp3_resumed"] = _train(resharded, groups[resharded.ranks], rank, optimizer_cls, seed,
                                    start=RESUME_AFTER, load=checkpoint)
    resumed = dataclasses.replace(CHECKPOINT_CASE, ranks=(2, 3))
    if rank in resumed.ranks:
        out["dp2_resumed"] = _train(resumed, groups[resumed.ranks], resumed.ranks.index(rank),
                                    optimizer_cls, seed, start=RESUME_AFTER, load=checkpoint)
    if rank in (0, 1):
        out["modified"] = _modified_during_gather(groups[(0, 1)], rank, optimizer_cls, seed)
        out["mxfp8"] = [train_mxfp8(rank, kind, sharing, grad_fp32, dp_group=groups[(0, 1)],
                                    seed=seed, optimizer_cls=optimizer_cls)
                        for kind, sharing, grad_fp32 in mxfp8_runs]
    return out

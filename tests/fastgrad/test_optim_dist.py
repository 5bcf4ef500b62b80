"""fastgrad.optim on real gloo ranks: bitwise equal to refgrad.optim at DP 2 and 3.

One spawn of 3 ranks. DP=2 (ranks 0 and 1, a sub-group): AdamW (bf16+fp32 params, clipping, overlap_param_gather)
and SGD with momentum (fp32, synchronous gather). DP=3 (padding, uneven
ownership, a rank owning only padding in some buckets): the DP=2 checkpoint
loaded and trained on, SGD with overlap, fp16 with the loss scaler and an inf
grad on one rank, and a param modified while its all-gather is in flight (in place, and
through .data, which no version counter sees).
Every rank gets its own grads; refgrad is fed their reduction.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from fastgrad.optim import DynamicLossScaler
from gradvocab import Averaging, LifecycleError, LossScaling
from refgrad import optim as R
from tests.distributed_utils import run_distributed
from tests.fastgrad.test_optim import (
    FP16,
    FP32,
    INF_AT,
    MIXED,
    NAMES,
    TIED,
    assert_matches,
    bits,
    build,
    coefficient,
    reference_trajectory,
    snapshot,
    train_step,
)
from verify.metrics import assert_bitwise_equal


def _train(rank, steps, *, start=0, build_args, build_kwargs, load=None, scaler=False):
    model, ddp, opt = build(*build_args, **build_kwargs)
    out = {"snapshots": [], "results": [], "gather_waited_in_hook": []}
    if load is not None:
        opt.load_state_dict(load)
        out["loaded"] = snapshot(model, opt)
    for step in range(start, start + steps):
        scale = opt.loss_scaler.scale if scaler else 1.0
        r = train_step(model, ddp, opt, rank, step, loss_scale=scale, inf_at=INF_AT if scaler else None)
        out["results"].append((r.stepped, r.reason, r.loss_scale))
        if ddp.config.overlap_param_gather:
            launched = opt.param_gather_in_flight
            model.embed({"embed.weight": torch.zeros(1)})  # the pre-hook waits for its bucket(s)
            embed = model.embed.weight
            waited = all(s.gather_handle is None for s in opt.shards
                         if any(p is embed for p in s.bucket.params))
            out["gather_waited_in_hook"].append(launched and waited)
        out["snapshots"].append(snapshot(model, opt))
    return out


def worker_dp2(rank: int, pair) -> dict:
    return {
        "adamw": _train(rank, 3, build_args=(MIXED, "adamw"),
                        build_kwargs={"clip": 0.5, "overlap_param_gather": True, "dp_group": pair}),
        "sgd": _train(rank, 3, build_args=(FP32, "sgd"), build_kwargs={"dp_group": pair}),
    }


def worker(rank: int, world: int) -> dict:
    """DP=2 on ranks 0-1, then DP=3 on all, resuming from rank 0's DP=2 checkpoint."""
    pair = dist.new_group([0, 1])
    out = {"dp2": worker_dp2(rank, pair) if rank < 2 else None}
    checkpoint = [out["dp2"]["adamw"]["snapshots"][1]["state"] if rank == 0 else None]
    dist.broadcast_object_list(checkpoint, src=0)
    out["dp3"] = worker_dp3(rank, world, checkpoint[0])
    # Three pipeline stages of DP=1: the norm is summed over the model-parallel group, and
    # the tied embedding's copies on stages 1 and 2 (marked shared) are not counted again.
    singles = [dist.new_group([r]) for r in range(world)]
    model, ddp, opt = build(MIXED, "adamw", dp_group=singles[rank],
                            model_parallel_group=dist.group.WORLD)
    if rank > 0:
        model.embed.weight.shared = True
    out["pipeline_norm"] = train_step(model, ddp, opt, rank, 0).grad_norm
    return out


def worker_dp3(rank: int, world: int, checkpoint: dict) -> dict:
    out = {
        "resumed": _train(rank, 1, start=2, build_args=(MIXED, "adamw"),
                          build_kwargs={"clip": 0.5, "averaging": Averaging.SUM}, load=checkpoint),
        "sgd": _train(rank, 3, build_args=(MIXED, "sgd"),
                      build_kwargs={"overlap_param_gather": True, "averaging": Averaging.SUM}),
        "fp16": _train(rank, 3, build_args=(FP16, "adamw"), scaler=True, build_kwargs={
            "averaging": Averaging.SUM, "scaler": DynamicLossScaler(LossScaling(initial_scale=256.0, hysteresis=1))}),
    }
    # A param written while its bucket's all-gather is in flight is refused at the wait.
    model, ddp, opt = build(FP32, "adamw", overlap_param_gather=True, averaging=Averaging.SUM)
    train_step(model, ddp, opt, rank, 0)
    with torch.no_grad():
        model.layer.weight.add_(1.0)
    try:
        model.layer({"layer.weight": torch.zeros(1), "layer.bias": torch.zeros(1)})
        out["modified"] = "not detected"
    except LifecycleError as exc:
        out["modified"] = str(exc)
    # The same through .data, which moves no version counter: the published bits catch it.
    model, ddp, opt = build(FP32, "adamw", overlap_param_gather=True, averaging=Averaging.SUM)
    train_step(model, ddp, opt, rank, 0)
    for shard in opt.shards:
        if shard.gather_handle is not None:
            shard.gather_handle.wait()  # the gather is done: no race with the write below
    piece = next((s.pieces[0] for s in opt.shards if s.pieces), None)
    out["modified_data"] = None  # this rank owns only padding: nothing of its own to write
    if piece is not None:
        piece.param.data.view(-1)[piece.param_offset[0]] += 1.0
        try:
            opt.finish_param_sync()
            out["modified_data"] = "not detected"
        except LifecycleError as exc:
            out["modified_data"] = str(exc)
    return out


@pytest.mark.dist
def test_dp2_then_dp3_bitwise_equal_to_refgrad():
    ranks = run_distributed(worker, 3)
    dp2 = [out["dp2"] for out in ranks[:2]]
    dp3 = [out["dp3"] for out in ranks]
    want, (states, steps) = reference_trajectory([2, 2], MIXED, "adamw", clip=0.5)
    after_checkpoint = (copy.deepcopy(states), steps)
    want += reference_trajectory([2], MIXED, "adamw", clip=0.5, start=(states, steps), first_step_id=2)[0]
    for rank, out in enumerate(dp2):
        for step, snap in enumerate(out["adamw"]["snapshots"]):
            assert_matches(snap, want[step], f"dp2 adamw rank {rank} step {step}")
        assert all(out["adamw"]["gather_waited_in_hook"])
    want_sgd, _ = reference_trajectory([2, 2, 2], FP32, "sgd")
    for rank, out in enumerate(dp2):
        for step, snap in enumerate(out["sgd"]["snapshots"]):
            assert_matches(snap, want_sgd[step], f"dp2 sgd rank {rank} step {step}")

    # Checkpoint after step 2 at DP=2; resume at DP=3 and at DP=1.
    checkpoint = dp2[0]["adamw"]["snapshots"][1]["state"]
    want3, _ = reference_trajectory([3], MIXED, "adamw", clip=0.5, averaging=Averaging.SUM,
                                    start=copy.deepcopy(after_checkpoint), first_step_id=2)
    for rank, out in enumerate(dp3):
        loaded = out["resumed"]["loaded"]["state"]["params"]
        for name in NAMES:
            for key, tensor in checkpoint["params"][name].items():
                assert_bitwise_equal(bits(loaded[name][key]), bits(tensor), msg=f"dp3 load {name} {key}")
        assert_matches(out["resumed"]["snapshots"][0], want3[0], f"dp3 resumed rank {rank}")

    want_sgd3, _ = reference_trajectory([3, 3, 3], MIXED, "sgd", averaging=Averaging.SUM)
    for rank, out in enumerate(dp3):
        for step, snap in enumerate(out["sgd"]["snapshots"]):
            assert_matches(snap, want_sgd3[step], f"dp3 sgd rank {rank} step {step}")
        assert all(out["sgd"]["gather_waited_in_hook"])

    # fp16: the inf on rank 1 at step 1 skips that step on every rank and halves the scale.
    want16, _ = reference_trajectory([3, 3, 3], FP16, "adamw", averaging=Averaging.SUM,
                                     scales=[256.0, 256.0, 128.0], inf_at=INF_AT)
    assert [w["stepped"] for w in want16] == [True, False, True]
    for rank, out in enumerate(dp3):
        results = out["fp16"]["results"]
        assert [r[0] for r in results] == [True, False, True], f"rank {rank}: {results}"
        assert "NaN/inf" in results[1][1]
        assert [r[2] for r in results] == [256.0, 256.0, 128.0]
        for step, snap in enumerate(out["fp16"]["snapshots"]):
            assert_matches(snap, want16[step], f"dp3 fp16 rank {rank} step {step}")
        assert "modified between the launch" in out["modified"], out["modified"]
        if out["modified_data"] is not None:
            assert "modified between the launch" in out["modified_data"], out["modified_data"]
    assert any(out["modified_data"] is not None for out in dp3)

    stage_grads = [
        R.values(coefficient(r, 0, i, n).to(MIXED[n]).float())
        for r in range(3) for i, n in enumerate(NAMES)
        if (r == 0 or n != "embed.weight") and n not in TIED  # the shared copies: not in the norm
    ]
    assert [out["pipeline_norm"] for out in ranks] == [float(R.global_norm(stage_grads))] * 3

    # DP=1 loads the DP=2 checkpoint and continues like refgrad.
    model, ddp, opt = build(MIXED, "adamw", clip=0.5, averaging=Averaging.SUM)
    opt.load_state_dict(checkpoint)
    want1, _ = reference_trajectory([1], MIXED, "adamw", clip=0.5, averaging=Averaging.SUM,
                                    start=copy.deepcopy(after_checkpoint), first_step_id=2)
    train_step(model, ddp, opt, 0, 2)
    assert_matches(snapshot(model, opt), want1[0], "dp1 resumed")

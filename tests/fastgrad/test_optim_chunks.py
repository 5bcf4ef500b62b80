"""fastgrad.optim.ModelChunks (several DDP chunks under one optimizer) and ReplicatedOptimizer.

Interleaved pipeline stages hold several chunks, each with its own DDP buffer;
Megatron-Core steps them with one optimizer (one global norm, one clip
coefficient). Two chunks (the optim check's model with two seeds) on DP 2 gloo
ranks, AdamW clipped to 0.5 with the overlapped param all-gather, are compared
bitwise with one refgrad.optim step over all eight params every step.
ReplicatedOptimizer (no distributed optimizer: all-reduced grads, every rank
steps every param) is compared with refgrad.optim at DP 2 the same way.
"""

from __future__ import annotations

import pytest
import torch

from fastgrad.ddp import DistributedDataParallel
from fastgrad.optim import (
    AdamWConfig,
    DistributedOptimizer,
    ModelChunks,
    ReplicatedOptimizer,
    param_groups_without_decay_for,
)
from gradvocab import Averaging, DDPConfig
from refgrad import optim as R
from tests.distributed_utils import run_distributed
from tests.fastgrad.test_optim import assert_matches, snapshot, train_step
from verify.checks.optim.cases import (
    ADAMW,
    BUCKET_SIZE,
    FP32,
    MIXED,
    NAMES,
    SHAPES,
    TIED,
    Model,
    coefficient,
    initial,
)
from verify.checks.optim.expectations import reduced_grads, reference_trajectory
from verify.metrics import assert_bitwise_equal

CLIP = 0.5
STEPS = 3


def _chunks(overlap_param_gather: bool, dp_group=None) -> tuple[list, list]:
    config = DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                       bucket_size=BUCKET_SIZE, overlap_param_gather=overlap_param_gather)
    models = [Model(FP32, seed) for seed in (0, 1)]
    return models, [DistributedDataParallel(m, config=config, dp_group=dp_group)
                    for m in models]


def _worker(rank: int, world_size: int) -> dict:
    del world_size
    models, ddps = _chunks(True)
    chunks = ModelChunks(ddps)
    opt = DistributedOptimizer(chunks, AdamWConfig(**ADAMW), param_groups_without_decay_for(chunks),
                               max_grad_norm=CLIP)
    out = {"snapshots": [], "coefficients": [], "waited": []}

    def snapshot() -> None:  # the previous step's params, once gathered, and its state
        out["snapshots"].append({
            "params": {f"chunk{c}.{n}": p.detach().clone()
                       for c, m in enumerate(models) for n, p in m.named_parameters()},
            "state": opt.named_state_dict()["params"]})

    for step in range(STEPS):
        launched = opt.param_gather_in_flight
        for ddp in ddps:
            ddp.zero_grad_buffer()
        for seed, model in enumerate(models):
            coeffs = {n: coefficient(rank, step, i, n, seed=seed).float() for i, n in enumerate(NAMES)}
            model(coeffs).backward()  # the first forward waits for the previous step's gathers
        if step:
            out["waited"].append(launched and not opt.param_gather_in_flight)
            snapshot()
        chunks.finish_grad_sync()
        out["coefficients"].append(opt.step().clip_coefficient)
    opt.finish_param_sync()
    snapshot()
    opt.remove_hooks()
    return out


def _reference() -> list[dict]:
    """One refgrad.optim step over both chunks' params per step (one norm, one coefficient)."""
    names = [(c, i, n) for c in (0, 1) for i, n in enumerate(NAMES)]
    states = [R.ParamState(master=R.values(initial(i, n, c).float())) for c, i, n in names]
    hyper = R.AdamW(**ADAMW)
    hypers = [R.AdamW(**{**ADAMW, "weight_decay": 0.0}) if len(SHAPES[n]) == 1 else hyper
              for _, _, n in names]
    snapshots = []
    for step in range(STEPS):
        grads = [g for c in (0, 1) for g in reduced_grads(2, step, FP32, averaging=Averaging.PRESCALE, seed=c)]
        stepped, norm = R.optimizer_step(states, grads, hypers, [step + 1] * len(names), max_norm=CLIP,
                                         shared=[n in TIED for _, _, n in names])
        assert stepped
        snapshots.append({
            "coefficient": float(R.clip_coefficient(norm, CLIP)),
            "state": {f"chunk{c}.{n}": {"master": R.to_tensor(s.master, SHAPES[n]),
                                         "exp_avg": R.to_tensor(s.exp_avg, SHAPES[n]),
                                         "exp_avg_sq": R.to_tensor(s.exp_avg_sq, SHAPES[n])}
                      for (c, _, n), s in zip(names, states)}})
    return snapshots


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.dist
def test_one_optimizer_over_two_chunks_is_refgrads_joint_step_bitwise():
    ranks = run_distributed(_worker, 2, timeout_s=120)
    want = _reference()
    for rank, got in enumerate(ranks):
        assert got["waited"] == [True] * (STEPS - 1)  # the chunks' forward pre-hooks waited
        for step in range(STEPS):
            # One norm over both chunks: the grads here are large, so every step clips.
            assert got["coefficients"][step] == want[step]["coefficient"] < 1
            snap = got["snapshots"][step]
            for name, entry in want[step]["state"].items():
                assert_bitwise_equal(_bits(snap["params"][name]), _bits(entry["master"]), msg=str((rank, step, name)))
                for key, tensor in entry.items():
                    assert_bitwise_equal(_bits(snap["state"][name][key]), _bits(tensor), msg=str((
                        rank, step, name, key)))


def test_model_chunks_refuse_mismatched_chunks():
    _, ddps = _chunks(False)
    _, overlapped = _chunks(True)
    with pytest.raises(ValueError, match="at least one"):
        ModelChunks([])
    with pytest.raises(TypeError, match=r"chunks\[1\] must be a fastgrad DistributedDataParallel"):
        ModelChunks([ddps[0], "ddp"])
    with pytest.raises(ValueError, match=r"chunks\[1\].config.overlap_param_gather differs"):
        ModelChunks([ddps[0], overlapped[1]])
    with pytest.raises(ValueError, match=r"chunks\[1\] is chunks\[0\] again"):
        ModelChunks([ddps[0], ddps[0]])
    chunks = ModelChunks(ddps)
    assert chunks.name_of(ddps[1].module.layer.bias) == "chunk1.layer.bias"
    assert len(chunks.buffer.buckets) == len(ddps[0].buffer.buckets) + len(ddps[1].buffer.buckets)


def _two_groups_worker(rank: int, world_size: int) -> str:
    """Rank 0 builds its chunks on two DP groups of the same size ({0, 1} and {0, 2}): the
    same (size, rank) on rank 0, other ranks."""
    del world_size
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([0, 2])]  # every rank creates both
    if rank != 0:
        return "not in both"
    ddps = [_chunks(False, dp_group=g)[1][0] for g in groups]
    try:
        ModelChunks(ddps)
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.dist
def test_model_chunks_refuse_chunks_on_different_groups_of_the_same_size():
    results = run_distributed(_two_groups_worker, 3, timeout_s=120)
    assert results[0].startswith("chunks[1] has another data-parallel group than chunks[0] "
                                 "(ranks (0, 2) vs (0, 1))"), results[0]


# --------------------------------------------------------------------------- replicated optimizer


def _replicated_worker(rank: int, world_size: int) -> dict:
    """DP 2, all-reduced grads: ReplicatedOptimizer on one model, and over two chunks."""
    del world_size
    out = {}
    for label, dtypes in (("fp32", FP32), ("bf16+fp32", MIXED)):
        model = Model(dtypes, 0)
        config = DDPConfig(use_distributed_optimizer=False, overlap_grad_reduce=True, bucket_size=BUCKET_SIZE)
        ddp = DistributedDataParallel(model, config=config)
        opt = ReplicatedOptimizer(ddp, AdamWConfig(**ADAMW), param_groups_without_decay_for(ddp),
                                  max_grad_norm=CLIP)
        out[label] = []
        for step in range(STEPS):
            result = train_step(model, ddp, opt, rank, step)
            out[label].append((result.clip_coefficient, snapshot(model, opt)))
    return out


@pytest.mark.dist
def test_replicated_optimizer_over_all_reduced_grads_is_refgrads_step_bitwise():
    ranks = run_distributed(_replicated_worker, 2, timeout_s=120)
    for label, dtypes in (("fp32", FP32), ("bf16+fp32", MIXED)):
        want, _ = reference_trajectory([2] * STEPS, dtypes, "adamw", clip=CLIP)
        for rank, got in enumerate(ranks):
            for step, (coefficient_, snap) in enumerate(got[label]):
                assert coefficient_ < 1, (label, step)  # every step clips at 0.5
                assert_matches(snap, want[step], f"{label} rank {rank} step {step}")


def test_replicated_optimizer_refuses_a_sharded_buffer():
    _, ddps = _chunks(False)
    with pytest.raises(ValueError, match="needs DDPConfig.use_distributed_optimizer=False"):
        ReplicatedOptimizer(ddps[0], AdamWConfig(lr=0.1))
    config = DDPConfig(use_distributed_optimizer=False, bucket_size=BUCKET_SIZE)
    with pytest.raises(ValueError, match="ReplicatedOptimizer steps all-reduced grads"):
        DistributedOptimizer(DistributedDataParallel(Model(FP32), config=config), AdamWConfig(lr=0.1))

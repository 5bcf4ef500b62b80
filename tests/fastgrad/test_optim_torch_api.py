"""fastgrad.optim as a ``torch.optim.Optimizer``: torch's LR schedulers drive it, torch-shaped
checkpoints reshard, and its param groups are validated at every step.

Expected values: ``refgrad.optim`` fed, step by step, the hyper-parameters that the same torch
scheduler gives a plain ``torch.optim.AdamW`` / ``SGD`` (torch's own optimizer, not the code
under test), on the exact reduced grads of the ``optim`` check's model.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from torch.optim import lr_scheduler

from fastgrad.optim import AdamWConfig, DistributedOptimizer
from gradvocab import Averaging, LifecycleError
from refgrad import optim as R
from tests.distributed_utils import run_distributed
from tests.fastgrad.optim_model import build, train_step
from verify.checks.optim.cases import (
    ADAMW,
    FP32,
    NAMES,
    SGD,
    SHAPES,
    SHARED,
    bits,
    initial,
)
from verify.checks.optim.expectations import reduced_grads
from verify.metrics import assert_bitwise_equal

STEPS = 4
SCHEDULES = {
    # name -> (algorithm, scheduler factory)
    "LambdaLR warmup": ("adamw", lambda opt: lr_scheduler.LambdaLR(opt, lambda k: min(1.0, k / 2))),
    "CosineAnnealingLR": ("adamw", lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=3, eta_min=1e-4)),
    "OneCycleLR betas": ("adamw", lambda opt: lr_scheduler.OneCycleLR(
        opt, max_lr=0.02, total_steps=STEPS, pct_start=0.5, base_momentum=0.8, max_momentum=0.95)),
    "OneCycleLR momentum": ("sgd", lambda opt: lr_scheduler.OneCycleLR(
        opt, max_lr=0.1, total_steps=STEPS, pct_start=0.5, base_momentum=0.8, max_momentum=0.95)),
}


def _hyper_of(group: dict, algorithm: str) -> tuple:
    if algorithm == "adamw":
        return (group["lr"], *group["betas"], group["eps"], group["weight_decay"])
    return (group["lr"], group["momentum"], group["weight_decay"])


def _torch_schedule(name: str) -> list[tuple]:
    """The hyper-parameters torch's scheduler gives torch's own optimizer before each step."""
    algorithm, make = SCHEDULES[name]
    dummy = [torch.nn.Parameter(torch.zeros(1))]
    if algorithm == "adamw":
        opt = torch.optim.AdamW(dummy, lr=ADAMW["lr"], betas=(ADAMW["beta1"], ADAMW["beta2"]),
                                eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
    else:
        opt = torch.optim.SGD(dummy, lr=SGD["lr"], momentum=SGD["momentum"], weight_decay=SGD["weight_decay"])
    scheduler = make(opt)
    out = []
    for _ in range(STEPS):
        out.append(_hyper_of(opt.param_groups[0], algorithm))
        opt.step()
        scheduler.step()
    return out


def _scheduled_worker(rank: int, world: int, name: str) -> dict:
    algorithm, make = SCHEDULES[name]
    model, ddp, opt = build(FP32, algorithm)
    scheduler = make(opt)
    seen, params = [], []
    for step in range(STEPS):
        seen.append(_hyper_of(opt.param_groups[0], algorithm))
        assert train_step(model, ddp, opt, rank, step).stepped
        scheduler.step()
        opt.finish_param_sync()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"seen": seen, "params": params}


def _refgrad_scheduled(schedule: list[tuple], algorithm: str) -> list[dict[str, torch.Tensor]]:
    """refgrad.optim at DP 2 with step k's hyper-parameters; 1-D params without decay."""
    states = [R.ParamState(master=R.values(initial(i, n).float())) for i, n in enumerate(NAMES)]
    out = []
    for step, hyper in enumerate(schedule):
        hypers = [_refgrad_hyper(algorithm, hyper, no_decay=len(SHAPES[n]) == 1) for n in NAMES]
        grads = reduced_grads(2, step, FP32, averaging=Averaging.PRESCALE)
        assert R.optimizer_step(states, grads, hypers, [step + 1] * len(NAMES), shared=list(SHARED))[0]
        out.append({n: R.to_tensor(s.master, SHAPES[n]) for n, s in zip(NAMES, states)})
    return out


def _refgrad_hyper(algorithm: str, hyper: tuple, *, no_decay: bool) -> R.AdamW | R.SGD:
    if algorithm == "adamw":
        lr, beta1, beta2, eps, wd = hyper
        return R.AdamW(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=0.0 if no_decay else wd)
    lr, momentum, wd = hyper
    return R.SGD(lr=lr, momentum=momentum, weight_decay=0.0 if no_decay else wd)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_torch_lr_schedulers_drive_the_optimizer_bitwise_as_refgrad(name):
    algorithm = SCHEDULES[name][0]
    schedule = _torch_schedule(name)
    assert len(set(schedule)) > 1  # the schedule really moves something
    want = _refgrad_scheduled(schedule, algorithm)
    for rank, out in enumerate(run_distributed(_scheduled_worker, 2, name)):
        assert out["seen"] == schedule, f"rank {rank}: the scheduler set other values"
        for step in range(STEPS):
            for n in NAMES:
                assert_bitwise_equal(bits(out["params"][step][n]), bits(want[step][n]), msg=str((rank, step, n)))


def test_hand_derived_schedules():
    """The sequences the test above feeds refgrad, against their closed forms."""
    lambda_lrs = [h[0] for h in _torch_schedule("LambdaLR warmup")]
    assert lambda_lrs == [0.0, ADAMW["lr"] / 2, ADAMW["lr"], ADAMW["lr"]]

    cosine = [h[0] for h in _torch_schedule("CosineAnnealingLR")]
    closed = [1e-4 + (ADAMW["lr"] - 1e-4) * (1 + math.cos(math.pi * k / 3)) / 2 for k in range(STEPS)]
    # torch computes it recursively in fp64: equal to the closed form to a few fp64 ulps
    assert all(abs(a - b) <= 4 * math.ulp(b) for a, b in zip(cosine, closed)), (cosine, closed)
    betas = [h[1] for h in _torch_schedule("OneCycleLR betas")]
    assert betas[0] == 0.95 and min(betas) == 0.8  # momentum cycles down while the lr goes up


# --------------------------------------------------------------------------- torch-shaped checkpoints


def _checkpoint_worker(rank: int, world: int) -> dict:
    """DP 2 on ranks 0-1 for 2 steps with a LambdaLR; rank 0's torch-shaped state_dict (through
    torch.save) resumed at DP 1 on rank 0 and at DP 2 on both, one more step each."""
    pair = dist.new_group([0, 1])
    single = [dist.new_group([r]) for r in range(world)][rank]
    warmup = lambda k: min(1.0, (k + 1) / 2)  # noqa: E731
    model, ddp, opt = build(FP32, "adamw", dp_group=pair)
    scheduler = lr_scheduler.LambdaLR(opt, warmup)
    for step in range(2):
        train_step(model, ddp, opt, rank, step)
        scheduler.step()
    state = opt.state_dict()
    out = {"keys": sorted(state), "group_keys": sorted(state["param_groups"][0]),
           "indices": [g["params"] for g in state["param_groups"]],
           "state_keys": sorted(state["state"][0])}
    blob = io.BytesIO()
    torch.save({"optimizer": state, "scheduler": scheduler.state_dict()}, blob)
    for label, group, data_rank in (("DP 1", single, 0), ("DP 2", pair, rank)):
        if label == "DP 1" and rank != 0:
            continue
        blob.seek(0)
        saved = torch.load(blob, weights_only=True)
        model2, ddp2, opt2 = build(FP32, "adamw", dp_group=group)
        scheduler2 = lr_scheduler.LambdaLR(opt2, warmup)
        opt2.load_state_dict(saved["optimizer"])
        scheduler2.load_state_dict(saved["scheduler"])
        out[f"{label} lr"] = opt2.param_groups[0]["lr"]
        train_step(model2, ddp2, opt2, data_rank, 2)
        opt2.finish_param_sync()
        out[label] = {n: p.detach().clone() for n, p in model2.named_parameters()}
    return out


@pytest.mark.dist
def test_torch_shaped_checkpoint_with_its_scheduler_resumes_at_dp1_and_dp2():
    per_rank = run_distributed(_checkpoint_worker, 2)
    lrs = [ADAMW["lr"] * min(1.0, (k + 1) / 2) for k in range(3)]  # hand: LambdaLR's warmup

    def expected(worlds: list[int]) -> dict[str, torch.Tensor]:
        states = [R.ParamState(master=R.values(initial(i, n).float())) for i, n in enumerate(NAMES)]
        for step, world in enumerate(worlds):
            hyper = {**ADAMW, "lr": lrs[step]}
            hypers = [R.AdamW(**{**hyper, "weight_decay": 0.0 if len(SHAPES[n]) == 1 else hyper["weight_decay"]})
                      for n in NAMES]
            assert R.optimizer_step(states, reduced_grads(world, step, FP32, averaging=Averaging.PRESCALE), hypers,
                                    [step + 1] * len(NAMES), shared=list(SHARED))[0]
        return {n: R.to_tensor(s.master, SHAPES[n]) for n, s in zip(NAMES, states)}

    want = {"DP 1": expected([2, 2, 1]), "DP 2": expected([2, 2, 2])}
    for rank, out in enumerate(per_rank):
        assert out["keys"] == ["fastgrad", "param_groups", "state"]
        assert out["indices"] == [[0, 1, 2], [3, 4]]  # torch's numbering: group after group
        assert out["state_keys"] == ["exp_avg", "exp_avg_sq", "master", "step"]
        assert {"lr", "betas", "eps", "weight_decay", "initial_lr", "params"} <= set(out["group_keys"])
        for label in ("DP 1", "DP 2") if rank == 0 else ("DP 2",):
            assert out[f"{label} lr"] == lrs[2]
            for n in NAMES:
                assert_bitwise_equal(bits(out[label][n]), bits(want[label][n]), msg=str((rank, label, n)))


# --------------------------------------------------------------------------- the groups' rules


def test_param_groups_are_read_and_validated_at_every_step():
    model, ddp, opt = build(FP32, "adamw")
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.defaults == {"lr": ADAMW["lr"], "betas": (ADAMW["beta1"], ADAMW["beta2"]),
                            "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"]}
    opt.param_groups[1]["lr"] = -0.5
    with pytest.raises(ValueError, match=r"param_groups\[1\]: AdamWConfig.lr must be finite and >= 0"):
        train_step(model, ddp, opt, 0, 0)
    opt.param_groups[1]["lr"] = ADAMW["lr"]
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['amsgrad'\] = True: fastgrad's AdamW does not"):
        opt.step()
    del opt.param_groups[0]["amsgrad"]
    with pytest.raises(NotImplementedError, match="fixed at construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    with pytest.raises(TypeError, match="takes no closure"):
        opt.step(lambda: 0.0)


def test_group_overrides_take_torch_or_config_names_and_refuse_typos():
    model, ddp, _ = build(FP32, "adamw")
    params = list(model.parameters())
    opt = DistributedOptimizer(ddp, AdamWConfig(**ADAMW), [{"params": params[:2], "betas": (0.5, 0.6)},
                                                {"params": params[2:], "beta1": 0.7}])
    assert [g["betas"] for g in opt.param_groups] == [(0.5, 0.6), (0.7, ADAMW["beta2"])]
    assert [(c.beta1, c.beta2) for c in opt.groups] == [(0.5, 0.6), (0.7, ADAMW["beta2"])]
    with pytest.raises(ValueError, match=r"param_groups\[0\]: unknown hyper-parameter 'weight_dacay'"):
        DistributedOptimizer(ddp, AdamWConfig(**ADAMW), [{"params": params, "weight_dacay": 0.0}])


def test_zero_grad_of_the_optimizer_resets_what_the_step_reads():
    model, ddp, opt = build(FP32, "adamw")
    train_step(model, ddp, opt, 0, 0)
    assert any(bool(g.grad_data.any()) for g in ddp.buffer.groups)
    opt.zero_grad()
    assert not any(bool(g.grad_data.any()) for g in ddp.buffer.groups)
    with pytest.raises(LifecycleError, match="before the grad sync"):
        opt.step()  # zeroed, but nothing reduced since the last step

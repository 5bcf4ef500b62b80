"""Ordinary PyTorch habits with fastgrad: each works as in torch, or raises a LifecycleError /
ValueError that says what to do (issue 23). Real gloo ranks at DP 2, rank-specific grads, two
or more steps.

The model and the grads are the ``optim`` check's (``verify.checks.optim.cases``): the loss is
``sum(param * coefficient)``, the coefficients multiples of 1/8 per rank and step, so the
reduced grads are exact and the expected params come from ``refgrad.optim``
(``expectations.reference_trajectory``) or, for torch's own optimizers, from the same torch
optimizer stepping a plain, unwrapped copy of the model on the exact mean grads.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fastgrad.ddp import DistributedDataParallel
from fastgrad.optim import (
    AdamWConfig,
    DistributedOptimizer,
    ReplicatedOptimizer,
    param_groups_without_decay_for,
)
from fastgrad.param_guard import ParamPlacement
from gradvocab import DDPConfig, LifecycleError
from refgrad import optim as R
from tests.distributed_utils import run_distributed
from tests.fastgrad.optim_model import build
from verify.checks.optim.cases import ADAMW, FP32, NAMES, Model, bits, coefficient, initial
from verify.checks.optim.expectations import reference_trajectory
from verify.metrics import bitwise_equal

STEPS = 2  # the second step shows a grad buffer that was not zeroed


def _coeffs(rank: int, step: int) -> dict[str, torch.Tensor]:
    return {n: coefficient(rank, step, i, n).float() for i, n in enumerate(NAMES)}


def _forward_backward(model, ddp, rank: int, step: int) -> None:
    model(_coeffs(rank, step)).backward()


def _error(fn) -> str:
    """``fn()``'s exception as 'Type: message', or 'no error'."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type and message are the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return all(bitwise_equal(bits(a[n]), bits(b[n])) for n in NAMES)


def _refgrad_params(steps: int, algorithm: str = "adamw") -> list[dict[str, torch.Tensor]]:
    want, _ = reference_trajectory([2] * steps, FP32, algorithm)
    return [w["params"] for w in want]


def _torch_reference(make_optimizer, steps: int) -> list[dict[str, torch.Tensor]]:
    """A torch optimizer on a plain model copy, fed the exact DP-2 mean of the ranks' grads."""
    model = Model(FP32)
    opt = make_optimizer(model.parameters())
    out = []
    for step in range(steps):
        opt.zero_grad()
        for n, p in model.named_parameters():
            i = NAMES.index(n)
            p.grad = ((coefficient(0, step, i, n) + coefficient(1, step, i, n)) / 2).float()
        opt.step()
        out.append(_params(model))
    return out


# --------------------------------------------------------------------------- zeroing habits


def _train_with(zero, step_fn, model, ddp, rank: int) -> list[dict] | str:
    """STEPS steps zeroing with ``zero()``; the params after each, or the error raised."""
    runs = []
    try:
        for step in range(STEPS):
            zero()
            _forward_backward(model, ddp, rank, step)
            ddp.finish_grad_sync()
            step_fn()
            if hasattr(step_fn.__self__, "finish_param_sync"):
                step_fn.__self__.finish_param_sync()
            runs.append(_params(model))
    except Exception as exc:  # noqa: BLE001 - the type and message are the result
        return f"{type(exc).__name__}: {exc}"
    return runs


def _zero_grad_habits(rank: int, world: int) -> dict:
    out = {}
    # ddp.zero_grad() (nn.Module's) in place of zero_grad_buffer(), distributed optimizer
    model, ddp, opt = build(FP32, "adamw")
    out["ddp.zero_grad"] = _train_with(ddp.zero_grad, opt.step, model, ddp, rank)
    # the fastgrad optimizer's own zero_grad()
    model, ddp, opt = build(FP32, "adamw")
    out["opt.zero_grad"] = _train_with(lambda: opt.zero_grad(), opt.step, model, ddp, rank)
    # torch.optim.SGD's zero_grad() on the all-reduce DDP (set_to_none, then not)
    for set_to_none in (True, False):
        model = Model(FP32)
        ddp = DistributedDataParallel(model, config=DDPConfig())
        torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        out[f"torch zero_grad(set_to_none={set_to_none})"] = _train_with(
            lambda o=torch_opt, s=set_to_none: o.zero_grad(set_to_none=s), torch_opt.step, model, ddp, rank)
    # no zeroing at all: all-reduce DDP (param.grad is main_grad itself) and distributed optimizer
    for kind in ("all-reduce", "distributed"):
        if kind == "all-reduce":
            model = Model(FP32)
            ddp = DistributedDataParallel(model, config=DDPConfig())
            step_fn = torch.optim.SGD(ddp.parameters(), lr=0.05).step
        else:
            model, ddp, opt = build(FP32, "adamw")
            step_fn = opt.step
        ddp.zero_grad_buffer()
        _forward_backward(model, ddp, rank, 0)
        ddp.finish_grad_sync()
        step_fn()
        out[f"no zeroing ({kind})"] = _error(lambda model=model, ddp=ddp: _forward_backward(model, ddp, rank, 1))
    return out


@pytest.mark.dist
def test_zeroing_the_grads_the_torch_way_works_and_no_zeroing_raises():
    per_rank = run_distributed(_zero_grad_habits, 2)
    want = _refgrad_params(STEPS)
    torch_want = _torch_reference(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), STEPS)
    for rank, out in enumerate(per_rank):
        for habit, expected in [("ddp.zero_grad", want), ("opt.zero_grad", want),
                                ("torch zero_grad(set_to_none=True)", torch_want),
                                ("torch zero_grad(set_to_none=False)", torch_want)]:
            runs = out[habit]
            assert not isinstance(runs, str), f"rank {rank} {habit}: {runs}"
            for step in range(STEPS):
                assert _same(runs[step], expected[step]), f"rank {rank} {habit} step {step}"
        for kind in ("all-reduce", "distributed"):
            message = out[f"no zeroing ({kind})"]
            assert message.startswith("LifecycleError") and "zero_grad_buffer()" in message, message
            # every method the message advises exists
            assert "optimizer.zero_grad()" not in message or hasattr(DistributedOptimizer, "zero_grad")


# --------------------------------------------------------------------------- unreduced grads


def _step_without_finish(rank: int, world: int) -> dict:
    model = Model(FP32)
    ddp = DistributedDataParallel(model, config=DDPConfig(overlap_grad_reduce=True, bucket_size=200))
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    out = {}
    ddp.zero_grad_buffer()
    _forward_backward(model, ddp, rank, 0)
    out["torch step before finish_grad_sync"] = _error(torch_opt.step)
    out["clip_grad_norm_ before finish_grad_sync"] = _error(
        lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0))
    ddp.finish_grad_sync()  # the reductions were launched by the hooks: drain them
    torch_opt.step()
    torch_opt.zero_grad()
    _forward_backward(model, ddp, rank, 1)
    ddp.finish_grad_sync()
    torch_opt.step()
    out["params"] = _params(model)
    return out


@pytest.mark.dist
def test_a_torch_optimizer_step_before_finish_grad_sync_raises():
    per_rank = run_distributed(_step_without_finish, 2)
    want = _torch_reference(lambda ps: torch.optim.SGD(ps, lr=0.05), 2)
    for out in per_rank:
        for what in ("torch step before finish_grad_sync", "clip_grad_norm_ before finish_grad_sync"):
            message = out[what]
            assert message.startswith("LifecycleError") and "finish_grad_sync()" in message, (what, message)
        assert _same(out["params"], want[1])  # after the error the loop continues correctly


# --------------------------------------------------------------------------- dtype / device changes


def _cast_after_wrapping(rank: int, world: int) -> dict:
    out = {}
    model, ddp, opt = build(FP32, "adamw")
    model.to(torch.bfloat16)  # after building the optimizer
    out["distributed, cast after the optimizer"] = _error(lambda: _train_one(model, ddp, opt, rank))
    model = Model(FP32)
    ddp = DistributedDataParallel(model, config=DDPConfig(use_distributed_optimizer=True))
    ddp.to(torch.bfloat16)  # before building the optimizer
    out["distributed, cast before the optimizer"] = _error(
        lambda: DistributedOptimizer(ddp, AdamWConfig(lr=0.01)))
    model = Model(FP32)
    ddp = DistributedDataParallel(model, config=DDPConfig())
    opt = ReplicatedOptimizer(ddp, AdamWConfig(lr=0.01))
    model.half()
    out["replicated, half after the optimizer"] = _error(lambda: _train_one(model, ddp, opt, rank))
    model = Model(FP32)
    ddp = DistributedDataParallel(model, config=DDPConfig())
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    model.to(torch.float64)
    out["all-reduce + torch SGD, cast to float64"] = _error(lambda: _train_one(model, ddp, torch_opt, rank))
    return out


def _train_one(model, ddp, opt, rank: int) -> None:
    for step in range(2):
        ddp.zero_grad_buffer()
        model({n: c.to(next(model.parameters()).dtype) for n, c in _coeffs(rank, step).items()}).backward()
        ddp.finish_grad_sync()
        opt.step()


@pytest.mark.dist
def test_a_wrapped_model_cast_to_another_dtype_raises():
    per_rank = run_distributed(_cast_after_wrapping, 2)
    for out in per_rank:
        for what, message in out.items():
            assert message.startswith("LifecycleError"), (what, message)
            assert "changed dtype" in message and "before wrapping" in message, (what, message)
            assert "'embed.weight'" in message, (what, message)


class _MovableParam:
    """Stands in a parameter whose ``device`` changes in place (as ``.cuda()`` after wrapping
    does to a real one through ``param.data = ...``; this machine has no second device)."""

    def __init__(self) -> None:
        self.dtype, self.device = torch.float32, torch.device("cpu")

    def data_ptr(self) -> int:
        return 64


class _OneGroupBuffer:
    param_data = torch.zeros(1)  # a buffer view: the data pointer is recorded too

    def group_of(self, param):
        return self


def test_a_wrapped_param_moved_to_another_device_is_refused():
    param = _MovableParam()
    placement = ParamPlacement([param], _OneGroupBuffer())
    placement.check(lambda p: "w")
    param.device = torch.device("cuda", 0)
    with pytest.raises(LifecycleError, match=r"'w' moved from cpu to cuda:0 .*before wrapping"):
        placement.check(lambda p: "w")


@pytest.mark.gpu
def test_a_wrapped_model_moved_to_cuda_raises():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, ddp, opt = build(FP32, "adamw")
    model.cuda()
    with pytest.raises(LifecycleError, match=r"moved from cpu to cuda:0 .*before wrapping"):
        ddp.zero_grad_buffer()


def test_param_data_replaced_under_the_distributed_optimizer_is_refused():
    model, ddp, opt = build(FP32, "adamw")
    model.layer.bias.data = torch.zeros(11)  # same dtype and device, a new storage
    with pytest.raises(LifecycleError, match=r"'layer.bias' no longer is a view of the grad buffer"):
        ddp.zero_grad_buffer()


# --------------------------------------------------------------------------- groups


def _groups(rank: int, world: int) -> dict:
    out = {}
    model, ddp, _ = build(FP32, "adamw")
    out["distributed, model_parallel_group=WORLD"] = _error(
        lambda: DistributedOptimizer(ddp, AdamWConfig(lr=0.01), max_grad_norm=1.0,
                                     model_parallel_group=dist.group.WORLD))
    model = Model(FP32)
    ddp = DistributedDataParallel(model, config=DDPConfig())
    out["replicated, model_parallel_group=WORLD"] = _error(
        lambda: ReplicatedOptimizer(ddp, AdamWConfig(lr=0.01), model_parallel_group=dist.group.WORLD))
    only_rank0 = dist.new_group([0])
    if rank == 1:
        out["dp_group without this rank"] = _error(
            lambda: DistributedDataParallel(Model(FP32), config=DDPConfig(), dp_group=only_rank0))
    return out


@pytest.mark.dist
def test_overlapping_model_parallel_group_and_a_foreign_dp_group_are_refused():
    per_rank = run_distributed(_groups, 2)
    for out in per_rank:
        for what in ("distributed, model_parallel_group=WORLD", "replicated, model_parallel_group=WORLD"):
            message = out[what]
            assert message.startswith("ValueError") and "model_parallel_group" in message, (what, message)
            assert "data-parallel group" in message and "[0, 1]" in message, (what, message)
    message = per_rank[1]["dp_group without this rank"]
    assert message.startswith("ValueError") and "dp_group does not contain this process" in message, message
    assert "global rank 1" in message, message


# --------------------------------------------------------------------------- weights behind the optimizer's back


def _loaded_after_building(rank: int, world: int, optimizer: str) -> dict:
    """Weights loaded with ddp.load_state_dict: before the first step, and after step 1."""
    other = Model(FP32, seed=5)
    out = {}
    model, ddp, opt = _build(optimizer)
    ddp.load_state_dict(other.state_dict())
    out["before step 1"] = _run_steps(model, ddp, opt, rank, 0, 2)
    model, ddp, opt = _build(optimizer)
    _run_steps(model, ddp, opt, rank, 0, 1)
    ddp.load_state_dict(other.state_dict())
    out["after step 1"] = _run_steps(model, ddp, opt, rank, 1, 2)
    return out


def _build(optimizer: str):
    """The check's model (AdamW, no decay on 1-D params) under either fastgrad optimizer."""
    if optimizer == "distributed":
        return build(FP32, "adamw")
    model = Model(FP32)
    ddp = DistributedDataParallel(model, config=DDPConfig(overlap_grad_reduce=True, bucket_size=200))
    return model, ddp, ReplicatedOptimizer(ddp, AdamWConfig(**ADAMW), param_groups_without_decay_for(ddp))


def _run_steps(model, ddp, opt, rank, first, last) -> list[dict]:
    out = []
    for step in range(first, last):
        ddp.zero_grad_buffer()
        _forward_backward(model, ddp, rank, step)
        ddp.finish_grad_sync()
        opt.step()
        opt.finish_param_sync()
        out.append(_params(model))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("optimizer", ["distributed", "replicated"])
def test_weights_loaded_into_the_model_after_building_the_optimizer_are_trained_on(optimizer):
    per_rank = run_distributed(_loaded_after_building, 2, optimizer)
    # refgrad: the loaded weights are the masters from then on (torch's semantics: the params
    # are the truth); the AdamW moments of step 1 stay.
    fresh, _ = reference_trajectory([2, 2], FP32, "adamw", start=(_initial_states(seed=5), 0))
    _, (states, steps) = reference_trajectory([2], FP32, "adamw")
    for state, loaded_state in zip(states, _initial_states(seed=5)):
        state.master = loaded_state.master
    loaded, _ = reference_trajectory([2], FP32, "adamw", start=(states, steps), first_step_id=1)
    for rank, out in enumerate(per_rank):
        for step in range(2):
            assert _same(out["before step 1"][step], fresh[step]["params"]), f"rank {rank} step {step}"
        assert _same(out["after step 1"][0], loaded[0]["params"]), f"rank {rank}"


def _initial_states(seed: int) -> list[R.ParamState]:
    """refgrad's fresh state of the check's model initialised with ``seed``."""
    return [R.ParamState(master=R.values(initial(i, n, seed).float())) for i, n in enumerate(NAMES)]

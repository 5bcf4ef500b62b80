"""fastgrad.optim on one process (DP=1): bitwise equal to refgrad.optim, and its input rules.

The helpers here (model, rank-specific grads, the refgrad trajectory) are also
used by the multi-rank tests in test_optim_dist.py.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from torch import nn

from fastgrad.config import DDPConfig
from fastgrad.ddp import DistributedDataParallel
from fastgrad.errors import LifecycleError
from fastgrad.optim import (
    AdamWConfig,
    DistributedOptimizer,
    DynamicLossScaler,
    SGDConfig,
    param_groups_without_decay_for,
)
from refgrad import optim as R
from refgrad import reduce_scatter as RS

NAMES = ("embed.weight", "layer.weight", "layer.bias", "norm.weight")
SHAPES = {"embed.weight": (13, 17), "layer.weight": (9, 11), "layer.bias": (11,), "norm.weight": (11,)}
ADAMW = {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1}
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}


def initial(index: int, name: str) -> torch.Tensor:
    """Initial values: multiples of 1/16 in [-11/16, 11/16], exact in bf16 and fp16."""
    n = math.prod(SHAPES[name])
    flat = torch.arange(n, dtype=torch.float64)
    return (((flat * 37 + index * 11) % 23 - 11) / 16).reshape(SHAPES[name])


def coefficient(rank: int, step: int, index: int, name: str, inf_at: tuple | None = None) -> torch.Tensor:
    """Rank-specific d(loss)/d(param): multiples of 1/8 in [-1, 1] (sums over <= 4 ranks exact)."""
    n = math.prod(SHAPES[name])
    flat = torch.arange(n, dtype=torch.float64)
    c = ((flat * 3 + index * 7 + rank * 5 + step * 11) % 17 - 8) / 8
    if inf_at is not None and inf_at[:3] == (rank, step, name):
        c[inf_at[3]] = math.inf
    return c.reshape(SHAPES[name])


class Leaf(nn.Module):
    """Owns some params; forward adds ``sum(param * coefficient)`` for each."""

    def __init__(self, prefix: str, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.prefix = prefix
        for key, value in params.items():
            self.register_parameter(key, nn.Parameter(value))

    def forward(self, coeffs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((p.float() * coeffs[f"{self.prefix}.{k}"]).sum() for k, p in self.named_parameters())


class Model(nn.Module):
    def __init__(self, dtypes: dict[str, torch.dtype]) -> None:
        super().__init__()
        def make(name):
            return initial(NAMES.index(name), name).to(dtypes[name])
        self.embed = Leaf("embed", {"weight": make("embed.weight")})
        self.layer = Leaf("layer", {"weight": make("layer.weight"), "bias": make("layer.bias")})
        self.norm = Leaf("norm", {"weight": make("norm.weight")})

    def forward(self, coeffs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.embed(coeffs) + self.layer(coeffs) + self.norm(coeffs)


def build(dtypes, algorithm, *, clip=None, overlap_param_gather=False, average=True,
          scaler=None, grad_fp32=False, dp_group=None, model_parallel_group=None):
    """Model + DDP (distributed optimizer, several buckets) + DistributedOptimizer."""
    model = Model(dtypes)
    config = DDPConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=200,
        overlap_param_gather=overlap_param_gather, grad_reduce_in_fp32=grad_fp32,
    )
    ddp = DistributedDataParallel(model, config=config, average=average, dp_group=dp_group)
    cfg = AdamWConfig(**ADAMW) if algorithm == "adamw" else SGDConfig(**SGD)
    opt = DistributedOptimizer(
        ddp, cfg, param_groups_without_decay_for(ddp), max_grad_norm=clip, loss_scaler=scaler,
        model_parallel_group=model_parallel_group,
    )
    return model, ddp, opt


def train_step(model, ddp, opt, rank, step, *, loss_scale=1.0, inf_at=None):
    """zero, forward, backward (DDP hooks reduce), step; returns the StepResult."""
    ddp.zero_grad_buffer()
    coeffs = {n: coefficient(rank, step, i, n, inf_at).float() * loss_scale for i, n in enumerate(NAMES)}
    model(coeffs).backward()
    ddp.finish_grad_sync()
    return opt.step()


def snapshot(model, opt) -> dict:
    """Full params (after the gather) and the optimizer's full state_dict."""
    opt.finish_param_sync()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "state": opt.state_dict(),
    }


# --------------------------------------------------------------------------- the refgrad trajectory


def reduced_grads(world: int, step: int, dtypes, *, average: bool, grad_fp32=False,
                  loss_scale=1.0, inf_at=None) -> list[torch.Tensor]:
    key = (world, step, tuple(dtypes.items()), average, grad_fp32, loss_scale, inf_at)
    if key not in _REDUCED:
        _REDUCED[key] = _reduced_grads(world, step, dtypes, average=average, grad_fp32=grad_fp32,
                                       loss_scale=loss_scale, inf_at=inf_at)
    return _REDUCED[key]


_REDUCED: dict = {}  # the refgrad reductions are slow and shared by several tests


def _reduced_grads(world: int, step: int, dtypes, *, average: bool, grad_fp32=False,
                   loss_scale=1.0, inf_at=None) -> list[torch.Tensor]:
    """Per param: the DDP reduction of the ranks' grads, by refgrad's reduce-scatter spec.

    The grads are multiples of 1/8 (times a power-of-two loss scale), so every
    partial sum is exact and the rank order used here is also gloo's result.
    Averaging is by torch's ``1/dp`` pre-scale (exact only for power-of-two dp).
    """
    out = []
    for i, name in enumerate(NAMES):
        gdtype = torch.float32 if grad_fp32 else dtypes[name]
        per_rank = [
            (coefficient(r, step, i, name, inf_at) * loss_scale).to(dtypes[name]).to(gdtype).reshape(-1)
            for r in range(world)
        ]
        if average:
            per_rank = RS.prescale_like_torch(per_rank, 1.0 / world)
        out.append(RS.all_reduce(per_rank, accumulate="wire", order="rank")[0])
    return out


def reference_trajectory(worlds, dtypes, algorithm, *, clip=None, average=True, grad_fp32=False,
                         scales=None, inf_at=None, start=None, first_step_id=0):
    """refgrad.optim fed the reduced grads of each step; a snapshot after every step.

    ``worlds[k]``: the DP size of step k (grads differ per DP size).
    ``scales[k]``: the loss scale of step k. ``start``: (states, steps) to resume from;
    ``first_step_id``: the data index of the first step.
    """
    hyper = R.AdamW(**ADAMW) if algorithm == "adamw" else R.SGD(**SGD)
    no_decay = type(hyper)(**{**hyper.__dict__, "weight_decay": 0.0})
    hypers = [no_decay if len(SHAPES[n]) == 1 else hyper for n in NAMES]
    if start is None:
        states = [R.ParamState(master=R.values(initial(i, n).to(dtypes[n]).float())) for i, n in enumerate(NAMES)]
        steps = 0
    else:
        states, steps = start
    snapshots = []
    for k, world in enumerate(worlds):
        scale = None if scales is None else scales[k]
        step_id = first_step_id + k
        grads = reduced_grads(world, step_id, dtypes, average=average, grad_fp32=grad_fp32,
                              loss_scale=1.0 if scale is None else scale, inf_at=inf_at)
        stepped, _ = R.optimizer_step(states, grads, hypers, [steps + 1] * len(NAMES),
                                      max_norm=clip, loss_scale=scale)
        steps += stepped
        snapshots.append({"stepped": stepped, "steps": steps, **expected_tensors(states, dtypes)})
    return snapshots, (states, steps)


def expected_tensors(states, dtypes) -> dict:
    out = {"params": {}, "state": {}}
    for n, s in zip(NAMES, states):
        shape = SHAPES[n]
        out["params"][n] = R.to_tensor(s.master, shape, dtypes[n])
        entry = {"master": R.to_tensor(s.master, shape)}
        for key in ("exp_avg", "exp_avg_sq"):
            if getattr(s, key) is not None:
                entry[key] = R.to_tensor(getattr(s, key), shape)
        if s.momentum is not None:
            entry["momentum_buffer"] = R.to_tensor(s.momentum, shape)
        out["state"][n] = entry
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_matches(got: dict, want: dict, where: str) -> None:
    """Bitwise: params, masters, and every optimizer state tensor refgrad has."""
    for n in NAMES:
        assert torch.equal(bits(got["params"][n]), bits(want["params"][n])), f"{where}: param {n}"
        for key, tensor in want["state"][n].items():
            mine = got["state"]["params"][n][key]
            assert torch.equal(bits(mine), bits(tensor)), f"{where}: {key} of {n}"


# --------------------------------------------------------------------------- DP=1 tests

MIXED = {"embed.weight": torch.bfloat16, "layer.weight": torch.float32,
         "layer.bias": torch.float32, "norm.weight": torch.bfloat16}
FP32 = dict.fromkeys(NAMES, torch.float32)


@pytest.mark.parametrize(
    ("algorithm", "dtypes", "clip"),
    [("adamw", FP32, 0.5), ("adamw", MIXED, None), ("sgd", FP32, None), ("sgd", MIXED, 0.5)],
    ids=["adamw-fp32-clip", "adamw-bf16+fp32", "sgd-fp32", "sgd-bf16+fp32-clip"],
)
def test_dp1_bitwise_equal_to_refgrad(algorithm, dtypes, clip):
    model, ddp, opt = build(dtypes, algorithm, clip=clip)
    want, _ = reference_trajectory([1, 1, 1], dtypes, algorithm, clip=clip)
    for step in range(3):
        result = train_step(model, ddp, opt, 0, step)
        assert result.stepped and math.isfinite(result.grad_norm)
        if clip is not None:
            assert result.clip_coefficient < 1  # the grads here have norm > 0.5
        assert_matches(snapshot(model, opt), want[step], f"step {step}")


def test_dp1_grad_norm_is_refgrads_exact_norm():
    model, ddp, opt = build(MIXED, "adamw")
    result = train_step(model, ddp, opt, 0, 0)
    grads = [R.values(g) for g in reduced_grads(1, 0, MIXED, average=True)]
    assert result.grad_norm == float(R.global_norm(grads))


def test_checkpoint_round_trip_and_resume_dp1():
    model, ddp, opt = build(MIXED, "sgd")
    for step in range(2):
        train_step(model, ddp, opt, 0, step)
    state = opt.state_dict()
    model2, ddp2, opt2 = build(MIXED, "sgd")
    opt2.load_state_dict(state)
    for n, p in model2.named_parameters():
        assert torch.equal(bits(p.detach()), bits(state["params"][n]["master"].to(p.dtype)))
    train_step(model, ddp, opt, 0, 2)
    train_step(model2, ddp2, opt2, 0, 2)
    assert_matches(snapshot(model2, opt2), {"params": dict(model.named_parameters()),
                                            "state": opt.state_dict()["params"]}, "resume")


# --------------------------------------------------------------------------- input rules


def test_param_group_mixing_buffers_is_refused():
    model, ddp, _ = build(MIXED, "adamw")
    with pytest.raises(ValueError, match="mixes buffers"):
        DistributedOptimizer(ddp, AdamWConfig(lr=0.1), [{"params": list(model.parameters())}])


def test_param_in_no_group_or_two_groups_is_refused():
    model, ddp, _ = build(FP32, "adamw")
    params = list(model.parameters())
    with pytest.raises(ValueError, match="in no param group"):
        DistributedOptimizer(ddp, AdamWConfig(lr=0.1), [{"params": params[:2]}])
    with pytest.raises(ValueError, match="belongs to one group"):
        DistributedOptimizer(ddp, AdamWConfig(lr=0.1), [{"params": params}, {"params": params[:1]}])


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_non_positive_max_norm_is_refused(bad):
    _, ddp, _ = build(FP32, "adamw")
    with pytest.raises(ValueError, match="max_grad_norm must be finite and > 0"):
        DistributedOptimizer(ddp, AdamWConfig(lr=0.1), max_grad_norm=bad)


def test_bad_hyper_parameters_are_refused():
    with pytest.raises(ValueError, match="AdamWConfig.beta1"):
        AdamWConfig(lr=0.1, beta1=1.0)
    with pytest.raises(ValueError, match="SGDConfig.lr"):
        SGDConfig(lr=0.0)
    with pytest.raises(ValueError, match="power of two"):
        DynamicLossScaler(initial_scale=3.0)


def test_checkpoint_name_or_shape_mismatch_is_refused():
    model, ddp, opt = build(FP32, "adamw")
    train_step(model, ddp, opt, 0, 0)
    state = opt.state_dict()
    renamed = {**state, "params": {("x" + k if k == "layer.bias" else k): v for k, v in state["params"].items()}}
    with pytest.raises(ValueError, match="names do not match"):
        opt.load_state_dict(renamed)
    reshaped = {**state, "params": {**state["params"], "layer.bias": {
        k: v.reshape(1, -1) for k, v in state["params"]["layer.bias"].items()}}}
    with pytest.raises(ValueError, match="has shape"):
        opt.load_state_dict(reshaped)
    _, _, sgd = build(FP32, "sgd")
    with pytest.raises(ValueError, match="holds AdamWConfig state"):
        sgd.load_state_dict(state)


def test_step_before_grad_sync_is_refused():
    model, ddp, opt = build(FP32, "adamw")
    with pytest.raises(LifecycleError, match="before the grad sync"):
        opt.step()
    train_step(model, ddp, opt, 0, 0)
    with pytest.raises(LifecycleError, match="before the grad sync"):
        opt.step()  # the same reduced grads must not be applied twice


def test_fp16_needs_a_loss_scaler_and_bf16_refuses_one():
    with pytest.raises(ValueError, match="fp16 grads need a loss_scaler"):
        build(dict.fromkeys(NAMES, torch.float16), "adamw")
    with pytest.raises(ValueError, match="only for fp16"):
        build(MIXED, "adamw", scaler=DynamicLossScaler())


def test_dynamic_loss_scaler_by_hand():
    s = DynamicLossScaler(initial_scale=8.0, min_scale=2.0, growth_interval=2, hysteresis=2)
    s.update(True)
    assert s.scale == 8.0 and s.hysteresis_tracker == 1  # hysteresis absorbs the first inf
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    s.update(True)
    assert s.scale == 2.0  # floor at min_scale
    s.update(False)
    s.update(False)
    assert s.scale == 4.0 and s.hysteresis_tracker == 2  # two clean steps: grow, hysteresis restored


def test_wrong_ddp_config_is_refused():
    model = Model(FP32)
    ddp = DistributedDataParallel(model, config=DDPConfig())
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        DistributedOptimizer(ddp, AdamWConfig(lr=0.1))


# --------------------------------------------------------------------------- exact norm, groups


def test_square_limbs_are_exact_and_partition_independent():
    from fastgrad.optim.norm import limbs_to_fraction, local_square_limbs

    torch.manual_seed(0)
    x = torch.randn(5000) * torch.logspace(-30, 30, 5000)
    x[:4] = torch.tensor([1e-45, -3e38, 2.0**-149, 0.0])  # subnormal, near max, tiny, zero
    exact = sum((Fraction(v) ** 2 for v in x.tolist()), Fraction(0))
    whole, _ = local_square_limbs([x])
    assert limbs_to_fraction(whole) == exact
    for cuts in ([1, 77, 4000], [2500], [13, 14, 15, 4999]):
        parts = torch.tensor_split(x, cuts)
        per_rank = [local_square_limbs([p])[0] for p in parts]
        summed = [sum(limbs) for limbs in zip(*per_rank)]  # what all_reduce(SUM) computes
        assert limbs_to_fraction(summed) == exact


def test_square_limbs_count_nonfinite():
    from fastgrad.optim.norm import local_square_limbs

    _, nonfinite = local_square_limbs([torch.tensor([1.0, math.inf, -math.nan, 2.0])])
    assert nonfinite == 2


def test_groups_without_decay_split_by_buffer_group_and_by_rule():
    model, ddp, opt = build(MIXED, "adamw")
    groups = param_groups_without_decay_for(ddp)
    names = [sorted(ddp.name_of(p) for p in g["params"]) for g in groups]
    assert names == [["embed.weight"], ["norm.weight"], ["layer.weight"], ["layer.bias"]]
    assert [g.get("weight_decay") for g in groups] == [None, 0.0, None, 0.0]
    assert [c.weight_decay for c in opt.groups] == [0.1, 0.0, 0.1, 0.0]

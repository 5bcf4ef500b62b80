"""The model, the rank-specific data and the case matrix of the ``optim`` check.

Shared with the tests (tests/fastgrad/test_optim*.py import from here): a small
model of four params (a 2-D embedding, a 2-D weight, a bias, a norm weight) whose
loss is ``sum(param * coefficient)``, so the grad of every param is its
coefficient, chosen rank- and step-specific as multiples of 1/8 in [-1, 1]:
sums over <= 4 ranks are exact in every dtype, so gloo's reduction order cannot
matter and refgrad's rank-order reduction is also gloo's result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fastgrad.config import DDPConfig
from fastgrad.ddp import DistributedDataParallel
from fastgrad.optim import (
    AdamWConfig,
    DistributedOptimizer,
    DynamicLossScaler,
    SGDConfig,
    param_groups_without_decay_for,
)

NAMES = ("embed.weight", "layer.weight", "layer.bias", "norm.weight")
SHAPES = {"embed.weight": (13, 17), "layer.weight": (9, 11), "layer.bias": (11,), "norm.weight": (11,)}
ADAMW = {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1}
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}
BUCKET_SIZE = 200  # several buckets, params split across bucket and shard boundaries

MIXED = {"embed.weight": torch.bfloat16, "layer.weight": torch.float32,
         "layer.bias": torch.float32, "norm.weight": torch.bfloat16}
FP32 = dict.fromkeys(NAMES, torch.float32)
FP16 = dict.fromkeys(NAMES, torch.float16)
DTYPE_SETS = {"bf16": MIXED, "fp16": FP16, "fp32": FP32}
"""Param dtypes by the name used in labels: "bf16" is bf16 params beside fp32 ones (two
buffer groups, as a model with fp32 biases), "fp16" is fp16 everywhere (loss scaling)."""


def initial(index: int, name: str, seed: int = 0) -> torch.Tensor:
    """Initial values: multiples of 1/16 in [-11/16, 11/16], exact in bf16 and fp16."""
    n = math.prod(SHAPES[name])
    flat = torch.arange(n, dtype=torch.float64)
    return (((flat * 37 + index * 11 + seed) % 23 - 11) / 16).reshape(SHAPES[name])


def coefficient(rank: int, step: int, index: int, name: str, inf_at: tuple | None = None,
                seed: int = 0) -> torch.Tensor:
    """Rank-specific d(loss)/d(param): multiples of 1/8 in [-1, 1] (sums over <= 4 ranks exact).

    ``inf_at = (rank, step, name, element)`` puts one inf into that grad.
    """
    n = math.prod(SHAPES[name])
    flat = torch.arange(n, dtype=torch.float64)
    c = ((flat * 3 + index * 7 + rank * 5 + step * 11 + seed) % 17 - 8) / 8
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
    """Three leaf modules (so overlap_param_gather has several forward pre-hooks)."""

    def __init__(self, dtypes: dict[str, torch.dtype], seed: int = 0) -> None:
        super().__init__()

        def make(name):
            return initial(NAMES.index(name), name, seed).to(dtypes[name])

        self.embed = Leaf("embed", {"weight": make("embed.weight")})
        self.layer = Leaf("layer", {"weight": make("layer.weight"), "bias": make("layer.bias")})
        self.norm = Leaf("norm", {"weight": make("norm.weight")})

    def forward(self, coeffs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.embed(coeffs) + self.layer(coeffs) + self.norm(coeffs)


def build(dtypes, algorithm, *, clip=None, overlap_param_gather=False, average=True,
          scaler=None, grad_fp32=False, dp_group=None, model_parallel_group=None, seed=0,
          optimizer_cls=DistributedOptimizer):
    """Model + DDP (distributed optimizer, several buckets) + ``optimizer_cls``."""
    model = Model(dtypes, seed)
    config = DDPConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET_SIZE,
        overlap_param_gather=overlap_param_gather, grad_reduce_in_fp32=grad_fp32,
    )
    ddp = DistributedDataParallel(model, config=config, average=average, dp_group=dp_group)
    cfg = AdamWConfig(**ADAMW) if algorithm == "adamw" else SGDConfig(**SGD)
    opt = optimizer_cls(
        ddp, cfg, param_groups_without_decay_for(ddp), max_grad_norm=clip, loss_scaler=scaler,
        model_parallel_group=model_parallel_group,
    )
    return model, ddp, opt


def train_step(model, ddp, opt, rank, step, *, loss_scale=1.0, inf_at=None, seed=0):
    """zero, forward, backward (DDP hooks reduce), step; returns the StepResult."""
    ddp.zero_grad_buffer()
    coeffs = {n: coefficient(rank, step, i, n, inf_at, seed).float() * loss_scale
              for i, n in enumerate(NAMES)}
    model(coeffs).backward()
    ddp.finish_grad_sync()
    return opt.step()


def snapshot(model, opt) -> dict:
    """Full params (after the gather) and the optimizer's full state_dict."""
    opt.finish_param_sync()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "state": opt.named_state_dict(),
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a 2- or 4-byte float tensor (for bitwise equality)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


# --------------------------------------------------------------------------- the case matrix

SCALER_INITIAL = 256.0
INF_AT = (1, 1, "layer.weight", 5)  # fp16 cases: rank 1, step 1, one inf element: a skipped step


@dataclass(frozen=True)
class OptimCase:
    """One training run of the check: where, what, and how many steps."""

    ranks: tuple[int, ...]  # global ranks of its DP group (DP = len(ranks))
    algorithm: str  # "adamw" | "sgd"
    grads: str  # "bf16" | "fp16": the 16-bit param/grad dtype (key of DTYPE_SETS)
    main_grads_fp32: bool  # DDPConfig.grad_reduce_in_fp32
    clip: float | None
    overlap: bool  # overlap_param_gather
    steps: int

    def __post_init__(self) -> None:
        if self.algorithm not in ("adamw", "sgd"):
            raise ValueError(f"OptimCase.algorithm must be 'adamw' or 'sgd', got {self.algorithm!r}")
        if self.grads not in ("bf16", "fp16"):
            raise ValueError(f"OptimCase.grads must be 'bf16' or 'fp16', got {self.grads!r}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"OptimCase.clip must be > 0 or None, got {self.clip}")
        if not self.ranks or self.steps < 2:
            raise ValueError("OptimCase needs at least one rank and at least two steps")

    @property
    def dp(self) -> int:
        return len(self.ranks)

    @property
    def dtypes(self) -> dict[str, torch.dtype]:
        return DTYPE_SETS[self.grads]

    @property
    def scaled(self) -> bool:
        """fp16 grads reduced in fp16 need the dynamic loss scaler (and get an inf step)."""
        return self.grads == "fp16" and not self.main_grads_fp32

    @property
    def average(self) -> bool:
        """Average only at power-of-two DP, where torch's 1/DP pre-scale is exact."""
        return self.dp & (self.dp - 1) == 0

    @property
    def label(self) -> str:
        main = "fp32" if self.main_grads_fp32 else self.grads
        return (f"optim DP={self.dp} {self.algorithm} {self.grads}/{main} "
                f"{'clip' if self.clip else 'noclip'} {'overlap' if self.overlap else 'sync'}")

    def scales(self) -> list[float] | None:
        """The loss scale of each step (hysteresis 1: the inf step halves it)."""
        if not self.scaled:
            return None
        out, scale = [], SCALER_INITIAL
        for step in range(self.steps):
            out.append(scale)
            if step == INF_AT[1]:
                scale /= 2
        return out

    def build(self, group, optimizer_cls, seed: int):
        scaler = DynamicLossScaler(initial_scale=SCALER_INITIAL, hysteresis=1) if self.scaled else None
        return build(self.dtypes, self.algorithm, clip=self.clip, overlap_param_gather=self.overlap,
                     average=self.average, scaler=scaler, grad_fp32=self.main_grads_fp32,
                     dp_group=group, seed=seed, optimizer_cls=optimizer_cls)


CHECKPOINT_CASE = OptimCase((0, 1), "adamw", "bf16", False, 0.5, True, 3)
"""Trained without interruption; its checkpoint after step 2 is resumed at DP=2 and DP=3."""


def case_matrix(quick: bool) -> list[OptimCase]:
    """Every dimension at least once (see the package docstring for the pairs covered)."""
    steps = 2 if quick else 3
    cases = [
        OptimCase((3,), "adamw", "bf16", True, 0.5, False, steps),
        CHECKPOINT_CASE,
        OptimCase((2, 3), "sgd", "fp16", False, None, False, steps),
        OptimCase((0, 1, 2), "sgd", "bf16", True, None, True, steps),
        OptimCase((0, 1, 2, 3), "adamw", "fp16", False, 0.5, True, steps),
    ]
    if not quick:
        cases += [
            OptimCase((0, 1, 2), "adamw", "fp16", True, 0.5, False, steps),
            OptimCase((0, 1, 2, 3), "sgd", "bf16", False, 0.5, False, steps),
        ]
    return cases

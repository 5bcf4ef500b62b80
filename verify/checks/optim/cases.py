"""The model, the rank-specific data and the case matrix of the ``optim`` check.

Shared with the tests (tests/fastgrad/test_optim*.py import from here, and wrap the model in
fastgrad themselves: ``tests/fastgrad/optim_model.py``): a small
model of five params (a 2-D embedding, a 2-D weight, a bias, a norm weight, and
``head.weight``, the embedding's tied copy as a pipeline's last stage holds it:
marked ``shared``, so the global norm leaves it out, and given the embedding's
grads, as ``finalize_grads`` leaves both copies) whose loss is
``sum(param * coefficient)``, so the grad of every param is its coefficient,
chosen rank- and step-specific as multiples of 1/8 in [-1, 1]: sums over <= 4
ranks are exact in every dtype, so gloo's reduction order cannot matter and
refgrad's rank-order reduction is also gloo's result.

Each case's learning rate and weight decay change at every update (``SCHEDULES``, as a
training run's do; ``OptimCase.scheduled`` False keeps ``ADAMW`` / ``SGD``'s).

``param_loss`` models make the loss depend on the params the forward reads:
``sum(param * (coefficient + param / 2))``, grad ``coefficient + param / 2`` (one
fp32 rounding, then the param dtype's), so a forward reading a param before its
all-gather arrived computes other grads. Used at DP 2 only, where a sum of two
values has one rounding in any order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from gradvocab import AdamWConfig, Averaging, DDPConfig, LossScaling, SGDConfig
from verify.candidates.interfaces import (
    HyperparameterSchedule,
    OptimizerSettings,
)

NAMES = ("embed.weight", "layer.weight", "layer.bias", "norm.weight", "head.weight")
SHAPES = {"embed.weight": (13, 17), "layer.weight": (9, 11), "layer.bias": (11,), "norm.weight": (11,),
          "head.weight": (13, 17)}
TIED = {"head.weight": "embed.weight"}  # the tied copy -> its original (same values, same grads)
SHARED = tuple(n in TIED for n in NAMES)  # refgrad.optim's ``shared``: left out of the norm
ADAMW = {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.1}
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}
BUCKET_SIZE = 200  # several buckets, params split across bucket and shard boundaries
# Each case's lr and weight decay change at every update, as a training run's do: Megatron-LM's
# linear warm-up (one update from init_lr) then cosine decay to min_lr at update 3, and a weight
# decay rising linearly over 2 updates (updates 0, 1, 2: lr init, max, halfway down; weight decay
# start, halfway, end). ADAMW's / SGD's lr is the peak, their weight decay the end.
SCHEDULES = {
    "adamw": HyperparameterSchedule(max_lr=ADAMW["lr"], min_lr=0.001, init_lr=0.004, warmup_steps=1,
                                    decay_steps=3, decay_style="cosine", start_wd=0.04,
                                    end_wd=ADAMW["weight_decay"], wd_incr_steps=2,
                                    wd_incr_style="linear"),
    "sgd": HyperparameterSchedule(max_lr=SGD["lr"], min_lr=0.005, init_lr=0.02, warmup_steps=1,
                                  decay_steps=3, decay_style="cosine", start_wd=0.002,
                                  end_wd=SGD["weight_decay"], wd_incr_steps=2,
                                  wd_incr_style="linear"),
}

MIXED = {"embed.weight": torch.bfloat16, "layer.weight": torch.float32,
         "layer.bias": torch.float32, "norm.weight": torch.bfloat16, "head.weight": torch.bfloat16}
FP32 = dict.fromkeys(NAMES, torch.float32)
FP16 = dict.fromkeys(NAMES, torch.float16)
DTYPE_SETS = {"bf16": MIXED, "fp16": FP16, "fp32": FP32}
"""Param dtypes by the name used in labels: "bf16" is bf16 params beside fp32 ones (two
buffer groups, as a model with fp32 biases), "fp16" is fp16 everywhere (loss scaling)."""


def initial(index: int, name: str, seed: int = 0) -> torch.Tensor:
    """Initial values: multiples of 1/16 in [-11/16, 11/16], exact in bf16 and fp16
    (a tied copy: its original's)."""
    if name in TIED:
        name = TIED[name]
        index = NAMES.index(name)
    n = math.prod(SHAPES[name])
    flat = torch.arange(n, dtype=torch.float64)
    return (((flat * 37 + index * 11 + seed) % 23 - 11) / 16).reshape(SHAPES[name])


def coefficient(rank: int, step: int, index: int, name: str, inf_at: tuple | None = None,
                seed: int = 0) -> torch.Tensor:
    """Rank-specific d(loss)/d(param): multiples of 1/8 in [-1, 1] (sums over <= 4 ranks exact);
    a tied copy's are its original's.

    ``inf_at = (rank, step, name, element)`` puts one inf into that grad; None for the rank,
    the name or the element: every rank, param or element.
    """
    if name in TIED:
        name = TIED[name]
        index = NAMES.index(name)
    n = math.prod(SHAPES[name])
    flat = torch.arange(n, dtype=torch.float64)
    c = ((flat * 3 + index * 7 + rank * 5 + step * 11 + seed) % 17 - 8) / 8
    if inf_at is not None and inf_at[0] in (None, rank) and inf_at[1] == step and inf_at[2] in (None, name):
        c[slice(None) if inf_at[3] is None else inf_at[3]] = math.inf
    return c.reshape(SHAPES[name])


class Leaf(nn.Module):
    """Owns some params; forward adds ``sum(param * coefficient)`` for each (``param_loss``:
    ``sum(param * (coefficient + param / 2))``). ``probe(leaf)``, when set, runs first: what
    the forward sees (the check records whether a param all-gather is still in flight)."""

    def __init__(self, prefix: str, params: dict[str, torch.Tensor], param_loss: bool = False) -> None:
        super().__init__()
        self.prefix = prefix
        self.param_loss = param_loss
        self.probe = None
        for key, value in params.items():
            self.register_parameter(key, nn.Parameter(value))

    def forward(self, coeffs: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.probe is not None:
            self.probe(self)
        total = torch.zeros(())
        for k, p in self.named_parameters():
            c = coeffs[f"{self.prefix}.{k}"]
            if self.param_loss:  # d/dp = c + p/2: one fp32 rounding (p/2 is exact)
                c = c + p.detach().float() / 2
            total = total + (p.float() * c).sum()
        return total


class Model(nn.Module):
    """Four leaf modules (so overlap_param_gather has several forward pre-hooks); ``head``
    holds the embedding's tied copy, marked ``shared``."""

    def __init__(self, dtypes: dict[str, torch.dtype], seed: int = 0, param_loss: bool = False) -> None:
        super().__init__()

        def make(name):
            return initial(NAMES.index(name), name, seed).to(dtypes[name])

        self.embed = Leaf("embed", {"weight": make("embed.weight")}, param_loss)
        self.layer = Leaf("layer", {"weight": make("layer.weight"), "bias": make("layer.bias")}, param_loss)
        self.norm = Leaf("norm", {"weight": make("norm.weight")}, param_loss)
        self.head = Leaf("head", {"weight": make("head.weight")}, param_loss)
        self.head.weight.shared = True  # fastgrad.optim's (and Megatron-Core's) marker

    def forward(self, coeffs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.embed(coeffs) + self.layer(coeffs) + self.norm(coeffs) + self.head(coeffs)

    def set_probe(self, probe) -> None:
        """Run ``probe(leaf)`` at the start of every leaf's forward (None: stop)."""
        for leaf in (self.embed, self.layer, self.norm, self.head):
            leaf.probe = probe


def optimizer_settings(algorithm: str, *, clip: float | None = None,
                       scaling: LossScaling | None = None, scheduled: bool = False) -> OptimizerSettings:
    """The check's optimizer: AdamW (``ADAMW``) or SGD (``SGD``), weight decay on 2-D params only
    (biases and norm weights take none), the clip and the loss scaler; ``scheduled``: the lr and
    weight decay of each update from the algorithm's schedule (``SCHEDULES``)."""
    if algorithm not in ("adamw", "sgd"):
        raise ValueError(f"algorithm must be 'adamw' or 'sgd', got {algorithm!r}")
    return OptimizerSettings(adamw=AdamWConfig(**ADAMW), max_grad_norm=clip,
                             loss_scaling=scaling, decay_1d_params=False,
                             sgd=SGDConfig(**SGD) if algorithm == "sgd" else None,
                             schedule=SCHEDULES[algorithm] if scheduled else None)


def loss_scaling(hysteresis: int) -> LossScaling:
    """The fp16 cases' dynamic loss scaler (Megatron-Core's defaults but the initial scale)."""
    return LossScaling(initial_scale=SCALER_INITIAL, min_scale=1.0, growth_interval=1000,
                       hysteresis=hysteresis)


def coefficients(rank: int, step: int, inf_at=None, seed: int = 0, loss_scale: float = 1.0):
    """The model's input: every param's (scaled) coefficient, fp32."""
    return {n: coefficient(rank, step, i, n, inf_at, seed).float() * loss_scale for i, n in enumerate(NAMES)}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a 2- or 4-byte float tensor (for bitwise equality)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


# --------------------------------------------------------------------------- the case matrix

SCALER_INITIAL = 256.0
INF_AT = (1, 1, "layer.weight", 5)  # rank 1 only, step 1, one inf element: a skipped step
INF_EVERYWHERE = (None, 1, None, None)  # every element of every grad on every rank: every shard


def averaging_at(dp: int) -> Averaging:
    """Average (Megatron-Core's default 1/DP pre-scale) only at power-of-two DP, where that
    pre-scale is exact; otherwise sum (the grads are then exact sums, see ``coefficient``)."""
    return Averaging.PRESCALE if dp & (dp - 1) == 0 else Averaging.SUM


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
    hysteresis: int = 1  # the loss scaler's (fp16 cases)
    param_loss: bool = False  # the loss depends on the params (DP 2 only: see the module doc)
    scheduled: bool = True  # lr and weight decay from SCHEDULES[algorithm], changing every update

    def __post_init__(self) -> None:
        if self.algorithm not in ("adamw", "sgd"):
            raise ValueError(f"OptimCase.algorithm must be 'adamw' or 'sgd', got {self.algorithm!r}")
        if self.grads not in ("bf16", "fp16"):
            raise ValueError(f"OptimCase.grads must be 'bf16' or 'fp16', got {self.grads!r}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"OptimCase.clip must be > 0 or None, got {self.clip}")
        if not self.ranks or self.steps < 2:
            raise ValueError("OptimCase needs at least one rank and at least two steps")
        if self.param_loss and self.scaled:
            raise ValueError("OptimCase.param_loss runs without loss scaling (bf16 or fp32 main grads)")
        if self.param_loss and self.dp > 2:
            raise ValueError("OptimCase.param_loss needs DP <= 2 (a sum of two values rounds once in "
                             "any order; at DP > 2 gloo's order would differ from refgrad's)")

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
    def averaging(self) -> Averaging:
        """How this case's DP reduction averages (:func:`averaging_at` its DP)."""
        return averaging_at(self.dp)

    @property
    def label(self) -> str:
        main = "fp32" if self.main_grads_fp32 else self.grads
        extra = (" param-loss" if self.param_loss else "") + ("" if self.scheduled else " constant-lr")
        return (f"optim DP={self.dp} {self.algorithm} {self.grads}/{main} "
                f"{'clip' if self.clip else 'noclip'} {'overlap' if self.overlap else 'sync'}{extra}")

    @property
    def inf_at(self) -> tuple | None:
        """Scaled cases put infs into step 1's grads. With overlap_param_gather one element on
        one rank: after the reduce-scatter one rank's shard holds it, so a skip decided per rank
        shows as ranks that disagree (the check pairs the stepping ranks' gathers with the
        others' ``publish_params()`` and compares the numbers). Synchronously, every element on
        every rank, so every shard holds one: a per-rank decision there would leave a rank
        blocked in its gather (a crash, not a comparison), so that case does not test it."""
        if not self.scaled:
            return None
        return INF_AT if self.overlap else INF_EVERYWHERE

    def scaler_states(self) -> list[dict[str, float]] | None:
        """After each step, Megatron-Core's DynamicGradScaler state (grad_scaler.py, ``update``),
        derived by hand for one inf at step ``INF_AT[1]`` and growth_interval 1000 (never
        reached here): the inf zeroes the growth tracker and takes one from the hysteresis
        tracker; the scale halves when that reaches 0 (hysteresis 1), not before (2)."""
        if not self.scaled:
            return None
        out, scale, growth, hysteresis = [], SCALER_INITIAL, 0, self.hysteresis
        for step in range(self.steps):
            if step == INF_AT[1]:
                growth, hysteresis = 0, hysteresis - 1
                scale = scale / 2 if hysteresis <= 0 else scale
            else:
                growth += 1
            out.append({"scale": scale, "growth_tracker": growth, "hysteresis_tracker": hysteresis})
        return out

    def scales(self) -> list[float] | None:
        """The loss scale each step uses (the state after the step before)."""
        states = self.scaler_states()
        if states is None:
            return None
        return [SCALER_INITIAL] + [s["scale"] for s in states[:-1]]

    def ddp_config(self) -> DDPConfig:
        """The DDP the case's model is wrapped in (several buckets, distributed optimizer,
        grads reduced per bucket as the backward produces them); :attr:`averaging` goes beside it."""
        return DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                         bucket_size=BUCKET_SIZE, overlap_param_gather=self.overlap,
                         grad_reduce_in_fp32=self.main_grads_fp32)

    @property
    def schedule(self) -> HyperparameterSchedule | None:
        """Each update's lr and weight decay (None: ``ADAMW`` / ``SGD``'s, constant)."""
        return SCHEDULES[self.algorithm] if self.scheduled else None

    def optimizer_settings(self) -> OptimizerSettings:
        return optimizer_settings(self.algorithm, clip=self.clip,
                                  scaling=loss_scaling(self.hysteresis) if self.scaled else None,
                                  scheduled=self.scheduled)

    def model(self, seed: int) -> Model:
        return Model(self.dtypes, seed, self.param_loss)


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
        OptimCase((0, 1, 2, 3), "adamw", "fp16", False, 0.5, True, steps, hysteresis=2),
        OptimCase((2, 3), "adamw", "bf16", True, 0.5, True, steps, param_loss=True),
    ]
    if not quick:
        cases += [
            OptimCase((0, 1, 2), "adamw", "fp16", True, 0.5, False, steps),
            # the one case whose lr and weight decay stay as given (no schedule)
            OptimCase((0, 1, 2, 3), "sgd", "bf16", False, 0.5, False, steps, scheduled=False),
        ]
    return cases

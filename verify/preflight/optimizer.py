"""The optimizer a launch builds (``--optimizer adam`` or ``sgd``), read and checked as
Megatron-LM core_r0.19.0 does.

:class:`OptimizerChoice` holds the settings (:func:`verify.preflight.resolve.resolve` reads
them; ``--lr`` and ``--min-lr`` for every optimizer, as validate_args compares them whatever
the optimizer; ``--weight-decay`` and ``--sgd-momentum`` only under ``--optimizer sgd``, whose
build reads them), and the rules below are the ones Megatron-LM
meets on them, each citing its source (megatron-core 0.19.2):

- validate_args (``megatron/training/arguments.py:1319-1320``): ``--min-lr <= --lr`` (every
  optimizer);
- the optimizer's build (``megatron/core/optimizer/__init__.py:617-623``): SGD is the torch
  class (``torch.optim.SGD`` without Transformer Engine or apex, their ``FusedSGD`` with
  them), built with ``lr=config.lr, weight_decay=config.weight_decay,
  momentum=config.sgd_momentum``; every one of them raises on a negative lr, momentum or
  weight decay, and compares ``lr < 0.0``, a TypeError on a missing ``--lr``;
- the distributed optimizer (``megatron/core/optimizer/distrib_optimizer.py:688-694``): it
  asserts Adam (or the CPU-offloaded hybrid, or an optimizer with an ``init_state_fn``,
  which SGD is built without), so SGD with ``--use-distributed-optimizer`` stops there.

The state each optimizer keeps per element (:attr:`OptimizerChoice.state_tensors`) is what
the paper's optimizer memory counts (:func:`verify.preflight.paper.optimizer_state_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from verify.preflight.flags import Refusal

OPTIMIZERS = ("adam", "sgd")  # the values of --optimizer preflight models
# megatron/training/arguments.py defaults: --sgd-momentum (:2516), --weight-decay (:2501),
# --min-lr (:2854); --lr (:2847) has none.
DEFAULT_SGD_MOMENTUM = 0.9
DEFAULT_WEIGHT_DECAY = 0.01
DEFAULT_MIN_LR = 0.0
# fp32 tensors per element of the params it steps: Adam's two moments (the init_state_fn of
# core/optimizer/__init__.py:588-596, zeros_like the fp32 main params); SGD's momentum
# buffer (see OptimizerChoice.state_tensors).
STATE_TENSORS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


@dataclass(frozen=True)
class OptimizerChoice:
    """``--optimizer``, ``--lr`` / ``--min-lr`` (``lr`` None: not given) and, for SGD, the
    other values its build reads."""

    name: str = "adam"
    lr: float | None = None
    min_lr: float = DEFAULT_MIN_LR
    weight_decay: float = DEFAULT_WEIGHT_DECAY
    sgd_momentum: float = DEFAULT_SGD_MOMENTUM

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"OptimizerChoice.name must be one of {OPTIMIZERS}, got {self.name!r}")
        for field in ("lr", "min_lr", "weight_decay", "sgd_momentum"):
            value = getattr(self, field)
            if value is None and field == "lr":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"OptimizerChoice.{field} must be a number, got "
                                f"{type(value).__name__}")

    @property
    def state_tensors(self) -> tuple[str, ...]:
        """The fp32 state tensors, each the size of the params it steps. SGD's momentum
        buffer at every momentum: Transformer Engine's (and apex's) ``FusedSGD``, which
        Megatron-Core imports first (core/optimizer/__init__.py:13-21), allocates it for
        every param at its first step (``get_momentums``: ``torch.zeros_like``), momentum 0
        included; ``torch.optim.SGD``, used without them, only when momentum != 0
        (:attr:`state_tensors_torch`)."""
        return STATE_TENSORS[self.name]

    @property
    def state_tensors_torch(self) -> tuple[str, ...]:
        """The same without Transformer Engine or apex: ``torch.optim.SGD`` keeps a momentum
        buffer only when momentum != 0 (torch/optim/sgd.py ``_init_group`` and ``step``:
        ``if group["momentum"] != 0``)."""
        if self.name == "sgd" and self.sgd_momentum == 0:
            return ()
        return STATE_TENSORS[self.name]

    def to_dict(self) -> dict:
        """JSON-ready; Adam's: the name, lr and min_lr (the SGD-only values are not read)."""
        if self.name == "adam":
            return {"optimizer": "adam", "lr": self.lr, "min_lr": self.min_lr,
                    "state_tensors": list(self.state_tensors)}
        return {"optimizer": self.name} | {k: v for k, v in asdict(self).items() if k != "name"} | {
            "state_tensors": list(self.state_tensors),
            "state_tensors_torch_sgd": list(self.state_tensors_torch)}


Name = Callable[[str], str]


def learning_rate_refusals(choice: OptimizerChoice, name: Name) -> Iterator[Refusal]:
    """validate_args:1319-1320: ``if args.lr is not None: assert args.min_lr <= args.lr``,
    whatever the optimizer."""
    if choice.lr is not None and not choice.min_lr <= choice.lr:
        yield Refusal(f"{name('min_lr')} ({choice.min_lr:g}) must be <= {name('lr')} "
                      f"({choice.lr:g}) (validate_args: assert args.min_lr <= args.lr)",
                      "validate_args", 1320)


def optimizer_build_refusals(choice: OptimizerChoice, name: Name) -> Iterator[Refusal]:
    """The SGD constructor's checks (torch.optim.SGD and Transformer Engine's / apex's
    FusedSGD alike: lr, then momentum, then weight decay; the first stops the build)."""
    if choice.name != "sgd":
        return
    where = ("(megatron/core/optimizer/__init__.py:618 builds SGD(lr=--lr, ...); torch's and "
             "Transformer Engine's SGD raise on it)")
    if choice.lr is None:
        yield Refusal(f"--optimizer sgd needs {name('lr')}: the SGD constructor compares "
                      f"lr < 0.0, a TypeError on None {where}", "optimizer")
    elif not choice.lr >= 0 and not math.isnan(choice.lr):
        yield Refusal(f"{name('lr')} must be >= 0 for --optimizer sgd ('Invalid learning "
                      f"rate: {choice.lr:g}') {where}", "optimizer")
    if choice.sgd_momentum < 0:
        yield Refusal(f"{name('sgd_momentum')} must be >= 0 ('Invalid momentum value: "
                      f"{choice.sgd_momentum:g}') {where}", "optimizer")
    if choice.weight_decay < 0:
        yield Refusal(f"{name('weight_decay')} must be >= 0 for --optimizer sgd ('Invalid "
                      f"weight_decay value: {choice.weight_decay:g}') {where}", "optimizer")


def distributed_optimizer_refusals(choice: OptimizerChoice, use_distributed_optimizer: bool,
                                   name: Name, megatron_fsdp: bool = False) -> Iterator[Refusal]:
    """distrib_optimizer.py:688-694: DistributedOptimizer.__init__ asserts Adam, torch's
    AdamW, the hybrid CPU-offloaded optimizer or an ``init_state_fn`` (SGD has none:
    core/optimizer/__init__.py:624). ``megatron_fsdp``: the distributed optimizer is on
    because ``--use-megatron-fsdp`` turned it on (validate_args:1112), whatever the user gave."""
    if choice.name == "sgd" and use_distributed_optimizer:
        what = (f"Megatron-FSDP's distributed optimizer (turned on by "
                f"{name('use_megatron_fsdp')}, validate_args:1112)" if megatron_fsdp
                else name("use_distributed_optimizer"))
        yield Refusal(f"--optimizer sgd cannot be used with {what}: "
                      "Megatron-Core's DistributedOptimizer asserts 'Only Adam, "
                      "HybridDeviceOptimizer, and optimizers with an init_state_fn (e.g., Lion) "
                      "are currently supported' (megatron/core/optimizer/distrib_optimizer.py:"
                      "688-694; SGD is built without an init_state_fn)", "optimizer")

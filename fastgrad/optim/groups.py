"""Param groups in ``torch.optim``'s shape: dicts of hyper-parameters that every step reads.

``DistributedOptimizer.param_groups`` is a list of dicts as torch's optimizers
keep them -- ``{"params": [...], "lr", "betas", "eps", "weight_decay"}`` for
AdamW, ``{"params": [...], "lr", "momentum", "weight_decay"}`` for SGD -- so
torch's LR schedulers (and anyone else) can change them between steps. Each
step turns every group into a validated :class:`AdamWConfig` / :class:`SGDConfig`
(:class:`GroupConfigs`, cached while the values stay the same): a bad value
set by hand or by a scheduler is a ``ValueError`` naming ``param_groups[i]``.

Keys torch's optimizers have but fastgrad's step does not implement
(``amsgrad``, ``maximize``, ``nesterov``, ``dampening``) are refused unless
they hold torch's default, so that nothing asked for is silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fastgrad.optim.config import OptimizerConfig
from gradvocab import AdamWConfig, SGDConfig

UNSUPPORTED_DEFAULTS = {"amsgrad": False, "maximize": False, "nesterov": False, "dampening": 0}
# Keys torch's LR schedulers keep in the groups (LambdaLR ... OneCycleLR): carried, not read.
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"})


def default_no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and norm weights (1-D params) get no weight decay, as Megatron-Core's default."""
    return param.ndim <= 1 or name.endswith(".bias")


def param_groups_without_decay_for(
    ddp: Any,
    skip: Callable[[str, torch.Tensor], bool] = default_no_decay,
) -> list[dict[str, Any]]:
    """Param groups: per buffer group, the decayed params and (``weight_decay=0``) the skipped ones."""
    groups: list[dict[str, Any]] = []
    for buffer_group in ddp.buffer.groups:
        decay = [p for p in buffer_group.params if not skip(ddp.name_of(p), p)]
        no_decay = [p for p in buffer_group.params if skip(ddp.name_of(p), p)]
        if decay:
            groups.append({"params": decay})
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def hyper_keys(config: OptimizerConfig) -> tuple[str, ...]:
    """The torch group keys of ``config``'s algorithm."""
    return ("lr", "betas", "eps", "weight_decay") if isinstance(config, AdamWConfig) else (
        "lr", "momentum", "weight_decay")


def torch_hyper(config: OptimizerConfig) -> dict[str, Any]:
    """``config`` as torch's group keys (AdamW's ``beta1, beta2`` as ``betas``)."""
    if isinstance(config, AdamWConfig):
        return {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps,
                "weight_decay": config.weight_decay}
    return {"lr": config.lr, "momentum": config.momentum, "weight_decay": config.weight_decay}


def group_overrides(index: int, spec: Mapping[str, Any], config: OptimizerConfig) -> dict[str, Any]:
    """A user's group's hyper-parameters as torch keys (``beta1``/``beta2`` become ``betas``).

    Unknown keys are refused (a misspelt ``weight_decay`` would otherwise be ignored);
    torch's unsupported options must hold torch's default; scheduler keys are carried.
    """
    fields = {f.name for f in dataclasses.fields(config)}
    allowed = set(hyper_keys(config)) | fields | SCHEDULER_KEYS | set(UNSUPPORTED_DEFAULTS)
    out: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "params":
            continue
        if key not in allowed:
            raise ValueError(
                f"param_groups[{index}]: unknown hyper-parameter {key!r} for "
                f"{type(config).__name__} (known: {sorted(set(hyper_keys(config)) | fields)})"
            )
        out[key] = value
    if "beta1" in out or "beta2" in out:
        if "betas" in out:
            raise ValueError(f"param_groups[{index}]: give either 'betas' or 'beta1'/'beta2'")
        betas = (out.pop("beta1", getattr(config, "beta1", None)),
                 out.pop("beta2", getattr(config, "beta2", None)))
        out["betas"] = betas
    return out


def config_of(index: int, group: Mapping[str, Any], kind: type) -> OptimizerConfig:
    """A group dict as a validated config; errors name ``param_groups[index]``."""
    for key, default in UNSUPPORTED_DEFAULTS.items():
        if group.get(key, default) != default:
            raise ValueError(
                f"param_groups[{index}][{key!r}] = {group[key]!r}: fastgrad's {kind.__name__[:-6]} "
                f"does not implement it (only {key}={default!r}, torch's default)"
            )
    try:
        if kind is AdamWConfig:
            betas = group["betas"]
            if not isinstance(betas, Sequence) or len(betas) != 2:
                raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
            return AdamWConfig(lr=_number(group["lr"]), beta1=_number(betas[0]),
                               beta2=_number(betas[1]), eps=_number(group["eps"]),
                               weight_decay=_number(group["weight_decay"]))
        return SGDConfig(lr=_number(group["lr"]), momentum=_number(group["momentum"]),
                         weight_decay=_number(group["weight_decay"]))
    except KeyError as missing:
        raise ValueError(f"param_groups[{index}] lost its {missing} entry") from None
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"param_groups[{index}]: {exc}") from None


def _number(value: Any) -> Any:
    """A one-element tensor (torch allows a tensor lr) as a Python float; anything else as is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return value


class GroupConfigs:
    """Per group, the config of its current values (rebuilt only when they change)."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.keys = ("lr", "betas", "eps", "weight_decay") if kind is AdamWConfig else (
            "lr", "momentum", "weight_decay")
        self._cache: list[tuple[tuple, OptimizerConfig] | None] = []

    def configs(self, param_groups: Sequence[Mapping[str, Any]]) -> list[OptimizerConfig]:
        """The validated config of every group, as the groups hold them now."""
        if len(self._cache) != len(param_groups):
            self._cache = [None] * len(param_groups)
        out = []
        for index, group in enumerate(param_groups):
            values = tuple(_hashable(group.get(key)) for key in self.keys) + tuple(
                group.get(key, default) for key, default in UNSUPPORTED_DEFAULTS.items())
            cached = self._cache[index]
            if cached is None or cached[0] != values:
                cached = (values, config_of(index, group, self.kind))
                self._cache[index] = cached
            out.append(cached[1])
        return out


def _hashable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 else id(value)
    if isinstance(value, list):
        return tuple(value)
    return value

"""Checkpoints of ``fastgrad.optim.DistributedOptimizer``: full, unpadded, by parameter name.

``state_dict()`` all-gathers every bucket's master and state shards (a
collective: every rank calls it) and keeps, per parameter name, full tensors
in the parameter's shape: no padding, no trace of the DP size that wrote it.
``load_state_dict`` takes this rank's slice of each, so a checkpoint written
at one DP size loads at any other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fastgrad.comm import all_gather_into

FORMAT = "fastgrad.optim/1"


class CheckpointMixin:
    """``state_dict``/``load_state_dict`` for the distributed optimizer (see the module doc)."""

    def _gather_full(self, shard: Any, compact: torch.Tensor) -> torch.Tensor:
        """The bucket-sized fp32 tensor holding every rank's values of ``compact`` (padding 0)."""
        bucket = shard.bucket
        local = torch.zeros(bucket.shard_numel, dtype=torch.float32, device=compact.device)
        shard_lo = bucket.shard_range(bucket.dp_rank)[0]
        for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
            a, b = piece.buffer_range
            local[a - shard_lo : b - shard_lo] = compact[lo:hi]
        if bucket.dp_size == 1:
            return local
        full = torch.zeros(bucket.numel, dtype=torch.float32, device=compact.device)
        all_gather_into(full, local, group=bucket.dp_group)
        return full

    def state_dict(self) -> dict[str, Any]:
        """Full fp32 masters and optimizer state per param name, hyper-parameters, step counts."""
        self.finish_param_sync()
        params: dict[str, dict[str, torch.Tensor]] = {}
        for shard in self.shards:
            bucket = shard.bucket
            fulls = {"master": self._gather_full(shard, shard.master)}
            for key, tensor in shard.state.items():
                fulls[key] = self._gather_full(shard, tensor)
            for p in bucket.params:
                start, end = bucket.param_to_index[p]
                params[self.name_of(p)] = {
                    key: full[start:end].reshape(p.shape).clone() for key, full in fulls.items()
                }
        return {
            "format": FORMAT,
            "algorithm": type(self.config).__name__,
            "params": params,
            "param_groups": [
                {"names": [self.name_of(p) for p in members], "hyper": dataclasses.asdict(cfg), "step": step}
                for members, cfg, step in zip(self.group_params, self.groups, self.steps)
            ],
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
        }

    def _validate(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"checkpoint is not a {FORMAT} optimizer state_dict")
        if state["algorithm"] != type(self.config).__name__:
            raise ValueError(
                f"checkpoint holds {state['algorithm']} state; this optimizer is {type(self.config).__name__}"
            )
        expected = {self.name_of(p): p for s in self.shards for p in s.bucket.params}
        saved = state["params"]
        missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint param names do not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        keys = {"master", *self.shards[0].state} if self.shards else {"master"}
        for name, p in expected.items():
            if set(saved[name]) != keys:
                raise ValueError(f"checkpoint entry {name!r} holds {sorted(saved[name])}, expected {sorted(keys)}")
            for key, tensor in saved[name].items():
                if tuple(tensor.shape) != tuple(p.shape):
                    raise ValueError(
                        f"checkpoint {name!r}[{key!r}] has shape {tuple(tensor.shape)}, the "
                        f"parameter has {tuple(p.shape)}"
                    )
        groups = state["param_groups"]
        names = [[self.name_of(p) for p in members] for members in self.group_params]
        if [g["names"] for g in groups] != names:
            raise ValueError("checkpoint param groups (their param names, in order) do not match this optimizer's")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's slice of every full tensor; re-publish the params from the masters."""
        self.finish_param_sync()
        self._validate(state)
        saved = state["params"]
        for shard in self.shards:
            for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
                entry = saved[self.name_of(piece.param)]
                a, b = piece.param_offset
                shard.master[lo:hi] = entry["master"].reshape(-1)[a:b].to(shard.master)
                for key, tensor in shard.state.items():
                    tensor[lo:hi] = entry[key].reshape(-1)[a:b].to(tensor)
        self.groups = [type(self.config)(**g["hyper"]) for g in state["param_groups"]]
        self.steps = [int(g["step"]) for g in state["param_groups"]]
        if (state["loss_scaler"] is None) != (self.loss_scaler is None):
            raise ValueError("checkpoint and optimizer disagree on having a loss scaler")
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self._publish_all()
        self.finish_param_sync()

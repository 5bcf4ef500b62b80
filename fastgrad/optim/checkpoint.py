"""Checkpoints of ``fastgrad.optim.DistributedOptimizer``: full, unpadded, any DP size.

Both formats all-gather every bucket's master and state shards (a collective:
every rank calls them) and keep full tensors in each parameter's shape: no
padding, no trace of the DP size that wrote them. Loading takes this rank's
slice of each, so a checkpoint written at one DP size loads at any other.

* :meth:`CheckpointMixin.state_dict` is ``torch.optim.Optimizer``'s shape:
  ``{"state": {index: {"step", "master", "exp_avg", "exp_avg_sq"}` (or
  ``"momentum_buffer"``) ``}, "param_groups": [{..., "params": [indices]}]}``,
  indices numbering the params group after group as torch does, every key of
  each group kept (an LR scheduler's ``initial_lr`` included); plus a
  ``"fastgrad"`` entry (format, algorithm, the param names by index, the loss
  scaler) that :meth:`CheckpointMixin.load_state_dict` checks.
* :meth:`CheckpointMixin.named_state_dict` is keyed by parameter *name*
  (``FORMAT``): robust to a model whose param order changed.

``load_state_dict`` takes either.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fastgrad.comm import all_gather_into
from fastgrad.optim.groups import GroupConfigs, torch_hyper

FORMAT = "fastgrad.optim/1"
TORCH_FORMAT = "fastgrad.optim.torch/1"


class CheckpointMixin:
    """``state_dict``/``load_state_dict`` (torch's shape) and their by-name twins."""

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

    def _full_tensors(self) -> dict[Any, dict[str, torch.Tensor]]:
        """Per param: its full fp32 master and state tensors in its shape (a collective)."""
        self.finish_param_sync()
        out: dict[Any, dict[str, torch.Tensor]] = {}
        for shard in self.shards:
            bucket = shard.bucket
            fulls = {"master": self._gather_full(shard, shard.master)}
            for key, tensor in shard.state.items():
                fulls[key] = self._gather_full(shard, tensor)
            for p in bucket.params:
                start, end = bucket.param_to_index[p]
                out[p] = {key: full[start:end].reshape(p.shape).clone() for key, full in fulls.items()}
        return out

    def _state_keys(self) -> set[str]:
        return {"master", *self.shards[0].state} if self.shards else {"master"}

    # -- by name
    def named_state_dict(self) -> dict[str, Any]:
        """Full fp32 masters and optimizer state per param name, hyper-parameters, step counts."""
        fulls = self._full_tensors()
        return {
            "format": FORMAT,
            "algorithm": type(self.config).__name__,
            "params": {self.name_of(p): entry for p, entry in fulls.items()},
            "param_groups": [
                {"names": [self.name_of(p) for p in members], "hyper": dataclasses.asdict(cfg), "step": step}
                for members, cfg, step in zip(self.group_params, self.groups, self.steps)
            ],
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
        }

    def _validate_named(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"checkpoint is not a {FORMAT} optimizer state_dict")
        self._check_algorithm(state["algorithm"])
        expected = {self.name_of(p): p for s in self.shards for p in s.bucket.params}
        saved = state["params"]
        missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint param names do not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        for name, p in expected.items():
            self._check_entry(name, p, saved[name])
        names = [[self.name_of(p) for p in members] for members in self.group_params]
        if [g["names"] for g in state["param_groups"]] != names:
            raise ValueError("checkpoint param groups (their param names, in order) do not match this optimizer's")

    def _check_algorithm(self, algorithm: str) -> None:
        if algorithm != type(self.config).__name__:
            raise ValueError(
                f"checkpoint holds {algorithm} state; this optimizer is {type(self.config).__name__}"
            )

    def _check_entry(self, name: str, p: Any, entry: dict[str, torch.Tensor]) -> None:
        keys = self._state_keys()
        if set(entry) - {"step"} != keys:
            raise ValueError(f"checkpoint entry {name!r} holds {sorted(entry)}, expected {sorted(keys)}")
        for key in keys:
            if tuple(entry[key].shape) != tuple(p.shape):
                raise ValueError(
                    f"checkpoint {name!r}[{key!r}] has shape {tuple(entry[key].shape)}, the "
                    f"parameter has {tuple(p.shape)}"
                )

    def load_named_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`named_state_dict` (any DP size); re-publish the params from the masters."""
        self.finish_param_sync()
        self._validate_named(state)
        kind = type(self.config)
        values = [torch_hyper(kind(**g["hyper"])) for g in state["param_groups"]]
        steps = [int(g["step"]) for g in state["param_groups"]]
        self._load(state["params"], values, steps, state["loss_scaler"])

    # -- torch's shape
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer``'s shape, full tensors (a collective; see the module doc)."""
        fulls = self._full_tensors()
        order = [p for members in self.group_params for p in members]
        index = {p: i for i, p in enumerate(order)}
        step_of = {p: step for members, step in zip(self.group_params, self.steps) for p in members}
        return {
            "state": {index[p]: {"step": torch.tensor(float(step_of[p])), **fulls[p]} for p in order},
            "param_groups": [
                {**{k: v for k, v in group.items() if k != "params"},
                 "params": [index[p] for p in group["params"]]}
                for group in self.param_groups
            ],
            "fastgrad": {
                "format": TORCH_FORMAT,
                "algorithm": type(self.config).__name__,
                "names": [self.name_of(p) for p in order],
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (torch's shape) or a :meth:`named_state_dict`, written at any
        DP size; re-publish the params from the masters."""
        if isinstance(state_dict, dict) and state_dict.get("format") == FORMAT:
            self.load_named_state_dict(state_dict)
            return
        self.finish_param_sync()
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError("checkpoint is not an optimizer state_dict (no 'state' and 'param_groups')")
        extra = state_dict.get("fastgrad") or {}
        if extra.get("format", TORCH_FORMAT) != TORCH_FORMAT:
            raise ValueError(f"checkpoint format {extra.get('format')!r} is not {TORCH_FORMAT}")
        if "algorithm" in extra:
            self._check_algorithm(extra["algorithm"])
        saved_groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in saved_groups]
        if sizes != [len(members) for members in self.group_params]:
            raise ValueError(
                f"checkpoint has param groups of {sizes} params; this optimizer's have "
                f"{[len(members) for members in self.group_params]}"
            )
        order = [p for members in self.group_params for p in members]
        names = extra.get("names")
        if names is not None and names != [self.name_of(p) for p in order]:
            first = next(i for i, (a, p) in enumerate(zip(names, order)) if a != self.name_of(p))
            raise ValueError(
                f"checkpoint param {first} is {names[first]!r}, this optimizer's is "
                f"{self.name_of(order[first])!r} (the param order changed: load a named_state_dict)"
            )
        entries, steps = {}, []
        for group in saved_groups:
            indices = group["params"]
            steps.append(int(state_dict["state"][indices[0]]["step"]))
            for i in indices:
                entries[self.name_of(order[i])] = state_dict["state"][i]
        for p in order:
            self._check_entry(self.name_of(p), p, entries[self.name_of(p)])
        values = [{k: v for k, v in g.items() if k != "params"} for g in saved_groups]
        self._load(entries, values, steps, extra.get("loss_scaler"), check_scaler="loss_scaler" in extra)

    def _load(self, entries: dict[str, dict[str, torch.Tensor]], group_values: list[dict[str, Any]],
              steps: list[int], scaler_state: Any, check_scaler: bool = True) -> None:
        """This rank's slice of every full tensor, the groups' values and steps; re-publish."""
        if check_scaler and (scaler_state is None) != (self.loss_scaler is None):
            raise ValueError("checkpoint and optimizer disagree on having a loss scaler")
        merged = [{**group, **values} for group, values in zip(self.param_groups, group_values)]
        GroupConfigs(type(self.config)).configs(merged)  # refuse bad values before changing anything
        for shard in self.shards:
            for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
                entry = entries[self.name_of(piece.param)]
                a, b = piece.param_offset
                shard.master[lo:hi] = entry["master"].reshape(-1)[a:b].to(shard.master)
                for key, tensor in shard.state.items():
                    tensor[lo:hi] = entry[key].reshape(-1)[a:b].to(tensor)
        for group, values in zip(self.param_groups, group_values):
            group.update(values)
        self.steps = list(steps)
        if self.loss_scaler is not None and scaler_state is not None:
            self.loss_scaler.load_state_dict(scaler_state)
        self._publish_all()
        self.finish_param_sync()
        self._params_published()

"""What the optimizer checks so that a torch habit never trains wrong in silence.

* :func:`check_model_parallel_group` (construction): the grad norm and the
  NaN/inf flag are summed over the data-parallel group, then over
  ``model_parallel_group``. A model-parallel group holding a second rank of the
  DP group (``dist.group.WORLD`` in a DP-only job) counts that rank's shard
  twice: a norm too large by ``sqrt(k)`` and a step that over-clips. Refused.
* :class:`ParamVersions` (every step): params written outside the optimizer since
  its last publication (``ddp.load_state_dict`` after building the optimizer,
  ``param.copy_`` under ``torch.no_grad()``) would be overwritten by the fp32
  masters at the next step. As with a torch optimizer, the params are the truth:
  the changed elements become the masters' values (the optimizer state stays).
  Detection reads each param's autograd version counter (no pass over the data);
  only a param whose counter moved is compared with its master, element by element.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastgrad.optim.publication import bits


def _ranks(group: Any) -> list[int]:
    return sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def check_model_parallel_group(model_parallel_group: Any, buffer: Any) -> None:
    """ValueError when ``model_parallel_group`` shares a rank other than this one with the DP group."""
    if model_parallel_group is None or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_rank(model_parallel_group) < 0:
        raise ValueError(
            f"model_parallel_group does not contain this process (global rank {dist.get_rank()}): "
            "pass the model-parallel (pipeline / tensor-parallel) group this rank belongs to"
        )
    dp = _ranks(buffer.dp_group) if buffer.distributed else [dist.get_rank()]
    mp = _ranks(model_parallel_group)
    shared = sorted(set(dp) & set(mp))
    if len(shared) > 1:
        raise ValueError(
            f"model_parallel_group (ranks {mp}) shares ranks {shared} with the data-parallel group "
            f"(ranks {dp}): the grad norm is summed over both, so each of those ranks' gradients "
            f"would be counted {len(shared)} times (a norm sqrt({len(shared)}) too large, and a "
            "step that over-clips). Pass the group of the ranks holding the *other* parts of the "
            "model (the pipeline or tensor-parallel group), or None in a data-parallel-only job"
        )


class ParamVersions:
    """The params' version counters at the last publication; re-syncs masters from params
    written since (see the module docstring)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._params = list(params)
        self._versions: list[int] = []
        self.record()

    def record(self) -> None:
        """The params hold what the masters say (after a publish, a load, construction)."""
        self._versions = [p._version for p in self._params]

    def changed(self) -> set[torch.Tensor]:
        """Params whose version counter moved since :meth:`record`."""
        return {p for p, v in zip(self._params, self._versions) if p._version != v}


def resync_masters(shards: Sequence[Any], changed: set[torch.Tensor]) -> set[torch.Tensor]:
    """Copy into the masters every element of a ``changed`` param that no longer equals its
    master's rounding to the param dtype; return the params that had such elements."""
    synced = set()
    for shard in shards:
        for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
            param = piece.param
            if param not in changed:
                continue
            a, b = piece.param_offset
            values = param.detach().reshape(-1)[a:b]
            master = shard.master[lo:hi]
            differ = bits(values) != bits(master.to(values.dtype))
            if bool(differ.any()):
                master[differ] = values[differ].to(master.dtype)
                synced.add(param)
    return synced

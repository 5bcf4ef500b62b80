"""The ``TP x PP x DP`` grid of the pipeline schedules: process groups, and the TP
all-reduce of sequence-parallel replicated grads.

Global rank ``first_rank + (stage * D + dp_rank) * T + tp_rank``: tensor parallel
innermost, pipeline outermost (production's default ``tp-dp-pp`` order). Each
TP rank has its own DP group (same stage and TP rank), pipeline (same DP and TP
rank) and embedding group (first and last stage, same DP and TP rank); each
(stage, DP rank) has one TP group, and each DP rank one model-parallel group
(every stage and TP rank: what a grad norm sums over). With ``T = 1`` the grid, its groups and the
order they are created in are those of the ``PP x DP`` grid.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastgrad.errors import LifecycleError


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the ``pp_size x dp_size`` grid and its process groups."""

    rank: int
    pp_size: int
    dp_size: int
    stage: int
    dp_rank: int
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    dp_group: Any
    pp_group: Any
    embedding_ranks: tuple[int, ...]
    embedding_group: Any
    tp_size: int = 1
    tp_rank: int = 0
    tp_ranks: tuple[int, ...] = ()
    tp_group: Any = None  # None with tp_size 1
    # Every stage and TP rank of this DP rank (the grad norm's model-parallel group); None at TP 1,
    # where ``pp_group`` is that group.
    model_parallel_group: Any = None

    def __post_init__(self) -> None:
        for name in ("pp_size", "dp_size", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelGroups.{name} must be an int >= 1, got {value!r}")
        if not 0 <= self.stage < self.pp_size:
            raise ValueError(f"ParallelGroups.stage must be in [0, {self.pp_size}), got {self.stage}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(
                f"ParallelGroups.dp_rank must be in [0, {self.dp_size}), got {self.dp_rank}"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"ParallelGroups.tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}"
            )
        if len(self.pp_ranks) != self.pp_size:
            raise ValueError(
                f"ParallelGroups.pp_ranks must hold pp_size={self.pp_size} ranks, got {self.pp_ranks}"
            )

    @property
    def is_first_stage(self) -> bool:
        """True on stage 0 (it owns the inputs)."""
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last stage (it owns the targets and the losses)."""
        return self.stage == self.pp_size - 1


def global_rank(stage: int, dp_rank: int, dp_size: int, first_rank: int = 0,
                tp_size: int = 1, tp_rank: int = 0) -> int:
    """The global rank of ``(stage, dp_rank, tp_rank)``: pipeline outermost, tensor
    parallel innermost, offset by ``first_rank``."""
    return first_rank + (stage * dp_size + dp_rank) * tp_size + tp_rank


def build_parallel_groups(
    pp_size: int, dp_size: int, *, first_rank: int = 0, tp_size: int = 1
) -> ParallelGroups | None:
    """Create the DP, pipeline, embedding and (``tp_size > 1``) TP groups of a
    ``pp_size x dp_size x tp_size`` grid.

    The grid occupies global ranks ``[first_rank, first_rank + pp_size * dp_size * tp_size)``
    (several grids can share one world). ``dist.new_group`` is collective over
    the whole world, so every rank of the world must call this identically, in
    the same order; ranks outside the grid get ``None``.
    """
    for name, value in (("pp_size", pp_size), ("dp_size", dp_size), ("tp_size", tp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(first_rank, bool) or not isinstance(first_rank, int) or first_rank < 0:
        raise ValueError(f"first_rank must be an int >= 0, got {first_rank!r}")
    if not dist.is_initialized():
        raise LifecycleError("build_parallel_groups needs torch.distributed to be initialised")
    world = dist.get_world_size()
    size = pp_size * dp_size * tp_size
    if first_rank + size > world:
        raise ValueError(
            f"first_rank + pp_size * dp_size * tp_size = {first_rank} + {pp_size} * {dp_size} * "
            f"{tp_size} exceeds the world size {world}"
        )
    rank = dist.get_rank()
    member = first_rank <= rank < first_rank + size
    stage, dp_rank, tp_rank = -1, -1, -1
    if member:
        stage, rest = divmod(rank - first_rank, dp_size * tp_size)
        dp_rank, tp_rank = divmod(rest, tp_size)
    embedding_group = tp_group = model_parallel_group = None
    embedding_ranks: tuple[int, ...] = ()
    tp_ranks: tuple[int, ...] = ()

    def at(s: int, d: int, t: int) -> int:
        return global_rank(s, d, dp_size, first_rank, tp_size, t)

    def new_groups(keys: Iterable[tuple[int, ...]], ranks_of: Callable[..., Iterable[int]],
                   mine: tuple[int, ...]) -> tuple[Any, tuple[int, ...]]:
        """One group per key, created by every rank in the same order (``new_group`` is
        collective); returns this rank's group and its ranks (None, () if none)."""
        found: tuple[Any, tuple[int, ...]] = (None, ())
        for key in keys:
            ranks = tuple(ranks_of(*key))
            group = dist.new_group(list(ranks))
            if key == mine:
                found = (group, ranks)
        return found

    tps, pps, dps = range(tp_size), range(pp_size), range(dp_size)
    dp_group, dp_ranks = new_groups(product(tps, pps), lambda t, s: (at(s, d, t) for d in dps),
                                    (tp_rank, stage))
    pp_group, pp_ranks = new_groups(product(tps, dps), lambda t, d: (at(s, d, t) for s in pps),
                                    (tp_rank, dp_rank))
    if pp_size > 1:
        embedding_group, embedding_ranks = new_groups(
            product(tps, dps), lambda t, d: (at(0, d, t), at(pp_size - 1, d, t)), (tp_rank, dp_rank))
    if tp_size > 1:
        tp_group, tp_ranks = new_groups(product(pps, dps), lambda s, d: (at(s, d, t) for t in tps),
                                        (stage, dp_rank))
        model_parallel_group, _ = new_groups(
            ((d,) for d in dps), lambda d: (at(s, d, t) for s in pps for t in tps), (dp_rank,))
    if not member:
        return None
    return ParallelGroups(
        rank=rank,
        pp_size=pp_size,
        dp_size=dp_size,
        stage=stage,
        dp_rank=dp_rank,
        pp_ranks=pp_ranks,
        dp_ranks=dp_ranks,
        dp_group=dp_group,
        pp_group=pp_group,
        embedding_ranks=embedding_ranks,
        embedding_group=embedding_group,
        tp_size=tp_size,
        tp_rank=tp_rank,
        tp_ranks=tp_ranks or (rank,),
        tp_group=tp_group,
        model_parallel_group=model_parallel_group,
    )


def sequence_parallel_params(module: nn.Module, groups: ParallelGroups) -> list[nn.Parameter]:
    """Parameters replicated across the TP group whose grads come from sequence shards
    (marked ``param.sequence_parallel = True``); empty at TP 1."""
    if groups.tp_size == 1:
        return []
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(params: Sequence[nn.Parameter], tp_group: Any) -> None:
    """Sum the ``main_grad`` of sequence-parallel replicated params over the TP group, coalesced
    into one collective (Megatron-Core's ``_allreduce_non_tensor_model_parallel_grads``)."""
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    if not grads or tp_group is None:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()

"""A ``ParallelDims`` as Megatron-Core's ``ProcessGroupCollection``, in one place.

Megatron-Core takes its process groups per object (``DistributedDataParallel``, the
schedules, ``finalize_model_grads``, ``get_megatron_optimizer``, ``_ParamAndGradBuffer``:
``pg_collection=``), never here through its global ``parallel_state``. Every adapter that
builds one of them hands it :func:`megatron_process_groups` of its grid, so that the fields
each of Megatron's readers expects are set the same way everywhere (the fields are those of
``megatron/core/process_groups_config.py``'s ``ProcessGroupCollection``, 0.16 and 0.19).

No MoE and no context parallelism here: the expert groups and the context group are this
rank alone, the expert-model-parallel combination ``tp_ep_pp`` is None, and there is one
distributed-optimizer instance (so ``intra_dp_cp`` is ``dp_cp`` and ``inter_dist_opt`` is not
set, as ``ProcessGroupCollection.setup_process_groups_for_ddp`` then derives them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from gradvocab import ParallelDims, require_place

if TYPE_CHECKING:  # megatron-core is optional: imported where a technique runs
    from megatron.core.process_groups_config import ProcessGroupCollection


def fake_group(rank: int, size: int) -> dist.ProcessGroup:
    """torch's ``FakeProcessGroup``: a size and a rank, no communication."""
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(rank, size)


def megatron_process_groups(grid: ParallelDims, *, alone: Any = None) -> ProcessGroupCollection:
    """``grid``'s groups as a ``ProcessGroupCollection``, every field Megatron's readers take.

    ``grid`` must know this rank's place (``build()``, ``with_groups()``,
    ``ParallelDims.data_parallel()``). A dimension of size 1 that the grid holds no group for
    (TP 1, CP, the expert groups; the pipeline of a DP-only grid) is ``alone``: a group of
    this rank alone, by default torch's ``FakeProcessGroup`` (a size and a rank; a caller
    may pass a real group of this rank alone instead). A grid without
    ``torch.distributed`` (``RankPlace(distributed=False)``: a layout to inspect) gets fake
    groups of its sizes throughout. A grid spanning part of the world gets a new group over
    its ranks for the distributed optimizer's statistics (collective over those ranks).
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    grid = require_place(grid, "megatron_process_groups")
    if grid.cp_size > 1:
        raise ValueError(f"megatron_process_groups: cp_size={grid.cp_size}: no context-parallel "
                         "groups to give Megatron (ParallelDims.build makes none)")
    if grid.distributed:
        alone = fake_group(0, 1) if alone is None else alone

        def given(group: Any, size: int, name: str) -> Any:
            if group is not None:
                return group
            if size == 1:
                return alone
            raise ValueError(f"megatron_process_groups: {grid} has no {name} group on this "
                             f"rank (size {size}); build() the grid or give it to with_groups()")

        # ParallelDims' dp_group None is torch's default group (ParallelDims.data_parallel(None)).
        dp = grid.dp_group if grid.dp_group is not None else dist.group.WORLD
        tp = given(grid.tp_group, grid.tp_size, "TP")
        pp = given(grid.pp_group, grid.pp_size, "pipeline")
        # every stage and TP rank of this DP replica: the pipeline group at TP 1
        mp = pp if grid.tp_size == 1 else given(grid.model_parallel_group,
                                                grid.tp_size * grid.pp_size, "model-parallel")
        distributed_optimizer = _distributed_optimizer_group(grid, dp)
        # A middle stage's embedding group is torch's non-member marker, not a group: None,
        # which Megatron reads as size 1 and skips the tied embedding's all-reduce.
        embedding = grid.embedding_group
        embedding = embedding if isinstance(embedding, dist.ProcessGroup) else None
    else:  # laid out only: fake groups of the grid's sizes at this rank's coordinates
        place = grid.place
        alone = fake_group(0, 1)
        dp = distributed_optimizer = fake_group(place.dp_rank or 0, grid.dp_size)
        tp = fake_group(place.tp_rank or 0, grid.tp_size)
        pp = fake_group(place.stage or 0, grid.pp_size)
        mp = fake_group((place.stage or 0) * grid.tp_size + (place.tp_rank or 0),
                        grid.tp_size * grid.pp_size)
        embedding = None
    groups = ProcessGroupCollection()
    groups.dp = groups.dp_cp = groups.intra_dp_cp = dp  # CP 1, one distributed-optimizer instance
    groups.tp = groups.tp_cp = tp
    groups.pp, groups.mp = pp, mp
    groups.cp = groups.ep = groups.expt_tp = groups.expt_dp = groups.intra_expt_dp = alone
    groups.tp_ep_pp = None
    groups.intra_dist_opt = distributed_optimizer
    groups.embd, groups.pos_embd = embedding, None
    return groups


def _distributed_optimizer_group(grid: ParallelDims, dp_group: Any) -> Any:
    """One distributed-optimizer instance over the whole grid: its grad statistics (norm,
    zeros) are reduced over every rank of it (``parallel_state``'s intra-distributed-optimizer
    instance group)."""
    if grid.world_size == grid.dp_size:  # a DP-only grid: its ranks are the DP group's
        return dp_group
    ranks = list(range(grid.first_rank, grid.first_rank + grid.world_size))
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(ranks, use_local_synchronization=True)


__all__ = ["fake_group", "megatron_process_groups"]

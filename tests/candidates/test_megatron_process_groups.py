"""verify.candidates.megatron_core.process_groups: one ParallelDims -> ProcessGroupCollection
for every Megatron-Core adapter, checked against the installed ProcessGroupCollection's fields
and the grid's own groups."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from gradvocab import ParallelDims, RankPlace
from verify.candidates.megatron_core.version import missing_reason

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))

# Every field some adapter hands Megatron (DDP's setup_process_groups_for_ddp reads dp, dp_cp,
# expt_dp, tp, pp, ep; the optimizer, the schedules and finalize_model_grads the rest).
SET_FIELDS = {"dp", "dp_cp", "intra_dp_cp", "tp", "tp_cp", "cp", "pp", "mp", "ep", "expt_tp",
              "expt_dp", "intra_expt_dp", "tp_ep_pp", "intra_dist_opt", "embd", "pos_embd"}


def _groups(grid: ParallelDims, **kwargs):
    from verify.candidates.megatron_core.process_groups import megatron_process_groups

    return megatron_process_groups(grid, **kwargs)


def test_every_field_set_is_one_of_megatrons_own():
    from megatron.core.process_groups_config import ProcessGroupCollection

    own = {f.name for f in dataclasses.fields(ProcessGroupCollection)}
    groups = _groups(ParallelDims(dp_size=4, place=RankPlace(rank=2, dp_rank=2, distributed=False)))
    assert set(vars(groups)) == SET_FIELDS
    assert SET_FIELDS <= own, SET_FIELDS - own


def test_a_laid_out_grid_gets_fake_groups_of_its_sizes_at_its_coordinates():
    groups = _groups(ParallelDims(dp_size=4, place=RankPlace(rank=2, dp_rank=2, distributed=False)))
    assert (groups.dp.size(), groups.dp.rank()) == (4, 2)
    assert groups.dp_cp is groups.dp and groups.intra_dp_cp is groups.dp
    assert groups.intra_dist_opt is groups.dp  # a DP-only grid: one optimizer instance over DP
    assert [(g.size(), g.rank()) for g in (groups.tp, groups.pp, groups.mp, groups.cp, groups.ep,
                                           groups.expt_dp)] == [(1, 0)] * 6
    assert groups.tp_ep_pp is None and groups.embd is None and groups.pos_embd is None


def test_sizes_only_and_context_parallel_grids_are_refused():
    with pytest.raises(ValueError, match="sizes only"):
        _groups(ParallelDims(dp_size=2))
    with pytest.raises(ValueError, match="cp_size=2"):
        _groups(ParallelDims(cp_size=2, place=RankPlace(rank=0, distributed=False)))


def _built_grid_rank(rank: int, world: int) -> dict:
    from verify.candidates.megatron_core.grad_reduction import own_rank_group

    grid = ParallelDims(pp_size=2, dp_size=2).build()
    groups = _groups(grid)
    alone = own_rank_group({})
    dp_only = _groups(ParallelDims.data_parallel(), alone=alone)
    return {
        "dp": groups.dp is grid.dp_group and groups.dp_cp is grid.dp_group,
        "pp": groups.pp is grid.pp_group and groups.mp is grid.pp_group,
        "embd": groups.embd is grid.embedding_group,
        "whole_world": groups.intra_dist_opt is dist.group.WORLD,
        "tp": (groups.tp.size(), groups.tp_ep_pp),
        "dp_only": (dp_only.dp is dist.group.WORLD, dp_only.intra_dist_opt is dist.group.WORLD,
                    all(g is alone for g in (dp_only.tp, dp_only.pp, dp_only.mp, dp_only.ep,
                                             dp_only.expt_dp))),
    }


@pytest.mark.dist
def test_a_built_grid_hands_megatron_its_own_groups():
    from tests.distributed_utils import run_distributed

    for found in run_distributed(_built_grid_rank, 4, timeout_s=120):
        assert found == {"dp": True, "pp": True, "embd": True, "whole_world": True,
                         "tp": (1, None), "dp_only": (True, True, True)}

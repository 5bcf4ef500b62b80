"""gradvocab.ParallelDims: sizes and their rules, the rank order, and the groups of a built grid.

Expected ranks are hand-derived from Megatron-Core's ``initialize_model_parallel`` order
``tp-cp-ep-dp-pp`` (tensor parallel innermost, pipeline outermost; no experts here).
"""

import pytest
import torch
from distributed_utils import run_distributed

from gradvocab import LifecycleError, ParallelDims, RankPlace


def test_sizes_are_validated_naming_the_field_and_the_rule():
    with pytest.raises(ValueError, match=r"ParallelDims.pp_size must be an int >= 1, got 0"):
        ParallelDims(pp_size=0)
    with pytest.raises(TypeError, match="ParallelDims.dp_size must be an int, got bool"):
        ParallelDims(dp_size=True)
    with pytest.raises(TypeError, match="ParallelDims.tp_size must be an int, got float"):
        ParallelDims(tp_size=2.0)
    with pytest.raises(ValueError, match="ParallelDims.first_rank must be an int >= 0"):
        ParallelDims(first_rank=-1)
    with pytest.raises(ValueError, match="sequence_parallel needs tp_size > 1"):
        ParallelDims(sequence_parallel=True)
    with pytest.raises(TypeError, match="sequence_parallel must be a bool"):
        ParallelDims(tp_size=2, sequence_parallel=1)
    with pytest.raises(ValueError, match="vpp_size=2 needs pp_size >= 2"):
        ParallelDims(vpp_size=2)
    with pytest.raises(ValueError, match=r"place.stage must be in \[0, 2\), got 2"):
        ParallelDims(pp_size=2, place=RankPlace(rank=0, stage=2))
    with pytest.raises(ValueError, match="place.pp_ranks must hold pp_size=2 ranks"):
        ParallelDims(pp_size=2, place=RankPlace(rank=0, pp_ranks=(0,)))
    dims = ParallelDims(tp_size=2, cp_size=2, dp_size=3, pp_size=2, vpp_size=2, sequence_parallel=True)
    assert dims.world_size == 24 and dims.num_virtual_stages == 4 and not dims.built
    assert str(dims) == "TP 2 x CP 2 x DP 3 x PP 2 (VPP 2), sequence parallel"


def test_the_rank_order_is_tp_cp_dp_pp_by_hand():
    # TP 2 x DP 2 x PP 2 (CP 1): rank = (stage * 2 + dp) * 2 + tp.
    dims = ParallelDims(tp_size=2, dp_size=2, pp_size=2)
    assert [dims.global_rank(s, d, t) for s in range(2) for d in range(2) for t in range(2)] \
        == list(range(8))
    # TP 2 x CP 2 x DP 2 x PP 1: rank = (dp * 2 + cp) * 2 + tp; CP ranks are TP apart.
    cp = ParallelDims(tp_size=2, cp_size=2, dp_size=2)
    assert cp.global_rank(0, dp_rank=1, tp_rank=0, cp_rank=1) == 6
    assert cp.global_rank(0, dp_rank=0, tp_rank=1, cp_rank=1) == 3
    assert [cp.coordinates(r) for r in (0, 3, 6, 7)] == [
        (0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 1, 0), (0, 1, 1, 1)]  # (stage, dp, cp, tp)
    offset = ParallelDims(tp_size=2, dp_size=2, pp_size=2, first_rank=4)
    assert offset.global_rank(1, 1, 0) == 4 + 6
    assert offset.coordinates(3) is None and offset.coordinates(12) is None
    assert offset.coordinates(11) == (1, 1, 0, 1)
    with pytest.raises(ValueError, match=r"tp_rank must be an int in \[0, 2\)"):
        dims.global_rank(0, 0, 2)


def test_a_sizes_only_instance_has_no_place_to_read():
    dims = ParallelDims(pp_size=2)
    with pytest.raises(LifecycleError, match=r"ParallelDims.stage: these dims are sizes only"):
        _ = dims.stage
    with pytest.raises(LifecycleError, match="initialised"):
        dims.build()
    with pytest.raises(ValueError, match=r"cp_size=2: build\(\) creates no context-parallel groups"):
        ParallelDims(cp_size=2).build()
    with pytest.raises(LifecycleError, match="initialised"):
        dims.with_groups()
    placed = ParallelDims(pp_size=2, place=RankPlace(rank=1, stage=None, dp_rank=0))
    with pytest.raises(LifecycleError, match="stage is unknown on this rank"):
        _ = placed.is_last_stage
    assert placed.sizes_only() == ParallelDims(pp_size=2)


def test_data_parallel_without_torch_distributed_is_rank_0_of_the_given_size():
    dims = ParallelDims.data_parallel(dp_size=4)
    assert (dims.dp_size, dims.dp_rank, dims.rank, dims.distributed, dims.dp_group) == \
        (4, 0, 0, False, None)
    assert ParallelDims.data_parallel().dp_size == 1
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        ParallelDims.data_parallel(dp_size=0)
    with pytest.raises(TypeError, match="dp_size must be an int or None"):
        ParallelDims.data_parallel(dp_size=2.0)
    with pytest.raises(ValueError, match="dp_group was given"):
        ParallelDims.data_parallel(dp_group=object())


def _grid_worker(rank, world_size):
    """Sum rank-specific values over each of this rank's groups, two rounds (TP 2 x PP 2 x DP 2),
    and read the same coordinates back through with_groups and data_parallel."""
    import torch.distributed as dist

    dims = ParallelDims(tp_size=2, dp_size=2, pp_size=2).build()
    out = {"coords": (dims.stage, dims.dp_rank, dims.tp_rank), "pp_ranks": dims.pp_ranks}
    for round_, scale in enumerate((1, 10)):
        for name in ("dp_group", "pp_group", "tp_group", "model_parallel_group", "embedding_group"):
            value = torch.tensor([float(rank * scale)])
            dist.all_reduce(value, group=getattr(dims, name))
            out[(name, round_)] = float(value)
    given = ParallelDims(tp_size=2, dp_size=2, pp_size=2).with_groups(
        tp_group=dims.tp_group, dp_group=dims.dp_group, pp_group=dims.pp_group)
    out["with_groups"] = (given.stage, given.dp_rank, given.tp_rank, given.pp_ranks)
    only_tp = ParallelDims(tp_size=2, pp_size=2).with_groups(tp_group=dims.tp_group)
    out["only_tp"] = only_tp.tp_rank
    try:
        _ = only_tp.stage
    except LifecycleError as error:
        out["unknown_stage"] = str(error)
    out["data_parallel"] = ParallelDims.data_parallel(dims.dp_group).dp_rank
    try:
        ParallelDims(tp_size=4).with_groups(tp_group=dims.tp_group)
    except ValueError as error:
        out["wrong_size"] = str(error)
    first_pair = dist.new_group([0, 1])  # collective: every rank creates it
    if rank >= 2:  # a group this process is not in (torch answers rank -1 for it)
        for what, make in (("data_parallel", lambda: ParallelDims.data_parallel(first_pair)),
                           ("with_groups", lambda: ParallelDims(tp_size=2).with_groups(
                               tp_group=first_pair))):
            try:
                make()
            except ValueError as error:
                out[("foreign", what)] = str(error)
    outside = ParallelDims(pp_size=2, first_rank=6).build()  # ranks 6 and 7 only
    out["outside"] = outside is None
    return out


@pytest.mark.dist
def test_a_built_grid_holds_the_hand_derived_ranks_in_every_group():
    """rank = (stage * D + dp) * T + tp. DP groups share (stage, tp), pipelines and embedding
    groups share (dp, tp), TP groups share (stage, dp), model-parallel groups share dp."""
    results = run_distributed(_grid_worker, 8)
    for rank, got in enumerate(results):
        stage, dp, tp = rank // 4, (rank // 2) % 2, rank % 2
        assert got["coords"] == (stage, dp, tp)
        members = {
            "dp_group": [(stage * 2 + d) * 2 + tp for d in range(2)],
            "pp_group": [(s * 2 + dp) * 2 + tp for s in range(2)],
            "tp_group": [(stage * 2 + dp) * 2 + t for t in range(2)],
            "model_parallel_group": [(s * 2 + dp) * 2 + t for s in range(2) for t in range(2)],
            "embedding_group": [(s * 2 + dp) * 2 + tp for s in (0, 1)],
        }
        assert got["pp_ranks"] == tuple(members["pp_group"])
        for name, ranks in members.items():
            for round_, scale in enumerate((1, 10)):
                assert got[(name, round_)] == sum(r * scale for r in ranks), (rank, name)
        assert got["with_groups"] == (stage, dp, tp, tuple(members["pp_group"]))
        assert got["only_tp"] == tp and "stage is unknown" in got["unknown_stage"]
        assert got["data_parallel"] == dp
        assert "tp_group has 2 ranks but ParallelDims.tp_size=4" in got["wrong_size"]
        assert got["outside"] == (rank < 6)
        if rank >= 2:  # a given group without this rank is refused, naming it and the rank
            assert got[("foreign", "data_parallel")].startswith(
                f"dp_group does not contain this process (global rank {rank})")
            assert got[("foreign", "with_groups")].startswith(
                f"tp_group does not contain this process (global rank {rank})")

import os
import time

import pytest
import torch
import torch.distributed as dist

from verify.distributed import DistributedRunError, spawn


def _sum_of_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return (rank, t.item())


def _tensor_result(rank, world_size):
    return {"rank": rank, "data": torch.arange(4, dtype=torch.bfloat16) + rank}


@pytest.mark.dist
def test_spawn_returns_tensors_by_value():
    results = spawn(_tensor_result, 2, timeout_s=60)
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert torch.equal(result["data"], torch.arange(4, dtype=torch.bfloat16) + rank)


def _rank_one_fails(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken on purpose")
    return rank


@pytest.mark.dist
def test_spawn_returns_results_in_rank_order():
    results = spawn(_sum_of_ranks, 3, 2.0)
    assert results == [(0, 6.0), (1, 6.0), (2, 6.0)]


@pytest.mark.dist
def test_spawn_reports_the_failing_rank():
    with pytest.raises(DistributedRunError, match="(?s)rank 1 failed.*rank one is broken"):
        spawn(_rank_one_fails, 2, timeout_s=60)


def test_spawn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        spawn(_sum_of_ranks, 0, 1.0)
    with pytest.raises(TypeError, match="world_size must be an int"):
        spawn(_sum_of_ranks, 2.0, 1.0)
    with pytest.raises(TypeError, match="world_size must be an int"):
        spawn(_sum_of_ranks, True, 1.0)
    with pytest.raises(TypeError, match="fn must be a callable"):
        spawn("_sum_of_ranks", 2, 1.0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        spawn(_sum_of_ranks, 2, 1.0, timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        spawn(_sum_of_ranks, 2, 1.0, timeout_s=float("nan"))


def _rank_one_dies(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


@pytest.mark.dist
def test_spawn_notices_a_dead_rank_without_waiting_for_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="rank 1 failed"):
        spawn(_rank_one_dies, 2, timeout_s=200)
    assert time.monotonic() - start < 100


def _rank_one_fails_while_rank_zero_waits(rank, world_size):
    if rank == 1:
        raise RuntimeError("rank one fails before sending")
    buffer = torch.zeros(1)
    dist.recv(buffer, src=1)  # never satisfied: rank 1 failed
    return rank


@pytest.mark.dist
def test_a_failing_rank_does_not_leave_its_peers_waiting_for_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="(?s)rank 1 failed.*fails before sending"):
        spawn(_rank_one_fails_while_rank_zero_waits, 2, timeout_s=200)
    assert time.monotonic() - start < 60

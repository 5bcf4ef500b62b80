"""spawn_each: one world per item (or shared until a crash), a raising rank ending its world fast."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from verify.distributed import ItemOutcome, RankCrashed, RankFailure, spawn_each

# Written by an item, read by the next: a process-wide value one item leaves behind.
_LEFT_BEHIND: list[int] = []


def _sum_item(rank: int, world_size: int, item: int) -> dict:
    """All-reduce a rank-specific value; report what an earlier item left in this process."""
    seen = list(_LEFT_BEHIND)
    _LEFT_BEHIND.append(item)
    value = torch.tensor([float(item * 10 + rank + 1)])
    dist.all_reduce(value)
    return {"sum": value.item(), "pid": os.getpid(), "seen": seen}


@pytest.mark.dist
def test_isolated_items_run_in_fresh_processes():
    outcomes = spawn_each(_sum_item, 2, [1, 2, 3], isolate=True)
    assert all(o.crash is None for o in outcomes)
    # item * 10 + 1 on rank 0 plus item * 10 + 2 on rank 1: hand-derived sums.
    assert [o.results[0]["sum"] for o in outcomes] == [23.0, 43.0, 63.0]
    assert [o.results[1]["sum"] for o in outcomes] == [23.0, 43.0, 63.0]
    # Nothing an earlier item left in its process reaches a later one.
    assert all(o.results[r]["seen"] == [] for o in outcomes for r in range(2))
    pids = [o.results[0]["pid"] for o in outcomes]
    assert len(set(pids)) == 3


@pytest.mark.dist
def test_shared_items_run_in_one_world_in_order():
    outcomes = spawn_each(_sum_item, 2, [1, 2, 3], isolate=False)
    assert [o.results[0]["sum"] for o in outcomes] == [23.0, 43.0, 63.0]
    assert [o.results[1]["seen"] for o in outcomes] == [[], [1], [1, 2]]
    assert len({o.results[0]["pid"] for o in outcomes}) == 1


def _raise_on_rank_one_in_item_one(rank: int, world_size: int, item: int) -> float:
    if item == 1 and rank == 1:
        raise ValueError(f"planted fault in item {item}")
    value = torch.tensor([float(rank + item)])
    dist.all_reduce(value)  # rank 0 waits here for rank 1 in item 1
    return value.item()


@pytest.mark.dist
@pytest.mark.parametrize("isolate", [True, False])
def test_a_rank_raising_ends_its_world_within_seconds_and_later_items_still_run(isolate):
    started = time.monotonic()
    outcomes = spawn_each(_raise_on_rank_one_in_item_one, 2, [0, 1, 2, 3], isolate=isolate,
                          timeout_s=60.0)
    elapsed = time.monotonic() - started
    # Far below the 60 s stall timeout: the peer waiting in its all-reduce was stopped once
    # rank 1's failure arrived, not when it went idle for a minute.
    assert elapsed < 30, elapsed
    assert outcomes[0].results == [1.0, 1.0]  # (0 + 0) + (1 + 0)
    crash = outcomes[1].crash
    assert isinstance(crash, RankCrashed) and outcomes[1].results is None
    assert crash.ranks == (1,)
    failure = crash.failures[1]
    assert failure.exception == "ValueError"
    assert failure.message == "planted fault in item 1"
    assert failure.item == 1
    assert failure.root is not None and failure.root.function == "_raise_on_rank_one_in_item_one"
    assert str(crash).startswith("rank 1 failed: ValueError: planted fault in item 1 (raised at ")
    # The items after the crash ran in a fresh world: (2 + 0) + (2 + 1), (3 + 0) + (3 + 1).
    assert outcomes[2].results == [5.0, 5.0]
    assert outcomes[3].results == [7.0, 7.0]


def _raise_everywhere(rank: int, world_size: int, item: int) -> None:
    raise RuntimeError("the same error on every rank")


@pytest.mark.dist
def test_the_same_error_on_every_rank_is_printed_once():
    (outcome,) = spawn_each(_raise_everywhere, 3, ["only"], isolate=True)
    text = str(outcome.crash)
    assert outcome.crash.ranks == (0, 1, 2)
    assert text.count("RuntimeError: the same error on every rank") == 2  # summary + traceback
    assert text.startswith("ranks 0, 1, 2 failed: RuntimeError: the same error on every rank")


def _die_in_item_zero(rank: int, world_size: int, item: int) -> int:
    if rank == 1:
        os._exit(3)
    dist.barrier()
    return rank


@pytest.mark.dist
def test_a_rank_dying_without_a_word_is_a_crash_of_the_item_it_ran():
    outcomes = spawn_each(_die_in_item_zero, 2, ["a", "b"], isolate=True)
    for outcome in outcomes:
        failure = outcome.crash.failures[1]
        assert failure.exception == "ProcessDied"
        assert "exited with code 3" in failure.message
    assert [o.crash.failures[1].item for o in outcomes] == [0, 1]


def test_the_root_cause_leads_and_classification_reads_past_torch_and_the_standard_library():
    try:
        try:
            json.loads("not json")
        except ValueError as inner:
            raise RuntimeError("while reading the config") from inner
    except RuntimeError as outer:
        failure = RankFailure.from_exception(outer, item=4)
    assert failure.exception == "JSONDecodeError"
    assert failure.summary().startswith("JSONDecodeError: Expecting value")
    assert "while reading the config" in failure.traceback
    assert failure.item == 4
    # The innermost frames are the standard library's json; the first one past them is this
    # test module's, which raised_in attributes the failure to.
    assert failure.root.module.startswith("json")
    assert failure.raised_in([__name__])
    assert not failure.raised_in(["fastgrad", "megatron"])
    # a candidate whose code is torch's or the standard library's names it: its frames count
    assert failure.raised_in(["json.decoder"])
    assert not failure.raised_in(["json.encoder"])


def test_item_outcome_holds_results_or_a_crash():
    with pytest.raises(ValueError, match="either results or a crash"):
        ItemOutcome(None, None)


def _raise_on_every_rank_in_item_one(rank: int, world_size: int, item: int) -> dict:
    value = torch.tensor([float(rank + item)])
    dist.all_reduce(value)  # every rank is past this collective before any raises
    if item == 1:
        raise ValueError(f"every rank raises after item {item}'s collective")
    return {"sum": value.item(), "pid": os.getpid()}


@pytest.mark.dist
def test_a_shared_world_goes_on_after_an_item_every_rank_got_past():
    outcomes = spawn_each(_raise_on_every_rank_in_item_one, 2, [0, 1, 2], isolate=False,
                          timeout_s=60.0)
    assert outcomes[1].crash is not None and outcomes[1].crash.ranks == (0, 1)
    assert outcomes[1].crash.first.message == "every rank raises after item 1's collective"
    # Items 0 and 2 ran in one world (the same processes): no rank was left inside item 1,
    # so the world went on, its process group made anew. (0 + 0) + (1 + 0); (0 + 2) + (1 + 2).
    assert [o.results[0]["sum"] for o in (outcomes[0], outcomes[2])] == [1.0, 5.0]
    assert outcomes[0].results[0]["pid"] == outcomes[2].results[0]["pid"]

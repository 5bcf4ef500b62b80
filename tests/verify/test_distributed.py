import multiprocessing
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from fastgrad.timeline import Timeline
from tests.timeouts import HANG_GUARD_S
from verify.distributed import (
    DistributedRunError,
    RankCrashed,
    RankLauncher,
    RankTimeout,
    spawn,
)
from verify.distributed.diagnosis import STACK_DUMP_STARVED_WAIT_S, rank_frames, summarize_frames
from verify.distributed.launcher import TERMINATE_GRACE_S
from verify.distributed.progress import MAX_LABEL_BYTES, ProgressBoard
from verify.distributed.stall import CPU_SHARE
from verify.metrics import assert_bitwise_equal


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
        assert_bitwise_equal(result["data"], torch.arange(4, dtype=torch.bfloat16) + rank)


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
    with pytest.raises(ValueError, match=r"ceiling_s must be >= timeout_s \(10\), got 5"):
        spawn(_sum_of_ranks, 2, 1.0, timeout_s=10, ceiling_s=5)


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


# ------------------------------------------------ crashes, deadlines and diagnosis
# Short deadlines keep these fast; the fork server is warmed first so that its one-time
# torch import does not eat into them. SLACK covers the stack dumps (1.5 s, up to 6 s
# while a rank waits for a CPU to write its stack), the SIGTERM grace (1 s), the SIGKILL
# join (<= 1 s) and a few polls on a loaded machine.
SHORT_TIMEOUT_S = 8.0
SLACK_S = STACK_DUMP_STARVED_WAIT_S + 2 * TERMINATE_GRACE_S + 2.5


@pytest.fixture(scope="module")
def warm_launcher():
    launcher = RankLauncher()
    launcher.warm_up(wait_s=60)
    return launcher


def _raises_on_rank_one(rank, world_size, *, progress):
    progress.mark("validating inputs")
    if rank == 1:
        raise ValueError("rank one is broken on purpose")
    return rank


@pytest.mark.dist
def test_a_raising_rank_is_a_rank_crash_naming_it(warm_launcher):
    with pytest.raises(RankCrashed, match="(?s)rank 1 failed.*rank one is broken") as info:
        warm_launcher.spawn(_raises_on_rank_one, 3, timeout_s=SHORT_TIMEOUT_S)
    # Peers waiting for rank 1 in the final barrier may fail too (connection reset).
    assert 1 in info.value.ranks
    assert "rank one is broken" in info.value.failures[1].traceback
    assert isinstance(info.value, DistributedRunError)


@pytest.mark.dist
def test_an_exiting_rank_is_a_rank_crash_with_its_exit_code(warm_launcher):
    with pytest.raises(RankCrashed, match="rank 1 failed") as info:
        warm_launcher.spawn(_rank_one_dies, 2, timeout_s=SHORT_TIMEOUT_S)
    assert 1 in info.value.ranks
    assert "exited with code 3" in info.value.failures[1].message


def _rank_one_sleeps(rank, world_size, *, progress):
    for step in range(2):
        progress.mark(f"step {step}: data loading")
        if rank == 1 and step == 1:
            time.sleep(10_000)
    return rank


def _rank_one_freezes(rank, world_size, *, progress):
    for step in range(2):
        progress.mark(f"step {step}: before the grad all-reduce")
        if rank == 1 and step == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(torch.ones(2))
    return rank


def _rank_one_skips_an_all_reduce(rank, world_size, *, progress):
    for step in range(2):
        progress.mark(f"step {step}: grad all-reduce")
        if not (rank == 1 and step == 1):
            dist.all_reduce(torch.ones(4) * rank)
    return rank


def _timeout_of(launcher, fn, world_size):
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        launcher.spawn(fn, world_size, timeout_s=SHORT_TIMEOUT_S)
    assert time.monotonic() - start >= SHORT_TIMEOUT_S
    assert info.value.stalled and "made no progress for 8 s" in str(info.value)
    # Stalled on time: no rank marked progress for the timeout, and the last marker of the
    # run is not much older than that (start-up under load delays it, not the stall).
    newest_marker_age = min(s.marker_age_s for s in info.value.states.values())
    assert SHORT_TIMEOUT_S <= newest_marker_age < SHORT_TIMEOUT_S + SLACK_S, newest_marker_age
    for state in info.value.states.values():  # killed and reaped, not left behind
        assert state.recent_cpu_s is not None and state.recent_cpu_s < CPU_SHARE * SHORT_TIMEOUT_S
        assert state.starved is False  # no thread of it waited for a CPU
        with pytest.raises(ProcessLookupError):
            os.kill(state.pid, 0)
    return info.value


@pytest.mark.dist
def test_a_stalled_rank_times_out_with_its_last_marker_and_location(warm_launcher):
    error = _timeout_of(warm_launcher, _rank_one_sleeps, 2)
    # Rank 0 finished its function and waits for rank 1 in the harness's final barrier.
    assert error.ranks == (0, 1)
    assert error.states[1].process == "running"
    assert error.states[1].marker == "step 1: data loading"
    assert error.states[1].marker_age_s >= SHORT_TIMEOUT_S - 3
    assert "_rank_one_sleeps" in error.states[1].location
    assert error.states[0].location == "in torch.distributed.barrier, called from the harness (rank_main)"
    assert "step 1: data loading" in str(error) and f"rank 1 (pid {error.states[1].pid}): running" in str(error)


@pytest.mark.dist
def test_a_rank_frozen_with_sigstop_is_killed_and_named(warm_launcher):
    error = _timeout_of(warm_launcher, _rank_one_freezes, 3)
    assert error.ranks == (0, 1, 2)
    assert error.states[1].process.startswith("stopped")
    assert error.states[1].marker == "step 1: before the grad all-reduce"
    assert error.states[1].location is None  # a frozen process cannot dump its stack
    for peer in (0, 2):
        assert error.states[peer].location.startswith("in torch.distributed.all_reduce, called from")
        assert "_rank_one_freezes" in error.states[peer].location


@pytest.mark.dist
def test_a_rank_skipping_a_collective_is_a_timeout_pointing_at_it(warm_launcher):
    error = _timeout_of(warm_launcher, _rank_one_skips_an_all_reduce, 3)
    assert error.ranks == (0, 1, 2)
    assert error.states[1].marker == "returned; in the harness's final barrier"
    for peer in (0, 2):
        assert error.states[peer].marker == "step 1: grad all-reduce"
        assert "in torch.distributed.all_reduce" in error.states[peer].location


def _compute_for(seconds):
    """Busy Python arithmetic for ``seconds`` of wall time (as refgrad's exact sums are)."""
    end, total = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        total += sum(range(1000))
    return total


def _rank_one_computes_without_markers(rank, world_size, seconds, *, progress):
    progress.mark("before the long computation")
    if rank == world_size - 1:
        _compute_for(seconds)
    dist.all_reduce(torch.ones(2))  # the other ranks wait here, burning no CPU
    return rank


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_rank_computing_past_the_timeout_is_not_stalled(warm_launcher, world_size):
    """Slow is not stuck: 3 x the timeout of computing without a marker passes, alone
    (the issue's one-rank local process in refgrad) or with a peer waiting for it."""
    timeout_s = 2.0
    assert warm_launcher.spawn(_rank_one_computes_without_markers, world_size, 3 * timeout_s,
                               timeout_s=timeout_s) == list(range(world_size))


def _rank_zero_waits_for_a_sleeping_peer(rank, world_size, seconds):
    if rank == 1:
        time.sleep(seconds)
    start_cpu, start = time.process_time(), time.monotonic()
    dist.all_reduce(torch.ones(2))
    return time.process_time() - start_cpu, time.monotonic() - start


@pytest.mark.dist
def test_a_rank_blocked_in_a_collective_burns_under_the_cpu_share(warm_launcher):
    """What the stall rule relies on: gloo does not busy-poll while a peer is absent
    (its transport thread wakes every 10 ms: about 0.3% of a core, measured)."""
    cpu_s, waited_s = warm_launcher.spawn(_rank_zero_waits_for_a_sleeping_peer, 2, 6.0)[0]
    assert waited_s >= 4.0
    assert cpu_s < CPU_SHARE * waited_s / 2, (cpu_s, waited_s)


def _rank_one_loops_forever(rank, world_size, *, progress):
    progress.mark("step 0")
    if rank == 1:
        while True:
            _compute_for(1.0)
    dist.all_reduce(torch.ones(2))
    return rank


@pytest.mark.dist
def test_a_rank_computing_forever_ends_at_the_ceiling(warm_launcher):
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        warm_launcher.spawn(_rank_one_loops_forever, 2, timeout_s=1.0, ceiling_s=5.0)
    elapsed = time.monotonic() - start
    assert 5.0 <= elapsed < 5.0 + SLACK_S, elapsed
    error = info.value
    assert not error.stalled and error.ceiling_s == 5.0
    assert "still running after 5 s, the ceiling of a run (5 x the 1 s stall timeout)" in str(error)
    # A starved rank runs its stack-dump handler only when it next gets a CPU: diagnosis
    # waits up to 6 s for it, and beside 8 spinners under pytest -n 2 it once missed that
    # (bench/results/suite_loaded_dist_78c3b0b_cpu.txt). The rule held: the run ended here.
    location = error.states[1].location
    assert (location is None and error.states[1].starved) or \
        "_rank_one_loops_forever" in location or "_compute_for" in location, str(error)
    assert error.states[1].starved or \
        error.states[1].recent_cpu_s > CPU_SHARE * error.states[1].window_s
    # Rank 0 waits in its all-reduce; on a starved machine (load ~25 with 8 spinners beside
    # pytest -n 2) neither rank had reached the harness's entry point within the 5 s, and a rank
    # that never started has no location to show.
    first = error.states[0]
    assert (first.location is None and first.starved) or \
        "in torch.distributed.all_reduce" in (first.location or ""), str(error)


def _progress_rank(rank, world_size, *, progress):
    return progress.rank


def _positional_progress(rank, world_size, progress=None):
    return progress


@pytest.mark.dist
def test_progress_goes_only_to_functions_with_a_keyword_only_parameter(warm_launcher):
    assert warm_launcher.spawn(_progress_rank, 2) == [0, 1]
    assert warm_launcher.spawn(_positional_progress, 2) == [None, None]


def _read_variable(rank, world_size):
    return os.environ.get("VERIFY_HARNESS_TEST_VARIABLE")


@pytest.mark.dist
def test_ranks_see_the_callers_environment_not_the_fork_servers(warm_launcher, monkeypatch):
    monkeypatch.setenv("VERIFY_HARNESS_TEST_VARIABLE", "set after the server started")
    assert warm_launcher.spawn(_read_variable, 2) == ["set after the server started"] * 2


@pytest.mark.dist
def test_spawn_start_method_gives_the_same_results():
    assert spawn(_sum_of_ranks, 3, 2.0, launcher=RankLauncher("spawn")) == [(0, 6.0), (1, 6.0), (2, 6.0)]


@pytest.mark.dist
def test_two_threads_may_spawn_at_once(warm_launcher):
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(warm_launcher.spawn, _sum_of_ranks, 2, scale) for scale in (1.0, 10.0)]
        first, second = (f.result(timeout=HANG_GUARD_S) for f in futures)
    assert first == [(0, 1.0), (1, 1.0)]
    assert second == [(0, 10.0), (1, 10.0)]


def test_launcher_rejects_bad_arguments(monkeypatch):
    with pytest.raises(ValueError, match=r"start_method \(or \$VERIFY_RANK_START_METHOD\) must be one of"):
        RankLauncher("fork")
    with pytest.raises(TypeError, match="preload must be a tuple of module names"):
        RankLauncher(preload=("torch", ""))
    monkeypatch.setenv("VERIFY_RANK_START_METHOD", "spawn")
    assert RankLauncher().start_method == "spawn"
    monkeypatch.setenv("VERIFY_RANK_START_METHOD", "threads")
    with pytest.raises(ValueError, match="got 'threads'"):
        RankLauncher()


def test_an_unmarked_test_cannot_start_ranks():
    with pytest.raises(AssertionError, match="mark it @pytest.mark.dist"):
        spawn(_sum_of_ranks, 2, 1.0)


def test_progress_slots_round_trip_and_truncate():
    board = ProgressBoard(multiprocessing.get_context("spawn"), 3)
    assert board.read(0) is None
    board.for_rank(2).mark("stage 1: backward microbatch 3")
    label, age = board.read(2)
    assert label == "stage 1: backward microbatch 3" and 0 <= age < 5
    board.for_rank(2).mark("x" * 1000)
    assert board.read(2)[0] == "x" * MAX_LABEL_BYTES
    assert board.read(1) is None
    with pytest.raises(ValueError, match="rank must be in"):
        board.for_rank(3)


def test_a_timeline_listener_marks_each_event():
    board = ProgressBoard(multiprocessing.get_context("spawn"), 1)
    timeline = Timeline(0, listener=board.for_rank(0).timeline_listener("stage 1: "))
    with timeline.record("backward", 3):
        assert board.read(0)[0] == "stage 1: backward microbatch 3 start"
    assert board.read(0)[0] == "stage 1: backward microbatch 3 end"
    with Timeline(0, enabled=False, listener=board.for_rank(0).timeline_listener()).record("grad_sync_wait"):
        assert board.read(0)[0] == "grad_sync_wait start"
    assert [e.kind for e in timeline.events] == ["backward"]


def test_stack_dumps_are_summarised_at_the_collective_and_its_caller():
    dump = (
        "Thread 0x0001 (most recent call first):\n"
        '  File "/x/lib/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        '  File "/x/lib/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
        '  File "/src/fastgrad/pipeline.py", line 340 in finalize_grads\n'
        '  File "/src/verify/distributed/_child.py", line 57 in rank_main\n'
        '  File "/py/multiprocessing/process.py", line 108 in run\n'
    )
    frames = rank_frames(dump)
    assert [f for _, _, f in frames] == ["all_reduce", "wrapper", "finalize_grads"]
    assert summarize_frames(frames) == (
        "in torch.distributed.all_reduce, called from /src/fastgrad/pipeline.py:340 (finalize_grads)"
    )
    assert summarize_frames(frames[2:]) == "at /src/fastgrad/pipeline.py:340 (finalize_grads)"
    assert summarize_frames([]) is None


@pytest.mark.dist
def test_on_started_runs_once_the_ranks_started_and_its_error_stops_them(warm_launcher):
    started = []
    assert warm_launcher.spawn(_sum_of_ranks, 2, 1.0, on_started=lambda: started.append(1)) \
        == [(0, 1.0), (1, 1.0)]
    assert started == [1]

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        warm_launcher.spawn(_rank_one_sleeps, 2, on_started=interrupted)
    assert not multiprocessing.active_children()  # every rank stopped, none left waiting

"""The stall rule (verify.distributed.stall) on synthetic readings, and the readings themselves.

Synthetic readings follow what bench/bench_suite_loaded.py measured on the shared 2-core
machine under load (bench/results/stall_signals_*_cpu.json): per second, a starved
computing thread was preempted 4-20 times and gave the CPU up 0-1.7 times (when the
parent watcher, then polling, took the GIL); gloo's transport thread of a blocked rank
gave the CPU up 37-57 times, was preempted 0-0.3 times, and was runnable (waiting for a
CPU after a wake-up) at 7-44% of readings, at most readings in a scratch probe at load 30.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from verify.distributed import RankLauncher, RankTimeout
from verify.distributed.diagnosis import (
    STACK_DUMP_STARVED_WAIT_S,
    STACK_DUMP_WAIT_S,
    request_stack_dumps,
)
from verify.distributed.launcher import TERMINATE_GRACE_S
from verify.distributed.stall import (
    CPU_SHARE,
    Sample,
    StallWatch,
    ThreadReading,
    cpu_seconds,
    thread_readings,
    wanted_cpu,
)

STEP_S = 0.5  # the launcher's poll


def _watch(timeout_s=10.0, ceiling_s=200.0):
    return StallWatch(timeout_s, ceiling_s, started_at=0.0)


@dataclass(frozen=True)
class _Thread:
    """A thread's behaviour per 0.5 s step: its state at each reading (cycled) and the
    context switches it makes."""

    tid: int
    states: str
    gave_up: int = 0
    preempted: int = 0
    # Every n-th step it is preempted once more (0: never).
    extra_preemption_every: int = 0

    def reading(self, step: int) -> ThreadReading:
        extra = step // self.extra_preemption_every if self.extra_preemption_every else 0
        return ThreadReading(self.tid, self.states[step % len(self.states)],
                             self.gave_up * step, self.preempted * step + extra)


def _feed(watch, rank, seconds, cpu_per_s, threads=None, sequence=1, cpu_tick_s=0.01,
          start=0.0):
    """Readings every 0.5 s; CPU time counted in whole ticks, as /proc counts it;
    ``threads`` None: no thread readings (a kernel without them)."""
    steps = int(seconds / STEP_S)
    for step in range(steps + 1):
        at = start + STEP_S * step
        cpu = None if cpu_per_s is None else (at * cpu_per_s) // cpu_tick_s * cpu_tick_s
        readings = None if threads is None else tuple(t.reading(step) for t in threads)
        watch.observe(rank, Sample(at, sequence, cpu, readings))
    return start + STEP_S * steps


# A rank blocked in a collective on a loaded machine: main thread asleep in gloo's wait,
# the transport thread runnable (waiting for a CPU after its wake-ups) at 7 of 8 readings
# and preempted once every 4 steps, the parent watcher asleep.
BLOCKED = (_Thread(100, "S"), _Thread(101, "RRRRRRRS", gave_up=30, extra_preemption_every=4),
           _Thread(102, "S", gave_up=1))
# A rank computing on a starved machine: its main thread always runnable, preempted 3 times
# and giving the CPU up once (the GIL) per step; its idle gloo threads as above.
STARVED = (_Thread(200, "R", gave_up=1, preempted=3), _Thread(201, "S", gave_up=30),
           _Thread(202, "S", gave_up=1))
STARVED_CPU_PER_S = 0.01  # 1% of a core: under CPU_SHARE
BLOCKED_CPU_PER_S = 0.004  # gloo's 10 ms wake-ups: 0.3-0.4% of a core


def test_a_starved_computing_rank_is_not_stalled_and_a_blocked_one_is():
    assert STARVED_CPU_PER_S < CPU_SHARE  # the CPU time alone would call it idle
    watch = _watch()
    end = _feed(watch, 0, 30.0, BLOCKED_CPU_PER_S, BLOCKED)
    _feed(watch, 1, 30.0, STARVED_CPU_PER_S, STARVED)
    assert watch.idle_s(0, end) >= 10.0
    assert watch.idle_s(1, end) == 0.0
    assert not watch.stalled([0, 1], end)  # the starved rank holds the run up, not a stall
    assert watch.stalled([0], end)
    assert watch.starved(1) is True and watch.starved(0) is False


def test_without_thread_readings_a_starved_rank_is_taken_for_stalled():
    """The fallback (no /proc/<pid>/task): markers and CPU time only, as before the rule."""
    watch = _watch()
    end = _feed(watch, 1, 30.0, STARVED_CPU_PER_S, threads=None)
    assert watch.stalled([1], end)
    assert watch.starved(1) is None


def test_without_cpu_time_or_thread_readings_only_markers_count():
    watch = _watch()
    end = _feed(watch, 0, 12.0, cpu_per_s=None, threads=None)
    assert watch.stalled([0], end)
    assert watch.recent_cpu_s(0) is None and watch.starved(0) is None


def test_a_sleeping_rank_and_a_stopped_rank_are_stalled():
    watch = _watch()
    sleeping = (_Thread(300, "S"), _Thread(301, "S", gave_up=30), _Thread(302, "S", gave_up=1))
    end = _feed(watch, 0, 12.0, BLOCKED_CPU_PER_S, sleeping)
    # SIGSTOP: every thread stopped, no switch, no CPU, however runnable it was before.
    stopped = (_Thread(310, "T"), _Thread(311, "T"))
    _feed(watch, 1, 12.0, 0.0, stopped)
    assert watch.stalled([0, 1], end)
    assert watch.starved(0) is False and watch.starved(1) is False


def test_a_marker_is_progress_and_the_ceiling_is_wall_time():
    watch = _watch(ceiling_s=40.0)
    _feed(watch, 0, 20.0, 0.0, BLOCKED, sequence=4)
    watch.observe(0, Sample(20.5, 6, 0.0, None))  # marked twice since the last reading
    assert watch.idle_s(0, 20.5) == 0.0
    assert not watch.stalled([0], 29.0)
    _feed(watch, 0, 10.0, 0.0, (_Thread(100, "T"),), sequence=6, start=21.0)  # then frozen
    assert watch.idle_s(0, 31.0) >= 10.0  # as far back as kept: the timeout
    assert watch.stalled([0], 31.0)
    assert not watch.over_ceiling(39.9) and watch.over_ceiling(40.0)
    with pytest.raises(ValueError, match="ceiling_s must be >= timeout_s"):
        _watch(timeout_s=10.0, ceiling_s=5.0)


def test_cpu_time_still_counts_where_threads_are_known():
    """A rank computing on a machine that serves it (5% of a core) without being preempted."""
    computing = (_Thread(400, "R", gave_up=1), _Thread(401, "S", gave_up=30))
    watch = _watch()
    end = _feed(watch, 0, 30.0, 0.05, computing)
    assert watch.idle_s(0, end) <= 2.0


def _pair(before, after):
    return Sample(0.0, 1, 0.0, tuple(before)), Sample(STEP_S, 1, 0.0, tuple(after))


@pytest.mark.parametrize(("before", "after", "wanted"), [
    # preempted 3 times, gave up once, runnable now: starved
    (((1, "R", 5, 7),), ((1, "R", 6, 10),), True),
    # as often preempted as it gave up (GIL hand-overs under starvation): starved
    (((1, "R", 5, 7),), ((1, "R", 7, 9),), True),
    # same switches, asleep at the reading (waiting for the GIL a moment): starved all the same
    (((1, "R", 5, 7),), ((1, "S", 6, 10),), True),
    # a thread that gave the CPU up more often than it was preempted, asleep now
    (((1, "R", 5, 7),), ((1, "S", 9, 10),), False),
    # a periodic waker: runnable now, but it gave the CPU up more often than it lost it
    (((1, "S", 5, 7),), ((1, "R", 35, 8),), False),
    # runnable at both readings without a switch: it waited for a CPU (or held one) throughout
    (((1, "R", 5, 7),), ((1, "R", 5, 7),), True),
    # runnable now but asleep before, no switch: it has just woken up
    (((1, "S", 5, 7),), ((1, "R", 5, 7),), False),
    # stopped at both readings
    (((1, "T", 5, 7),), ((1, "T", 5, 7),), False),
    # a thread started since the first reading counts from zero: preempted twice, gave up once
    (((1, "S", 5, 7),), ((1, "S", 5, 7), (2, "R", 1, 2)), True),
    # ... and one that has not switched yet is not known to have waited
    (((1, "S", 5, 7),), ((1, "S", 5, 7), (2, "R", 0, 0)), False),
    # one starved thread among sleeping ones is enough
    (((1, "S", 5, 7), (2, "R", 0, 4)), ((1, "S", 40, 7), (2, "R", 1, 8)), True),
])
def test_wanted_cpu_reads_why_each_thread_left_the_cpu(before, after, wanted):
    assert wanted_cpu(*_pair((ThreadReading(*t) for t in before),
                             (ThreadReading(*t) for t in after))) is wanted


def test_wanted_cpu_needs_thread_readings_and_time_between_them():
    assert wanted_cpu(Sample(0.0, 1, 0.0, None), Sample(1.0, 1, 0.0, None)) is False
    runnable = Sample(1.0, 1, 0.0, (ThreadReading(1, "R", 5, 7),))
    assert wanted_cpu(runnable, runnable) is False  # no window: nothing to judge


# ------------------------------------------------ the readings of real processes
def _child(code):
    return subprocess.Popen([sys.executable, "-c", code])


def _spinner(cpu):
    return _child(f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
def test_thread_readings_of_real_processes():
    me = {t.tid: t for t in thread_readings(os.getpid())}
    assert me[os.getpid()].state == "R"  # the reading thread runs
    sleeper = _child("import time; time.sleep(60)")
    try:
        time.sleep(0.5)
        assert {t.state for t in thread_readings(sleeper.pid)} == {"S"}
        os.kill(sleeper.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while thread_readings(sleeper.pid)[0].state != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [t.state for t in thread_readings(sleeper.pid)] == ["T"]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert thread_readings(sleeper.pid) is None  # gone
    assert thread_readings(None) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins processes to one CPU")
def test_two_processes_sharing_one_cpu_want_it_and_a_sleeping_one_does_not():
    """Real starvation, whatever the machine's load: two spinners pinned to one CPU
    preempt each other (or one waits throughout), while a sleeper gives the CPU up."""
    cpu = min(os.sched_getaffinity(0))
    spinners = [_spinner(cpu) for _ in range(2)]
    sleeper = _child("import time\nwhile True: time.sleep(0.01)")
    try:
        time.sleep(1.0)  # started and pinned
        pids = [p.pid for p in (*spinners, sleeper)]
        first = [Sample(0.0, 1, cpu_seconds(p), thread_readings(p)) for p in pids]
        time.sleep(2.0)
        last = [Sample(2.0, 1, cpu_seconds(p), thread_readings(p)) for p in pids]
    finally:
        for proc in (*spinners, sleeper):
            proc.kill()
            proc.wait()
    assert [wanted_cpu(a, b) for a, b in zip(first, last)] == [True, True, False]


# ------------------------------------------------ a starved rank is not stalled (real ranks)
# SLACK_S covers the stack dumps (up to 6 s while a starved rank waits for a CPU to write
# its stack), the SIGTERM grace (1 s), the SIGKILL join (<= 1 s) and a few polls, as in
# test_distributed.py.
SLACK_S = STACK_DUMP_STARVED_WAIT_S + 2 * TERMINATE_GRACE_S + 2.5


@pytest.fixture(scope="module")
def warm_launcher():
    launcher = RankLauncher()
    launcher.warm_up(wait_s=60)
    return launcher


def _compute_for(seconds):
    """Busy Python arithmetic for ``seconds`` of wall time (as refgrad's exact sums are)."""
    end, total = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        total += sum(range(1000))
    return total


@pytest.fixture
def contended_cpu():
    """A CPU this test may use, with a process spinning on it for the length of the test."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("pins processes to one CPU (Linux)")
    cpu = min(os.sched_getaffinity(0))
    spinner = _spinner(cpu)
    try:
        yield cpu
    finally:
        spinner.kill()
        spinner.wait()


def _starve_this_thread(cpu):
    """Share ``cpu`` with the spinner at the lowest priority: nice 19 weighs 15 against
    the spinner's 1024, so this thread gets about 1.4% of that CPU, under CPU_SHARE,
    however idle the rest of the machine is."""
    os.sched_setaffinity(0, {cpu})
    os.nice(19)


def _starved_rank_computes(rank, world_size, cpu, seconds, *, progress):
    """Rank 1 computes ``seconds`` without a marker and returns its share of a core."""
    progress.mark("before the long computation")
    share = None
    if rank == 1:
        _starve_this_thread(cpu)
        cpu_start, start = time.thread_time(), time.monotonic()
        _compute_for(seconds)
        share = (time.thread_time() - cpu_start) / (time.monotonic() - start)
    dist.all_reduce(torch.ones(2))
    return rank, share


@pytest.mark.dist
def test_a_starved_rank_computing_past_the_timeout_is_not_stalled(warm_launcher, contended_cpu):
    """Issue 31: a rank that computes but is not scheduled is starved, not stalled.
    Its CPU time stays under CPU_SHARE; its thread, preempted rather than giving the CPU
    up, shows it."""
    timeout_s = 2.0
    (rank0, _), (rank1, share) = warm_launcher.spawn(_starved_rank_computes, 2, contended_cpu,
                                                     3 * timeout_s, timeout_s=timeout_s)
    assert (rank0, rank1) == (0, 1)
    assert share < CPU_SHARE, share  # starved: CPU time alone would have called it stalled


def _starved_rank_loops_forever(rank, world_size, cpu, *, progress):
    progress.mark("step 0")
    if rank == 1:
        _starve_this_thread(cpu)
        while True:
            _compute_for(1.0)
    dist.all_reduce(torch.ones(2))
    return rank


@pytest.mark.dist
def test_a_starved_rank_computing_forever_ends_at_the_ceiling_not_before(warm_launcher,
                                                                        contended_cpu):
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        warm_launcher.spawn(_starved_rank_loops_forever, 2, contended_cpu, timeout_s=1.0,
                            ceiling_s=5.0)
    elapsed = time.monotonic() - start
    assert 5.0 <= elapsed < 5.0 + SLACK_S, elapsed
    error = info.value
    assert not error.stalled and error.ceiling_s == 5.0
    assert error.states[1].starved is True
    assert "(starved: preempted, waiting for a CPU)" in str(error)
    assert "_starved_rank_loops_forever" in error.states[1].location or \
        "_compute_for" in error.states[1].location


def _computes_and_counts_its_switches(rank, world_size, seconds):
    """Compute in Python for ``seconds``; this thread's (gave up, preempted) meanwhile."""
    tid = threading.get_native_id()

    def mine():
        return next(t for t in thread_readings(os.getpid()) if t.tid == tid)

    before, end = mine(), time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))
    after = mine()
    return after.gave_up - before.gave_up, after.preempted - before.preempted


@pytest.mark.dist
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
def test_a_computing_rank_gives_the_cpu_up_only_when_it_blocks(warm_launcher):
    """What the rule relies on for a computing rank: its thread leaves the CPU only when
    preempted. The harness's own threads must not take the GIL from it periodically (the
    parent watcher waits on a pidfd: polling every 0.5 s cost 1-2 switches each time)."""
    for gave_up, _ in warm_launcher.spawn(_computes_and_counts_its_switches, 2, 3.0):
        assert gave_up <= 1, gave_up


OUTLIVES_ITS_PARENT = """
import sys, threading, time
from verify.distributed._child import _exit_with_parent
_exit_with_parent(int(sys.argv[1]))
print(next(t.native_id for t in threading.enumerate() if t.name == "exit-with-parent"), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
def test_a_rank_exits_when_the_process_that_launched_it_dies_and_waits_without_waking():
    parent = _child("import time; time.sleep(600)")
    rank = subprocess.Popen([sys.executable, "-c", OUTLIVES_ITS_PARENT, str(parent.pid)],
                            stdout=subprocess.PIPE, text=True)
    try:
        watcher_tid = int(rank.stdout.readline())

        def watcher():
            return {t.tid: t for t in thread_readings(rank.pid)}[watcher_tid]

        deadline = time.monotonic() + 60
        while watcher().state != "S" and time.monotonic() < deadline:
            time.sleep(0.05)  # until it waits (it was started a moment ago)
        first = watcher()
        time.sleep(2.0)
        again = watcher()
        assert first.state == "S" and again.gave_up == first.gave_up  # no wake-up, no GIL taken from a computing rank
        parent.kill()
        parent.wait()
        assert rank.wait(timeout=60) == 1
    finally:
        for proc in (parent, rank):
            proc.kill()
            proc.wait()


# A process whose faulthandler answers SIGUSR1 only once it unblocks the signal: after 3 s
# of computing (runnable throughout, as a starved rank waiting for a CPU), or after 60 s
# of sleeping (a rank that will not answer, and is not waiting for a CPU either).
ANSWERS_LATE = """
import faulthandler, signal, sys, time
dump = open(sys.argv[1], "w")
faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
def rank_main():  # the frame the harness looks for in a complete dump
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    print("ready", flush=True)
    if sys.argv[2] == "sleeps":
        time.sleep(60.0)
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    time.sleep(600)
rank_main()
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
@pytest.mark.parametrize("behaviour", ["computes", "sleeps"])
def test_stack_dumps_wait_for_a_runnable_rank_not_for_a_sleeping_one(tmp_path, behaviour):
    path = tmp_path / "rank0.stack"
    proc = subprocess.Popen([sys.executable, "-c", ANSWERS_LATE, str(path), behaviour],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        start = time.monotonic()
        dumps = request_stack_dumps({0: proc.pid}, {0: path})
        waited = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    if behaviour == "computes":  # answered after its 3 s: past the usual wait, not the long one
        assert "rank_main" in dumps[0] and waited < STACK_DUMP_STARVED_WAIT_S
    else:  # asleep: not waiting for a CPU, so given the usual wait only
        assert dumps == {} and STACK_DUMP_WAIT_S <= waited < STACK_DUMP_STARVED_WAIT_S


def test_cpu_seconds_of_this_process_grow_while_it_computes():
    before, start = cpu_seconds(os.getpid()), time.process_time()
    while time.process_time() - start < 0.3:  # CPU time, not wall: a loaded machine is slow
        sum(range(1000))
    assert cpu_seconds(os.getpid()) - before >= 0.25  # /proc counts 10 ms ticks
    assert cpu_seconds(None) is None

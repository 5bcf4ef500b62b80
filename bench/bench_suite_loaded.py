"""Tests on an oversubscribed machine: a starved rank must never fail a test (issue 31).

Starts ``--busy`` processes that spin in Python, waits ``--settle`` seconds for the load
to build, then runs a command under that load: by default the multi-rank tests
``pytest -m dist -n 2 tests/verify/test_distributed.py``, with ``--suite`` the whole
suite ``bash scripts/test.sh``, or any ``--command``. With ``--baseline COMMIT`` the same
command also runs on that commit's tree (``git archive`` into a temporary folder, run
from there with the same interpreter), alternating with today's code round by round.
Each run records its wall time, exit code, the closing line of every pytest session it ran
(each leg: ``--suite`` runs the main suite, then the megatron-core 0.19.2 leg) and failed
tests, and the load average: the 1-minute figure before, after, and sampled every 5 s during the
run (mean and max). Then, still under load, it measures what the stall rule reads
(``--signals-s`` seconds, 0 to skip): two gloo ranks, one blocked in ``all_reduce`` and
one computing in Python, read every 0.5 s as the launcher reads them; for windows of
0.5-8 s it counts how often each rank shows progress by CPU time alone (the rule before
issue 31) and by the whole rule, and the rates of each thread's context switches. The
busy processes end with the script (and after ``--busy-limit`` seconds in any case).

The busy processes are this script's children, in its session, like the command: Linux
shares CPU time between sessions first where ``kernel.sched_autogroup_enabled`` is on
(recorded), so spinners started elsewhere would barely slow the command down.

    PYTHONPATH=$PWD python bench/bench_suite_loaded.py --busy 8 --baseline b2d6e3e \\
        --out bench/results/suite_loaded_dist_cpu
    PYTHONPATH=$PWD python bench/bench_suite_loaded.py --busy 8 --suite \\
        --out bench/results/suite_loaded_all_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _commits import export_commit  # bench/ is on sys.path when a script runs

from verify.distributed import spawn
from verify.distributed.stall import Sample, computed, cpu_seconds, progressed, thread_readings

REPO = Path(__file__).resolve().parents[1]
BUSY = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"
DIST_TESTS = "{python} -m pytest -m dist -n 2 -p no:cacheprovider tests/verify/test_distributed.py"
SUITE = "bash scripts/test.sh"
LOAD_SAMPLE_S = 5.0
# pytest's closing line, e.g. "==== 1 failed, 31 passed in 90.43s (0:01:30) ====" (no "=" with -q).
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|deselected)\b.*\bin [\d.]+s\b.*?)\s*=*$")
# The header line naming a session's interpreter, e.g. "platform linux -- Python 3.11.7, pytest-9.2.0, ...".
PLATFORM = re.compile(r"^platform \S+ -- Python (\S+?),")


def load_average() -> float:
    return round(os.getloadavg()[0], 1)


def autogroup() -> str:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        return "unknown"


def _describe_tree() -> str:
    """The commit of today's code, and whether the working tree differs from it."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return f"{commit} with uncommitted changes" if dirty else commit


class LoadSampler:
    """The 1-minute load average every LOAD_SAMPLE_S seconds while a run lasts."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(LOAD_SAMPLE_S):
            self.values.append(load_average())

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def pytest_legs(lines: list[str]) -> list[dict]:
    """Every pytest session's closing line in one command's output, in order, with which leg
    it is: its number from 1 and the Python its header names (None under ``-q``, which prints
    no header). ``scripts/test.sh`` runs two: the main suite (Python 3.11), then the
    megatron-core 0.19.2 leg (Python 3.12)."""
    legs: list[dict] = []
    python = None
    for line in lines:
        if platform_line := PLATFORM.match(line):
            python = platform_line.group(1)
        elif summary := SUMMARY.search(line):
            legs.append({"leg": len(legs) + 1, "python": python, "summary": summary.group(1)})
            python = None
    return legs


def describe_legs(legs: list[dict]) -> str:
    """The legs in one line: ``leg 1 (Python 3.11.7): 2006 passed in ...; leg 2 (...): ...``."""
    if not legs:
        return "no pytest summary"
    return "; ".join(f"leg {leg['leg']}" + (f" (Python {leg['python']})" if leg["python"] else "")
                     + f": {leg['summary']}" for leg in legs)


def run_command(label: str, command: str, root: Path, log: Path) -> dict:
    """One run of ``command`` (a shell line) from ``root``, its output kept in ``log``."""
    env = dict(os.environ, PYTHONPATH=str(root))
    before = load_average()
    start = time.perf_counter()
    with LoadSampler() as sampler, log.open("w") as output:
        # Its own process group (not session: see the module docstring), so that an
        # interrupted bench ends the whole command, not only the shell.
        proc = subprocess.Popen(command, shell=True, cwd=root, env=env, stdout=output,
                                stderr=subprocess.STDOUT, process_group=0)
        try:
            proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    seconds = time.perf_counter() - start
    lines = log.read_text(errors="replace").splitlines()
    during = sampler.values or [load_average()]
    row = {"code": label, "command": command, "seconds": round(seconds, 1),
           "exit_code": proc.returncode, "passed": proc.returncode == 0,
           "pytest_legs": pytest_legs(lines),
           "failed_tests": [line for line in lines if line.startswith(("FAILED", "ERROR"))],
           "load_before": before, "load_after": load_average(),
           "load_during_mean": round(statistics.mean(during), 1), "load_during_max": max(during)}
    print(f"{label:<22} {seconds:7.1f} s  exit {proc.returncode}  {describe_legs(row['pytest_legs'])}  "
          f"load {before} -> {row['load_after']} (during: mean {row['load_during_mean']}, "
          f"max {row['load_during_max']})", flush=True)
    for line in row["failed_tests"]:
        print(f"    {line}", flush=True)
    return row


def _blocked_and_computing(rank: int, world_size: int, seconds: float, pid_dir: str) -> int:
    Path(pid_dir, f"rank{rank}").write_text(str(os.getpid()))
    if rank == 1:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(1000))
    dist.all_reduce(torch.ones(2))
    return rank


WINDOWS_S = (0.5, 1.0, 2.0, 4.0, 8.0)


def _thread_name(pid: int, tid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return None


def _schedstat(pid: int) -> dict[int, tuple[float, float]]:
    """tid -> (seconds on a CPU, seconds waiting on a runqueue), from schedstat (not used
    by the stall rule: recorded to show why, see verify/distributed/stall.py)."""
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            on_cpu, waited, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        times[int(tid)] = (int(on_cpu) / 1e9, int(waited) / 1e9)
    return times


def stall_signals(seconds: float) -> dict:
    """Read a blocked rank (0) and a computing rank (1) every 0.5 s for ``seconds``."""
    samples: dict[int, list[Sample]] = {0: [], 1: []}
    schedstats: dict[int, list[dict[int, tuple[float, float]]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as pid_dir:
        ranks = threading.Thread(target=spawn, args=(_blocked_and_computing, 2, seconds + 5.0,
                                                     pid_dir), kwargs={"timeout_s": 600.0})
        ranks.start()
        files = [Path(pid_dir, f"rank{r}") for r in (0, 1)]
        while not all(f.exists() and f.read_text() for f in files):
            time.sleep(0.1)
        pids = [int(f.read_text()) for f in files]
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            now = time.monotonic()
            for rank, pid in enumerate(pids):
                samples[rank].append(Sample(now, 1, cpu_seconds(pid), thread_readings(pid)))
                schedstats[rank].append(_schedstat(pid))
            time.sleep(0.5)
        # The ranks run on for 5 s after the readings: their threads' names are still there.
        names = {(r, t.tid): _thread_name(pid, t.tid)
                 for r, pid in enumerate(pids) for t in samples[r][-1].threads or ()}
        ranks.join()
    result: dict = {"seconds": seconds, "load": load_average()}
    for rank, name in ((0, "blocked_rank"), (1, "computing_rank")):
        result[name] = _summary(samples[rank], schedstats[rank],
                                {tid: n for (r, tid), n in names.items() if r == rank})
        share = result[name]["cpu_share_of_a_core"]
        print(f"{name}: {100 * share:.2f}% of a core; windows showing progress "
              "(CPU rule / whole rule): " + ", ".join(
                  f"{w} {c['cpu_rule']}/{c['whole_rule']} of {c['windows']}"
                  for w, c in result[name]["windows_showing_progress"].items()), flush=True)
    return result


def _summary(readings: list[Sample], schedstats: list[dict[int, tuple[float, float]]],
             names: dict[int, str | None]) -> dict:
    """One rank's readings: per window length, how often each rule saw progress; per
    thread, its switches, its share of readings in state R and its schedstat times."""
    by_window: dict[str, dict[str, int]] = {}
    for j, latest in enumerate(readings):
        for earlier in readings[:j]:
            span = latest.at - earlier.at
            window = min(WINDOWS_S, key=lambda w: abs(w - span))
            if abs(window - span) > 0.2:
                continue
            counts = by_window.setdefault(f"{window:g}s", {"windows": 0, "cpu_rule": 0,
                                                             "whole_rule": 0})
            counts["windows"] += 1
            counts["cpu_rule"] += computed(earlier, latest)
            counts["whole_rule"] += progressed(earlier, latest)
    first, last = readings[0], readings[-1]
    span = last.at - first.at
    threads = {t.tid: t for t in first.threads or ()}
    rows = []
    for thread in last.threads or ():
        if thread.tid not in threads:
            continue
        states = [t.state for r in readings for t in r.threads or () if t.tid == thread.tid]
        row = {"name": names.get(thread.tid),
               "runnable_at_readings": round(states.count("R") / len(states), 2),
               "gave_up": round((thread.gave_up - threads[thread.tid].gave_up) / span, 1),
               "preempted": round((thread.preempted - threads[thread.tid].preempted) / span, 1)}
        if thread.tid in schedstats[0] and thread.tid in schedstats[-1]:
            (cpu0, wait0), (cpu1, wait1) = schedstats[0][thread.tid], schedstats[-1][thread.tid]
            row["schedstat_on_cpu_s"] = round((cpu1 - cpu0) / span, 4)
            row["schedstat_runqueue_wait_s"] = round((wait1 - wait0) / span, 4)
        rows.append(row)
    return {"cpu_share_of_a_core": round((last.cpu_s - first.cpu_s) / span, 4),
            "windows_showing_progress": by_window, "threads_per_second": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=8, help="spinning processes beside the runs")
    parser.add_argument("--busy-limit", type=float, default=3600.0,
                        help="seconds after which the spinning processes end in any case")
    parser.add_argument("--settle", type=float, default=30.0,
                        help="seconds between starting the spinners and the first run")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--suite", action="store_true", help=f"run the whole suite: {SUITE}")
    what.add_argument("--command", help="a shell line to run; {python} is this interpreter "
                                        f"(default: {DIST_TESTS})")
    parser.add_argument("--baseline", metavar="COMMIT", help="also run on this commit's tree")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--signals-s", type=float, default=20.0,
                        help="seconds to read a blocked and a computing rank (0: skip)")
    parser.add_argument("--signals-only", action="store_true",
                        help="run no command: only read the ranks under load")
    parser.add_argument("--out", metavar="PATH",
                        help="write PATH.json (the record) and PATH.txt (every run's output)")
    args = parser.parse_args()
    if args.busy < 0 or args.rounds < 1 or args.settle < 0 or args.signals_s < 0:
        parser.error("--busy, --settle and --signals-s must be >= 0, --rounds >= 1")
    if args.signals_only and (args.signals_s == 0 or args.suite or args.command or args.baseline):
        parser.error("--signals-only reads ranks for --signals-s > 0 and runs no command")
    command = None if args.signals_only else SUITE if args.suite else (args.command or DIST_TESTS)
    if command is not None:
        command = command.replace("{python}", shlex.quote(sys.executable))
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()} {os.cpu_count()} cpus (shared with other jobs)",
              "sched_autogroup_enabled": autogroup(), "invocation": shlex.join(sys.argv),
              "command": command, "today": _describe_tree(), "busy_processes": args.busy,
              "load_before_busy": load_average(), "load_after_settle": None, "runs": []}
    print(result["machine"], "load before the busy processes:", result["load_before_busy"],
          flush=True)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(limit=args.busy_limit)])
            for _ in range(args.busy)]
    logs = []
    try:
        time.sleep(args.settle)
        result["load_after_settle"] = load_average()
        print(f"{args.busy} busy processes, load after {args.settle:g} s: "
              f"{result['load_after_settle']}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            candidates = [("today", REPO)]
            if args.baseline:
                commit = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=REPO,
                                        check=True, capture_output=True, text=True).stdout.strip()
                candidates.append((f"baseline {commit}", export_commit(commit, Path(tmp))))
            for round_index in range(0 if args.signals_only else args.rounds):
                order = candidates if round_index % 2 == 0 else candidates[::-1]
                for label, root in order:
                    log = Path(tmp) / f"run{len(logs)}.log"
                    row = run_command(label, command, root, log)
                    row["round"] = round_index
                    result["runs"].append(row)
                    logs.append((label, round_index, log.read_text(errors="replace")))
        if args.signals_s > 0:
            result["stall_signals"] = stall_signals(args.signals_s)
    finally:
        for proc in busy:
            proc.kill()
        for proc in busy:
            proc.wait()
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
        text = [f"{result['date']}  {result['machine']}  autogroup "
                f"{result['sched_autogroup_enabled']}  busy {args.busy}  load before "
                f"{result['load_before_busy']}, after settling {result['load_after_settle']}",
                f"$ {result['invocation']}"]
        for (label, round_index, output), row in zip(logs, result["runs"]):
            text.append(f"\n===== {label} (round {round_index}): {row['seconds']} s, exit "
                        f"{row['exit_code']}, load during mean {row['load_during_mean']} "
                        f"max {row['load_during_max']}\n===== {describe_legs(row['pytest_legs'])}"
                        f"\n$ {command}\n{output.rstrip()}")
        Path(f"{args.out}.txt").write_text("\n".join(text) + "\n")
    return 0 if all(r["passed"] for r in result["runs"] if r["code"] == "today") else 1


if __name__ == "__main__":
    sys.exit(main())

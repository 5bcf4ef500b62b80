"""``verify accumulation`` at DP 65,536: today's compiled reductions against the torch ones.

Two parts (both by default):

* **interleaved**: the sweep of every dtype and distribution at ``--dp`` (16,384
  by default: DP 65,536 rounds every point up to 65,536 elements or more per rank,
  which takes the old code the better part of an hour), run by the
  ``sweep.py`` of ``--baseline`` (default ``main``, loaded from git history; it
  reduces with the torch ``models``) and by today's (the ``kernels``), alternately
  in one process, every point compared for bitwise equality;
* **full**: the command itself, ``verify accumulation --dp 65536 --numel 100000``,
  timed in a subprocess: wall and CPU seconds (user + system of the process and
  its threads) with the load average, the CPU time being what a quiet 2-core
  machine would take in wall time at best x 2.

    PYTHONPATH=$PWD python bench/bench_accumulation_large.py --json PATH [--skip-full]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_times  # noqa: E402

from verify.studies.reduce_scatter import sweep  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SWEEP_PATH = "verify/studies/reduce_scatter/sweep.py"
DP = 65536


def load_baseline(commit: str):
    """``sweep.py`` as it was at ``commit``, as a fresh module (it imports today's models
    and reference, whose functions it calls are unchanged)."""
    source = subprocess.run(["git", "show", f"{commit}:{SWEEP_PATH}"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sweep_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sweep_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _key(point) -> tuple:
    return tuple("nan" if isinstance(v, float) and math.isnan(v) else v
                 for v in dataclasses.astuple(point))


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def interleaved(baseline, dp: int, numel: int, rounds: int) -> dict:
    kwargs = {"dp_sizes": (dp,), "numel": numel}
    configs = {"old": baseline.SweepConfig(**kwargs), "new": sweep.SweepConfig(**kwargs)}
    modules = {"old": baseline, "new": sweep}
    points, cpu = {}, {"old": [], "new": []}

    def runner(name):
        def run():
            start = time.process_time()
            points[name] = modules[name].run_sweep(configs[name])
            cpu[name].append(time.process_time() - start)
        return run

    before = load_average()
    times = interleaved_times({"old": runner("old"), "new": runner("new")}, rounds, warmup=False)
    old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
    identical = [_key(p) for p in points["old"]] == [_key(p) for p in points["new"]]
    row = {"case": f"DP {dp}, numel {numel}, fp16+bf16, 3 distributions, 3 methods",
           "old_s": times["old"], "new_s": times["new"], "old_cpu_s": cpu["old"],
           "new_cpu_s": cpu["new"], "ratio_new_over_old": new_s / old_s,
           "cpu_ratio_new_over_old": statistics.median(cpu["new"]) / statistics.median(cpu["old"]),
           "points": len(points["new"]), "bitwise_identical": identical,
           "load_before": before, "load_after": load_average()}
    print(f"{row['case']}: old {old_s:.1f} s, new {new_s:.1f} s, new/old {new_s / old_s:.3f} "
          f"(CPU {row['cpu_ratio_new_over_old']:.3f}); {len(points['new'])} points identical="
          f"{identical}; load {before} -> {row['load_after']}", flush=True)
    return row


def full_command(numel: int) -> dict:
    """The CLI run at full size in a subprocess, its progress lines kept."""
    with tempfile.TemporaryDirectory() as tmp:
        before, usage = load_average(), resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "verify", "accumulation", "--dp", str(DP),
                               "--numel", str(numel), "--json", f"{tmp}/a.json"],
                              cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
        points = len(json.loads(Path(f"{tmp}/a.json").read_text())["points"]) \
            if proc.returncode == 0 else 0
    row = {"command": f"verify accumulation --dp {DP} --numel {numel}", "exit_code": proc.returncode,
           "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "points": points,
           "load_before": before, "load_after": load_average(),
           "progress_lines": proc.stderr.splitlines()[-40:]}
    print(f"{row['command']}: exit {proc.returncode}, {wall:.1f} s wall, {cpu:.1f} s CPU "
          f"(user + system), {points} points; load {before} -> {row['load_after']}", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="main", help="commit whose sweep.py is the baseline")
    parser.add_argument("--dp", type=int, default=16384, help="DP size, interleaved")
    parser.add_argument("--numel", type=int, default=16384, help="elements per point, interleaved")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--full-numel", type=int, default=100_000)
    parser.add_argument("--skip-full", action="store_true")
    parser.add_argument("--skip-interleaved", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.strip()
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": f"{platform.machine()} {os.cpu_count()} cpus (shared), torch "
                               f"{torch.__version__}, {torch.get_num_threads()} threads",
                    "command": " ".join(sys.argv), "baseline": commit}
    print(result["machine"], "baseline", commit, flush=True)
    ok = True
    if not args.skip_interleaved:
        result["interleaved"] = interleaved(load_baseline(commit), args.dp, args.numel,
                                            args.rounds)
        ok = result["interleaved"]["bitwise_identical"]
    if not args.skip_full:
        result["full"] = full_command(args.full_numel)
        ok = ok and result["full"]["exit_code"] == 0
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

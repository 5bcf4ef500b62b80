"""Wall time of ``verify run`` as it is (ranks forked from a preloaded server, two checks
at once) vs as it was (every rank spawned fresh, one check after another).

Runs the CLI in a subprocess per measurement, alternating the two settings
(before, after, after, before, ...) with the same seed, so that load from other
work on the machine falls on both alike. Every run must report the same
comparisons and expectations (labels, pass/fail, metrics), whatever the setting;
timing tables are not compared. Prints the per-round and median wall ratio
after/before and writes them under bench/results/ (JSON, and a short .txt beside it
with the same stem). The machine may be shared: the load average is recorded
before every run, and only the paired ratio means anything.

    python bench/bench_verify_run.py --rounds 2 [--quick] [--check pipeline ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
START_METHOD_VARIABLE = "VERIFY_RANK_START_METHOD"  # read by verify.distributed.RankLauncher
# setting -> (rank start method, --jobs)
SETTINGS = {"before": ("spawn", "1"), "after": ("forkserver", "2")}
METHODS = tuple(SETTINGS)


def _outcome(report: dict[str, Any]) -> list[Any]:
    """What must not depend on the start method: every comparison and expectation."""
    return [
        (check["name"], check["passed"], check["error"],
         [(c["label"], c["max_ulp_allowed"], c["passed"], c["metrics"]) for c in check["comparisons"]],
         [(e["label"], e["passed"]) for e in check["expectations"]])
        for check in report["checks"]
    ]


def _run_once(setting: str, verify_args: list[str]) -> tuple[float, list[Any], dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        method, jobs = SETTINGS[setting]
        env = {**os.environ, START_METHOD_VARIABLE: method,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "verify", "run", *verify_args, "--jobs", jobs,
                               "--no-plots", "--json", str(out)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - start
        if not out.exists():
            raise RuntimeError(f"verify run ({setting}) wrote no report (exit {proc.returncode}):\n"
                               f"{proc.stderr[-4000:]}")
        report = json.loads(out.read_text())
        seconds = report.get("timings", {}).get("checks", {})
        per_check = {c["name"]: {"passed": c["passed"], "seconds": round(seconds.get(c["name"], 0), 1)}
                     for c in report["checks"]}
        return wall, _outcome(report), per_check


def _text_summary(summary: dict[str, Any]) -> str:
    """The figures a reader wants, in a few lines (the JSON holds the rest)."""
    lines = [f"bench/bench_verify_run.py, started {summary['started']}, {summary['cpu_count']} CPUs, "
             f"verify run {' '.join(summary['verify_args'])}",
             "before: spawned ranks, --jobs 1; after: fork server, --jobs 2"]
    for k, ratio in enumerate(summary["ratio_after_over_before_per_round"]):
        lines.append(f"round {k}: before {summary['wall_s']['before'][k]:6.1f} s "
                     f"(load {summary['load_average_before_each_run']['before'][k]:.1f}), "
                     f"after {summary['wall_s']['after'][k]:6.1f} s "
                     f"(load {summary['load_average_before_each_run']['after'][k]:.1f}), "
                     f"ratio {ratio:.2f}")
    lines.append(f"median ratio after/before: {summary['median_ratio']:.2f}; every comparison and "
                 f"expectation identical across runs: {summary['results_identical']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Time ``rounds`` interleaved pairs; exit 1 if any run's results differ from the first."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="interleaved before/after pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--check", action="append", default=[], metavar="NAME")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "verify_run_cpu.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    verify_args = ["--seed", str(args.seed), *(["--quick"] if args.quick else []),
                   *[a for name in args.check for a in ("--check", name)]]
    walls: dict[str, list[float]] = {m: [] for m in METHODS}
    loads: dict[str, list[float]] = {m: [] for m in METHODS}  # 1-minute load average before each run
    checks: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    baseline_outcome = None
    identical = True
    for round_index in range(args.rounds):
        order = METHODS if round_index % 2 == 0 else METHODS[::-1]
        for method in order:
            loads[method].append(round(os.getloadavg()[0], 2))
            wall, outcome, per_check = _run_once(method, verify_args)
            walls[method].append(wall)
            checks[method].append(per_check)
            baseline_outcome = outcome if baseline_outcome is None else baseline_outcome
            same = outcome == baseline_outcome
            identical &= same
            failed = [name for name, c in per_check.items() if not c["passed"]]
            print(f"round {round_index}: {method:<10} {wall:7.1f} s  (load {loads[method][-1]:.1f})  results "
                  f"{'identical' if same else 'DIFFER'}; failed checks: {failed or 'none'}", flush=True)
    ratios = [a / b for a, b in zip(walls["after"], walls["before"], strict=True)]
    summary = {
        "started": started,
        "verify_args": verify_args,
        "cpu_count": os.cpu_count(),
        "load_average_before_each_run": loads,
        "load_average_at_end": os.getloadavg(),
        "wall_s": walls,
        "settings": {k: {"start_method": m, "jobs": int(j)} for k, (m, j) in SETTINGS.items()},
        "ratio_after_over_before_per_round": ratios,
        "median_ratio": statistics.median(ratios),
        "results_identical": identical,
        "per_check": checks,
    }
    print(f"wall ratio after/before: median {summary['median_ratio']:.2f} "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}); results identical: {identical}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    text = args.out.with_suffix(".txt")
    text.write_text(_text_summary(summary))
    print(f"wrote {args.out} and {text}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

"""``verify run`` on an oversubscribed machine: slow must never be an ERROR.

Starts ``--busy`` processes that spin in Python (``while True: pass``), waits for the
load to build, then runs the default ``verify run`` (all checks, ``--jobs 2``) with
today's code and, with ``--baseline COMMIT``, with that commit's code (taken with
``git archive``, run from a temporary directory), interleaved round by round. Each
run records its wall time, exit code, verdict, every check's status (and the first
line of any error) and the load average. It also measures what the stall rule
relies on under that load: the CPU share of a gloo rank blocked in a collective
for a peer that sleeps. The busy processes end with the script (and after
``--busy-limit`` seconds in any case).

    PYTHONPATH=$PWD python bench/bench_verify_run_loaded.py --busy 8 --baseline main \\
        --json bench/results/verify_run_loaded_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _commits import export_commit  # bench/ is on sys.path when a script runs

REPO = Path(__file__).resolve().parents[1]
BUSY = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_verify(label: str, root: Path, out_dir: Path) -> dict:
    """One default ``verify run`` with the code under ``root``."""
    report = out_dir / f"{label}.json"
    env = dict(os.environ, PYTHONPATH=str(root))
    before = load_average()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "verify", "run", "--no-plots", "--json",
                           str(report)], cwd=root, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    row = {"code": label, "seconds": round(seconds, 1), "exit_code": proc.returncode,
           "load_before": before, "load_after": load_average()}
    if report.exists():
        data = json.loads(report.read_text())
        row["verdict"] = data["verdict"]
        row["checks"] = {c["name"]: c["status"] for c in data["checks"]}
        row["errors"] = {c["name"]: c["error"].strip().splitlines()[-1][:300]
                         for c in data["checks"] if c.get("error")}
    else:
        row["stderr_tail"] = proc.stderr[-2000:]
    print(f"{label:<10} {seconds:7.1f} s  exit {proc.returncode}  {row.get('verdict', '-')}  "
          f"load {before} -> {row['load_after']}  {row.get('errors', '')}", flush=True)
    return row


def _sleeping_peer(rank: int, world_size: int, seconds: float) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    if rank == 1:
        time.sleep(seconds)
    cpu, wall = time.process_time(), time.monotonic()
    dist.all_reduce(torch.ones(2))
    return time.process_time() - cpu, time.monotonic() - wall


def blocked_rank_cpu_share(seconds: float = 20.0) -> dict:
    """CPU used by a gloo rank waiting ``seconds`` in all_reduce for a sleeping peer."""
    from verify.distributed import spawn
    from verify.distributed.stall import CPU_SHARE

    cpu, waited = spawn(_sleeping_peer, 2, seconds, timeout_s=4 * seconds)[0]
    row = {"waited_s": round(waited, 2), "cpu_s": round(cpu, 3),
           "share_of_a_core": round(cpu / waited, 4), "stall_rule_share": CPU_SHARE,
           "load": load_average()}
    print(f"gloo rank blocked in all_reduce {waited:.1f} s: {cpu:.3f} s CPU = "
          f"{100 * cpu / waited:.2f}% of a core (the stall rule counts >= "
          f"{100 * CPU_SHARE:.0f}% as computing), load {row['load']}", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=8, help="spinning processes beside the runs")
    parser.add_argument("--busy-limit", type=float, default=1800.0,
                        help="seconds after which the spinning processes end in any case")
    parser.add_argument("--baseline", metavar="COMMIT", help="also run this commit's code")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()} {os.cpu_count()} cpus (shared with other jobs)",
              "command": " ".join(sys.argv), "busy_processes": args.busy,
              "load_before_busy": load_average(), "runs": []}
    print(result["machine"], "load before the busy processes:", result["load_before_busy"])
    busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(limit=args.busy_limit)])
            for _ in range(args.busy)]
    try:
        time.sleep(10)  # let the load average climb
        with tempfile.TemporaryDirectory() as tmp:
            candidates = [("today", REPO)]
            if args.baseline:
                commit = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=REPO,
                                        check=True, capture_output=True, text=True).stdout.strip()
                candidates.append((f"baseline {commit}", export_commit(commit, Path(tmp))))
            for round_index in range(args.rounds):
                order = candidates if round_index % 2 == 0 else candidates[::-1]
                for label, root in order:
                    row = run_verify(label.split()[0], root, Path(tmp))
                    row["code"], row["round"] = label, round_index
                    result["runs"].append(row)
        result["blocked_gloo_rank"] = blocked_rank_cpu_share()
    finally:
        for proc in busy:
            proc.kill()
        for proc in busy:
            proc.wait()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r.get("verdict") == "PASS" for r in result["runs"] if r["code"] == "today") else 1


if __name__ == "__main__":
    sys.exit(main())

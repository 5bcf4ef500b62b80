"""Wall time of ``verify run`` now vs as it was at an earlier commit, on the checks both have.

``bench_verify_run.py`` compares two settings of today's code (fork server and two
checks at once, vs spawned ranks one check at a time); every speed-up of the checks
themselves lands on both sides there. This benchmark measures against the code
itself as it was, by default at the commit before the speed-up work began
(``eabf3b3``, where the default ``verify run`` took 47-49 s on the 2-core machine):
that commit is checked out into a temporary git worktree and run with the same
Python environment, interleaved with today's code (then, now, now, then, ...) with
the same seed and the same check names, so that load from other work falls on
both alike.

Today's checks may do more than then (cases added since): per check the benchmark
records whether every comparison and expectation of then is still made now, with
the same verdict (labels compared after ``LABEL_RENAMES``: user-facing wording
changed since), and how many each side made. The median of the per-round ratios
now/then is written under bench/results/ (JSON, and a short .txt beside it).

    python bench/bench_verify_run_vs_commit.py --rounds 2 [--commit REV]
    python bench/bench_verify_run_vs_commit.py --rounds 2 --commit b2d6e3e \
        --candidate fastgrad --candidate megatron-core --out bench/results/verify_run_two_candidates_cpu.json
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
DEFAULT_COMMIT = "eabf3b3"  # the parent of the fork-server commit (74ba575)
# Report labels reworded since the baseline commit: old wording -> new wording.
LABEL_RENAMES = (("seed example", "published example"), ("seed table", "published table"),
                 ("seed per-rank", "published per-rank"), ("seed copy-time", "published copy-time"))


def _normalized(label: str) -> str:
    for old, new in LABEL_RENAMES:
        label = label.replace(old, new)
    return label


def _checks_at(checkout: Path) -> list[str]:
    """The check names ``verify run --list`` prints in ``checkout``."""
    out = subprocess.run([sys.executable, "-m", "verify", "run", "--list"], cwd=checkout,
                         env=_env(checkout), capture_output=True, text=True, check=True, timeout=120)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _env(checkout: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(checkout)}


def _run(checkout: Path, checks: list[str], seed: int, now: bool,
         candidates: list[str]) -> tuple[float, dict[str, Any]]:
    """One ``verify run`` in ``checkout``: wall seconds and the JSON report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        extra = ["--no-plots"] if now else []  # the old CLI drew no plots and had no flag
        command = [sys.executable, "-m", "verify", "run", "--seed", str(seed), *extra,
                   *[a for name in checks for a in ("--check", name)],
                   *[a for name in candidates for a in ("--candidate", name)], "--json", str(out)]
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=checkout, env=_env(checkout), capture_output=True,
                              text=True, timeout=1800)
        wall = time.perf_counter() - start
        if not out.exists():
            raise RuntimeError(f"verify run in {checkout} wrote no report (exit {proc.returncode}):\n"
                               f"{proc.stderr[-4000:]}")
        return wall, json.loads(out.read_text())


def _records(check: dict[str, Any]) -> dict[str, set[tuple[str, bool]]]:
    return {kind: {(_normalized(c["label"]), bool(c["passed"])) for c in check[kind]}
            for kind in ("comparisons", "expectations")}


def _key(check: dict[str, Any]) -> str:
    """A result's name in the report: the check, and its candidate where it has one."""
    return check["name"] if not check.get("candidate") else f"{check['name']} [{check['candidate']}]"


def coverage(then: dict[str, Any], now: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per check: counts on each side, and whether then's records are all made now, alike."""
    now_by_name = {_key(c): c for c in now["checks"]}
    out = {}
    for old in then["checks"]:
        new = now_by_name[_key(old)]
        a, b = _records(old), _records(new)
        out[_key(old)] = {
            "passed": {"then": old["passed"], "now": new["passed"]},
            "comparisons": {"then": len(old["comparisons"]), "now": len(new["comparisons"])},
            "expectations": {"then": len(old["expectations"]), "now": len(new["expectations"])},
            "then_records_all_made_now_with_the_same_verdict": all(a[k] <= b[k] for k in a),
            "then_records_missing_now": sorted(label for k in a for label, _ in a[k] - b[k])[:20],
        }
    return out


def _text(summary: dict[str, Any]) -> str:
    lines = [f"bench/bench_verify_run_vs_commit.py, started {summary['started']}, "
             f"{summary['cpu_count']} CPUs; then: commit {summary['commit']}, now: "
             f"{summary['now_commit']}; checks: {' '.join(summary['checks'])}; candidates: "
             f"{' '.join(summary['candidates']) or 'the default'}"]
    for k, ratio in enumerate(summary["ratio_now_over_then_per_round"]):
        lines.append(f"round {k}: then {summary['wall_s']['then'][k]:6.1f} s "
                     f"(load {summary['load_average_before_each_run']['then'][k]:.1f}), "
                     f"now {summary['wall_s']['now'][k]:6.1f} s "
                     f"(load {summary['load_average_before_each_run']['now'][k]:.1f}), "
                     f"ratio {ratio:.2f}")
    lines.append(f"median ratio now/then: {summary['median_ratio']:.2f}")
    for name, c in summary["coverage"].items():
        lines.append(f"  {name}: comparisons {c['comparisons']['then']} -> {c['comparisons']['now']}, "
                     f"expectations {c['expectations']['then']} -> {c['expectations']['now']}; "
                     f"every earlier one still made, same verdict: "
                     f"{c['then_records_all_made_now_with_the_same_verdict']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Time ``rounds`` interleaved pairs; exit 1 if a check of then is not covered now."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="interleaved then/now pairs")
    parser.add_argument("--commit", default=DEFAULT_COMMIT, help="the earlier code (any git revision)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--candidate", action="append", default=[],
                        help="passed to both runs (repeatable); then the earlier verdicts are "
                             "reported, not required: a candidate's findings may be classified "
                             "differently now")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench" / "results" / "verify_run_vs_commit_cpu.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    now_commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                capture_output=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        then_dir = Path(tmp) / "then"
        subprocess.run(["git", "worktree", "add", "--detach", str(then_dir), args.commit], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            # With candidates: every check, as the user runs it (its --list prints candidates too).
            checks = [] if args.candidate else _checks_at(then_dir)
            walls: dict[str, list[float]] = {"then": [], "now": []}
            loads: dict[str, list[float]] = {"then": [], "now": []}
            started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
            reports: dict[str, dict[str, Any]] = {}
            for round_index in range(args.rounds):
                order = ("then", "now") if round_index % 2 == 0 else ("now", "then")
                for side in order:
                    loads[side].append(round(os.getloadavg()[0], 2))
                    wall, report = _run(then_dir if side == "then" else ROOT, checks, args.seed,
                                        now=side == "now", candidates=args.candidate)
                    walls[side].append(wall)
                    reports[side] = report
                    print(f"round {round_index}: {side:<4} {wall:7.1f} s (load {loads[side][-1]:.1f})",
                          flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(then_dir)], cwd=ROOT,
                           capture_output=True)
    ratios = [n / t for n, t in zip(walls["now"], walls["then"], strict=True)]
    covered = coverage(reports["then"], reports["now"])
    summary = {
        "started": started, "commit": args.commit, "now_commit": now_commit, "checks": checks,
        "candidates": args.candidate,
        "cpu_count": os.cpu_count(), "load_average_before_each_run": loads,
        "load_average_at_end": os.getloadavg(), "wall_s": walls,
        "ratio_now_over_then_per_round": ratios, "median_ratio": statistics.median(ratios),
        "coverage": covered,
    }
    text = _text(summary)
    print(text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    args.out.with_suffix(".txt").write_text(text)
    print(f"wrote {args.out} and {args.out.with_suffix('.txt')}")
    ok = all(c["then_records_all_made_now_with_the_same_verdict"] for c in covered.values())
    return 0 if ok or args.candidate else 1


if __name__ == "__main__":
    sys.exit(main())

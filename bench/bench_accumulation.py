"""``verify accumulation``: today's implementation against the one it replaced, interleaved.

The previous implementation (``verify/studies/reduce_scatter/growth.py`` at commit
``BASELINE_COMMIT``) is loaded from git history, never kept in the package. Each
case runs old and new alternately in one process, so load drift on a shared
machine hits both; the ratio new/old of the medians is printed with every point
of the two sweeps compared for bitwise equality. The sweeps run the old one's methods
(ring, tree, fp32) only: the same work timed, and every point has its counterpart.

    PYTHONPATH=$PWD python bench/bench_accumulation.py [--repeats 3] [--quick] [--json PATH]
    PYTHONPATH=$PWD python bench/bench_accumulation.py --rss      # peak RSS at two DPs
    PYTHONPATH=$PWD python bench/bench_accumulation.py --large    # one DP 65536 point, timed

``--large`` times ``verify accumulation --dp 65536 --numel 100000`` for one dtype and
distribution (the old code refuses DP > 8192); the full default dtypes x distributions
run is six such points.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved_times  # noqa: E402

from verify.metrics import bitwise_equal  # noqa: E402
from verify.studies.reduce_scatter import models, reference, sweep  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BASELINE_COMMIT = "eabf3b3"
BASELINE_PATH = "verify/studies/reduce_scatter/growth.py"


def load_baseline():
    """The replaced module, from git history, as a fresh module object."""
    source = subprocess.run(["git", "show", f"{BASELINE_COMMIT}:{BASELINE_PATH}"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "accumulation_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("accumulation_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _same_points(old_points, new_points) -> bool:
    def key(p):
        return tuple(
            ("nan" if isinstance(v, float) and math.isnan(v) else v)
            for v in dataclasses.astuple(p))
    return [key(p) for p in old_points] == [key(p) for p in new_points]


def bench_sweep(old, label: str, kwargs: dict, repeats: int) -> dict:
    """Both sweeps on the old one's methods: today's also measures methods the old never had
    (torch's compress hooks, FSDP2), and its point lists would differ by those alone."""
    kwargs = {**kwargs, "methods": old.METHODS}
    old_config, new_config = old.SweepConfig(**kwargs), sweep.SweepConfig(**kwargs)
    label = f"{label}, {'+'.join(old.METHODS)}"
    outputs = {}

    def run_old():
        outputs["old"] = old.run_sweep(old_config)

    def run_new():
        outputs["new"] = sweep.run_sweep(new_config)

    times = interleaved_times({"old": run_old, "new": run_new}, repeats, warmup=False)
    return _row(label, times, identical=_same_points(outputs["old"], outputs["new"]))


def bench_exactness_rule(old, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    stacked = models.generate("gradient", 1024, 8192, gen).to(torch.bfloat16)
    outputs = {}
    times = interleaved_times({
        "old": lambda: outputs.__setitem__("old", old.float64_sum_is_exact(stacked)),
        "new": lambda: outputs.__setitem__("new", reference.float64_sum_is_exact(stacked)),
    }, repeats)
    return _row("float64_sum_is_exact bf16 [1024 x 8192]", times,
                identical=bitwise_equal(outputs["old"], outputs["new"]))


def bench_ring(old, world_size: int, repeats: int) -> dict:
    # One generation block of today's sweep at this DP: 2^23 elements.
    chunk = 13
    chunks = max(1, 2**23 // (world_size * chunk))
    gen = torch.Generator().manual_seed(2)
    stacked = models.generate("normal", world_size, chunks * chunk, gen).to(torch.float16)
    outputs = {}
    times = interleaved_times({
        "old": lambda: outputs.__setitem__("old", old.ring_reduce(stacked, chunk, 5)),
        "new": lambda: outputs.__setitem__("new", models.ring_reduce(stacked, chunk, 5)),
    }, repeats)
    return _row(f"ring_reduce fp16 one block, W={world_size}", times,
                identical=bitwise_equal(outputs["old"], outputs["new"]))


def _row(label: str, times: dict, identical: bool) -> dict:
    old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
    row = {"case": label, "old_s": old_s, "new_s": new_s, "ratio_new_over_old": new_s / old_s,
           "bitwise_identical": identical, "old_all_s": times["old"], "new_all_s": times["new"]}
    print(f"{label:<56} old {old_s:8.3f}s  new {new_s:8.3f}s  new/old {new_s / old_s:5.2f}x  "
          f"identical={identical}", flush=True)
    return row


_RSS_CHILD = """
import resource, sys, time
from verify.studies.reduce_scatter import sweep
dp, numel = int(sys.argv[1]), int(sys.argv[2])
start = time.perf_counter()
sweep.run_sweep(sweep.SweepConfig(dp_sizes=(dp,), dtypes=("float16",),
                                  distributions=("normal",), numel=numel))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter() - start)
"""


def peak_rss(dp: int, numel: int) -> dict:
    """Peak RSS (MiB) of a fresh process running one (fp16, normal) point, all methods."""
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(dp), str(numel)], cwd=REPO,
                         check=True, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO))).stdout.split()
    row = {"dp": dp, "numel": numel, "input_elements": dp * numel,
           "peak_rss_mib": int(out[0]) / 1024, "seconds": float(out[1])}
    print(f"DP {dp:>6} numel {numel}: input {dp * numel / 2**20:8.1f} Mi elements, "
          f"peak RSS {row['peak_rss_mib']:7.1f} MiB, {row['seconds']:.1f}s", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sweep only")
    parser.add_argument("--rss", action="store_true", help="peak RSS at two DP sizes")
    parser.add_argument("--large", action="store_true", help="time one DP 65536 point")
    parser.add_argument("--large-numel", type=int, default=100_000)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": f"{platform.machine()} {os.cpu_count()} cpus (shared), torch "
                               f"{torch.__version__}, {torch.get_num_threads()} threads",
                    "command": " ".join(sys.argv), "rows": []}
    print(result["machine"])
    if args.rss:
        result["rss"] = [peak_rss(4096, 2**14), peak_rss(16384, 2**14)]
    elif args.large:
        config = sweep.SweepConfig(dp_sizes=(65536,), dtypes=("float16",),
                                   distributions=("normal",), numel=args.large_numel)
        start = time.perf_counter()
        (point, *_) = sweep.run_sweep(config)
        seconds = time.perf_counter() - start
        print(f"DP 65536, numel {args.large_numel}, fp16 normal, 3 methods: {seconds:.1f}s "
              f"(ring rel.err {point.rel_error:.3e})")
        result["large"] = {"numel": args.large_numel, "seconds": seconds}
    else:
        old = load_baseline()
        result["rows"].append(bench_exactness_rule(old, args.repeats))
        for world_size in (1024, 8192):
            result["rows"].append(bench_ring(old, world_size, args.repeats))
        if args.quick:
            kwargs = {"dp_sizes": (2, 64, 1024), "numel": 16384}
            result["rows"].append(bench_sweep(old, "sweep DP 2,64,1024 numel 16384", kwargs,
                                              args.repeats))
        else:
            result["rows"].append(bench_sweep(old, "default sweep (DP 2..1024)", {},
                                              args.repeats))
            result["rows"].append(bench_sweep(
                old, "DP 8192 fp16+bf16 normal", {"dp_sizes": (8192,),
                                                  "distributions": ("normal",)}, 1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if all(r["bitwise_identical"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())

"""How long a world with a raising rank takes to report the crash, in each multi-rank check.

For each check, its first multi-rank configuration runs through the check's own rank worker
(``spawn_each``, as the check runs it) with a fastgrad whose rank 1 raises in its first call
of the candidate, while the other ranks go on into the configuration's collectives and wait
for it there. The wall time from starting the world to holding the crash (the world started,
the fault raised, its peers stopped) is an upper bound on how long a raising rank takes to
reach the report; the same configuration with the healthy fastgrad is timed beside it,
interleaved, so the load of the moment falls on both. The stall timeout is 300 s: a harness
that waited for the stall would show here as minutes.

    python bench/bench_fail_fast.py [--rounds 3] [--out bench/results/fail_fast_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gradvocab import Averaging  # noqa: E402
from verify.candidates import FastgradCandidate  # noqa: E402
from verify.candidates.fastgrad.deferred_wgrad import FastgradDeferredWgrad  # noqa: E402
from verify.candidates.fastgrad.grad_reduction import (  # noqa: E402
    FastgradBucketReduction,
    FastgradGradReduction,
)
from verify.candidates.fastgrad.layout import FastgradLayout  # noqa: E402
from verify.candidates.fastgrad.optimizer import FastgradOptimizer  # noqa: E402
from verify.candidates.fastgrad.pipeline import FastgradPipeline  # noqa: E402
from verify.distributed import spawn_each  # noqa: E402

STALL_TIMEOUT_S = 300.0


def _on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("planted fault on rank 1")


@dataclass(frozen=True)
class _Layout(FastgradLayout):
    def build_buffer(self, params, config, *, dp_size, dp_group=None, averaging=Averaging.SUM):
        _on_rank_one()
        return super().build_buffer(params, config, dp_size=dp_size, dp_group=dp_group,
                                    averaging=averaging)


@dataclass(frozen=True)
class _Bucket(FastgradBucketReduction):
    def __call__(self, grads, *, group):
        _on_rank_one()
        return super().__call__(grads, group=group)


@dataclass(frozen=True)
class _Reduction(FastgradGradReduction):
    def bucket_reduction(self, config):
        return _Bucket(config)


@dataclass(frozen=True)
class _Wgrad(FastgradDeferredWgrad):
    def output_layer(self, weight, config, **kwargs):
        _on_rank_one()
        return super().output_layer(weight, config, **kwargs)


@dataclass(frozen=True)
class _Optimizer(FastgradOptimizer):
    def build(self, model, settings):
        _on_rank_one()
        return super().build(model, settings)


@dataclass(frozen=True)
class _Pipeline(FastgradPipeline):
    def train(self, case, grid, *, overlap, progress=None):
        _on_rank_one()
        return super().train(case, grid, overlap=overlap, progress=progress)


@dataclass(frozen=True)
class Raising(FastgradCandidate):
    def layout(self):
        return _Layout()

    def grad_reduction(self):
        return _Reduction()

    def deferred_wgrad(self):
        return _Wgrad()

    def optimizer(self):
        return _Optimizer()

    def pipeline(self):
        return _Pipeline()


def _worlds() -> dict[str, tuple]:
    """Per check: (rank worker, world size, its first multi-rank item, extra arguments)."""
    from dataclasses import asdict

    from verify.checks.deferred_wgrad.cases import build_cases
    from verify.checks.deferred_wgrad.worker import WorldItem
    from verify.checks.layout.worker import default_scenarios, reduce_worker
    from verify.checks.optim.cases import case_matrix
    from verify.checks.optim.worker import rank_worker, world_plans
    from verify.checks.pipeline.cases import build_phases
    from verify.checks.pipeline.worker import PipelineRun, pipeline_worker
    from verify.checks.reduce_scatter.buckets import bucket_worker
    from verify.checks.reduce_scatter.cases import bucket_cases

    tp2 = next(c for c in build_cases(quick=True) if c.tp == 2)
    case = build_phases(True, 0)[1][0][0]
    bucket = bucket_cases((3, 5))[0]
    (plan,) = world_plans(case_matrix(True), True, extras=False)
    return {
        "layout": (reduce_worker, 2, default_scenarios(2)[0], ()),
        "reduce_scatter": (bucket_worker, bucket.size, bucket, (0,)),
        "deferred_wgrad": (_deferred, 2, WorldItem("case", tuple(asdict(tp2).items())), (0,)),
        "pipeline": (pipeline_worker, case.world, PipelineRun(case, True), ()),
        "optim": (rank_worker, plan.world, plan, (0, [], None)),
    }


def _time(fn, world: int, item, candidate, extra: tuple) -> tuple[float, str]:
    start = time.perf_counter()
    (outcome,) = spawn_each(fn, world, [item], candidate, *extra, isolate=True,
                            timeout_s=STALL_TIMEOUT_S)
    wall = time.perf_counter() - start
    return wall, ("crash: " + outcome.crash.summary()) if outcome.crash else "finished"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fail_fast_cpu.json")
    args = parser.parse_args(argv)
    results: dict[str, dict] = {}
    for name, (fn, world, item, extra) in _worlds().items():
        crash_s, healthy_s, what = [], [], ""
        for _ in range(args.rounds):
            for candidate, sink in ((Raising(), crash_s), (FastgradCandidate(), healthy_s)):
                wall, text = _time(fn, world, item, candidate, extra)
                sink.append(wall)
                if isinstance(candidate, Raising):
                    what = text
        results[name] = {"world": world, "crash_s": crash_s, "healthy_s": healthy_s,
                         "median_crash_s": statistics.median(crash_s),
                         "median_healthy_s": statistics.median(healthy_s), "crash": what}
        print(f"{name:15s} W={world}: crash reported after {statistics.median(crash_s):5.2f} s "
              f"(median of {args.rounds}; healthy world {statistics.median(healthy_s):5.2f} s); "
              f"{what[:100]}", flush=True)
    summary = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "load_average": os.getloadavg(), "cpu_count": os.cpu_count(),
               "stall_timeout_s": STALL_TIMEOUT_S, "checks": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _deferred(rank: int, world: int, item, candidate, seed: int):
    """The deferred_wgrad worker with the candidate where the others take it."""
    from verify.checks.deferred_wgrad.worker import item_worker

    return item_worker(rank, world, item, seed, candidate)


if __name__ == "__main__":
    sys.exit(main())

"""Step time and exposed grad sync of a 1F1B pipeline, overlap_grad_reduce on against off, same run.

Usage: .venv/bin/python bench/bench_pipeline_overlap.py [--stages P] [--dp D] [--microbatches M]
       [--hidden H] [--layers L] [--steps S] [--buckets-per-stage K]

Spawns P*D gloo ranks (CPU). Both settings train the same model on the same
data; their gradients are checked bitwise equal before any time is printed,
so a faster wrong answer cannot be reported. Prints, per setting, the median
and best step time and exposed sync (step end minus the end of the last
compute on any rank) over the steps after the first, and the ratios
off / on. On an oversubscribed machine (fewer cores than ranks) the async
reduction competes with compute for the same cores: expect noise.
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    """Spawn the grid, check overlap on == off bitwise, print step and exposed-sync times."""
    from gradvocab import ParallelDims, summarize_step
    from refgrad.pipeline import LinearStackSpec, StepPlan
    from verify.candidates import FastgradCandidate
    from verify.candidates.interfaces import PipelineCase
    from verify.checks.pipeline.worker import PipelineRun, pipeline_worker
    from verify.distributed import spawn
    from verify.metrics import bitwise_equal

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4, help="Linear layers per stage")
    parser.add_argument("--microbatch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--buckets-per-stage", type=int, default=4)
    args = parser.parse_args()
    for name in ("stages", "dp", "microbatches", "hidden", "layers", "microbatch_size",
                 "buckets_per_stage"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warm-up)")

    spec = LinearStackSpec(num_stages=args.stages, layers_per_stage=args.layers,
                           hidden=args.hidden, microbatch_size=args.microbatch_size)
    layer_numel = args.hidden * args.hidden + args.hidden
    bucket_size = max(1, args.layers * layer_numel // args.buckets_per_stage)
    case = PipelineCase("bench", ParallelDims(pp_size=args.stages, dp_size=args.dp), spec,
                        tuple(StepPlan(args.microbatches) for _ in range(args.steps)),
                        bucket_size=bucket_size, timing=True)
    # One launch per overlap setting, every rank's RankResult (the pipeline worker's one run).
    ranks = {overlap: spawn(pipeline_worker, args.stages * args.dp, PipelineRun(case, overlap),
                            FastgradCandidate())
             for overlap in (True, False)}
    for overlap, results in ranks.items():
        unsupported = [r for r in results if isinstance(r, str)]
        if unsupported:
            raise SystemExit(f"fastgrad cannot run the case (overlap {overlap}): {unsupported[0]}")

    for step in range(args.steps):
        for on, off in zip(ranks[True], ranks[False]):
            for name in on.grads[step]:
                if not bitwise_equal(on.grads[step][name], off.grads[step][name]):
                    raise SystemExit(f"overlap on and off disagree: step {step}, {name}")

    summary = {}
    for overlap in (True, False):
        reports = []
        for step in range(1, args.steps):
            events = [e for r in ranks[overlap] for e in r.events[step]]
            reports.append(summarize_step(events))
        summary[overlap] = reports
    print(f"1F1B P={args.stages} D={args.dp} M={args.microbatches} hidden={args.hidden} "
          f"layers/stage={args.layers} buckets/stage~{args.buckets_per_stage}, "
          f"{args.steps - 1} timed steps")
    print(f"{'overlap':<8} {'median step ms':>15} {'best step ms':>13} {'median exposed ms':>18} "
          f"{'bubble':>7}")
    medians = {}
    for overlap, reports in summary.items():
        step_ms = statistics.median(r.step_time for r in reports) * 1e3
        exposed_ms = statistics.median(r.exposed_grad_sync for r in reports) * 1e3
        medians[overlap] = (step_ms, exposed_ms)
        print(f"{'on' if overlap else 'off':<8} {step_ms:>15.3f} "
              f"{min(r.step_time for r in reports) * 1e3:>13.3f} {exposed_ms:>18.3f} "
              f"{statistics.median(r.bubble_fraction for r in reports):>7.3f}")
    print(f"ratio off/on: step {medians[False][0] / medians[True][0]:.3f}, exposed sync "
          f"{medians[False][1] / max(medians[True][1], 1e-9):.3f}")


if __name__ == "__main__":
    main()

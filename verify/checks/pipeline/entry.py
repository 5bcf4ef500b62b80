"""The pipeline check's run function and its registration."""

from __future__ import annotations

from typing import Any

from refgrad.pipeline import (
    reference_training,
)
from verify.candidates.api import Behaviour, Candidate, Technique
from verify.check import Check, CheckContext, CheckRecorder
from verify.checks.pipeline.cases import build_phases
from verify.checks.pipeline.report import (
    bucket_count_expectation,
    collect,
    concat,
    differing_steps,
    flatten_losses,
    flatten_named,
    has_timelines,
    interleaved_enable_report,
    large_dp_report,
    site_counts,
    timeline_rows,
    timing_report,
)
from verify.checks.pipeline.worker import Raised, pipeline_worker


def _unsupported(case_name: str, ranks: list[dict]) -> str | None:
    """Why the candidate could not run the case (every rank says the same), or None."""
    reasons = {r[case_name] for r in ranks if isinstance(r.get(case_name), str)}
    return " / ".join(sorted(reasons)) if reasons else None


def _raised(case_name: str, ranks: list[dict]) -> str | None:
    """What the candidate raised in the case, per rank, or None."""
    raised = [f"rank {k}: {r[case_name].detail}" for k, r in enumerate(ranks)
              if isinstance(r.get(case_name), Raised)]
    return "; ".join(raised) if raised else None


def _step_errors(rec: CheckRecorder, tag: str, results: list) -> None:
    """What a candidate reports beyond the numbers. A step it raised in and finished anyway
    fails the case here (its other comparisons still run: what the failed step left is
    compared too); where it observes when the deferred output layer was drained, a drain
    into a bucket whose reduction was already in flight fails (the wgrads race the reduction)."""
    errors = [f"stage {res.stage} DP rank {res.dp_rank}: {error}"
              for res in results for error in res.errors]
    if errors:
        rec.expect(f"{tag}: every step runs", False, "; ".join(errors[:4]))
    if any(seen is not None for res in results for seen in res.drained_in_flight):
        late = [f"stage {res.stage} DP rank {res.dp_rank} step {step}" for res in results
                for step, in_flight in enumerate(res.drained_in_flight) if in_flight]
        rec.expect(f"{tag}: the deferred output-layer wgrads were drained before their bucket's "
                   "reduction was launched", not late,
                   f"drained into a bucket with its reduction in flight: {', '.join(late[:6])}")


def run(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """The ``pipeline`` check against ``candidate``'s pipeline training (default: fastgrad)."""
    from verify.distributed import spawn

    world, phases = build_phases(ctx.quick, ctx.seed)
    ranks = spawn(pipeline_worker, world, candidate, phases, timeout_s=ctx.timeout_s)
    table = []
    timing_rows: list[list[Any]] = []
    for phase in phases:
        for case in phase:
            why = _unsupported(case.name, ranks)
            if why is not None:
                rec.skip(f"{case.name}: {why}")
                continue
            raised = _raised(case.name, ranks)
            if raised is not None:
                rec.expect(f"{case.name}: runs", False, raised)
                continue
            if case.timing:
                on, off = collect(case, ranks, True), collect(case, ranks, False)
                for overlap, got in ((True, on), (False, off)):
                    _step_errors(rec, f"{case.name}, overlap {'on' if overlap else 'off'}",
                                 got["ranks"])
                rec.compare(f"{case.name}: grads overlap on vs off",
                            flatten_named(off["grads"], sorted(off["grads"][0][0])),
                            flatten_named(on["grads"], sorted(on["grads"][0][0])))
                if has_timelines(case, ranks):
                    timing_report(rec, case, ranks)
                else:
                    rec.skip(f"{case.name}: {candidate.label} recorded no timelines (no "
                             "simulator comparison)")
                continue
            reduction = case.reduction
            if case.dp_size > 2 and not case.reduce_scatter_with_fp32_accumulation:
                for overlap in (True, False):
                    _step_errors(rec, f"{case.name}, overlap {'on' if overlap else 'off'}",
                                 collect(case, ranks, overlap)["ranks"])
                large_dp_report(rec, case, ranks)
                table.append([case.name, case.pp_size, case.dp_size,
                              ",".join(str(p.num_microbatches) for p in case.plans),
                              reduction + " (ULP report)", "no"])
                timing_rows.extend(timeline_rows(case, ranks))
                continue
            ref = reference_training(case.spec, case.plans, case.dp_size, lr=case.lr, reduction=reduction)
            names = sorted(ref.grads[0])
            ref_losses = flatten_losses(ref.losses)
            ref_grads = concat([ref.grads[s][n] for s in range(len(case.plans))
                                 for _ in range(case.dp_size) for n in names])
            ref_params = concat([ref.params[s][n] for s in range(len(case.plans))
                                  for _ in range(case.dp_size) for n in names])
            for overlap in (True, False):
                got = collect(case, ranks, overlap)
                tag = f"{case.name}, overlap {'on' if overlap else 'off'}"
                _step_errors(rec, tag, got["ranks"])
                rec.compare(f"{tag}: losses vs refgrad", ref_losses, flatten_losses(got["losses"]))
                if not rec.compare(f"{tag}: reduced grads vs refgrad", ref_grads,
                                   flatten_named(got["grads"], names)):
                    rec.finding(f"{tag}: {differing_steps(ref.grads, got)}")
                rec.compare(f"{tag}: params after SGD vs refgrad", ref_params,
                            flatten_named(got["params"], names))
                _launch_expectations(rec, tag, got["ranks"], overlap)
                _relearn_expectation(rec, tag, case.pp_size, got["ranks"], candidate)
                documented = candidate.documented(Behaviour.ONE_BUCKET_AFTER_FIRST_STAGE)
                if documented is not None:  # where production's bucket rule departs from refgrad
                    bucket_count_expectation(rec, tag, case, got["ranks"], overlap, documented)
                if case.virtual_stages > 1:
                    interleaved_enable_report(rec, tag, case, got["ranks"], overlap)
            table.append([case.name, case.pp_size, case.dp_size,
                          ",".join(str(p.num_microbatches) for p in case.plans),
                          reduction, "yes" if case.use_distributed_optimizer else "no"])
            timing_rows.extend(timeline_rows(case, ranks))
    rec.table("timelines per configuration (step 3, M=P; tiny layers: overhead-dominated, ms)",
              ["case", "overlap", "M", "step", "bubble", "exposed sync", "sync wait"], timing_rows,
              notes=["exposed sync = step end - end of the last compute on any rank"])
    rec.table(f"pipeline cases (bitwise: {candidate.label} overlap on, off and refgrad)",
              ["case", "P", "D", "M per step", "reduction", "dist. optimizer"], table,
              notes=["a parameter of the last stage is frozen in step 3 and unfrozen in step 4"])


def _launch_expectations(rec: CheckRecorder, tag: str, results: list, overlap: bool) -> None:
    """Where the buckets launched: with overlap, after the first batch (which learns what each
    bucket waits for) never in finish_grad_sync; without overlap, always there."""
    sites = [res.launch_sites for res in results]
    if overlap:
        early = all(s != "finish" for per_rank in sites for step in per_rank[1:] for s in step)
        rec.expect(f"{tag}: after the first batch every bucket launched before finish_grad_sync",
                   early, site_counts(sites))
    else:
        rec.expect(f"{tag}: without overlap every bucket is reduced in finish_grad_sync",
                   all(s == "finish" for per_rank in sites for step in per_rank for s in step),
                   site_counts(sites))


def _relearn_expectation(rec: CheckRecorder, tag: str, pp_size: int, results: list,
                         candidate: Candidate) -> None:
    """Only the last stage owns the frozen parameter: it relearns on freeze and unfreeze."""
    if any(res.relearn_count is None for res in results):
        rec.skip(f"{tag}: {candidate.label} reports no count of relearning which params each "
                 "bucket waits for")
        return
    relearns = sorted((res.stage, res.relearn_count) for res in results)
    expected = sorted((res.stage, 2 if res.stage == pp_size - 1 else 0) for res in results)
    rec.expect(f"{tag}: freezing then unfreezing a parameter relearned the counts "
               "twice on its stage only", relearns == expected,
               f"(stage, relearn count) per rank: {relearns}")


CHECK = Check(
    name="pipeline",
    summary="1F1B with grad sync in the cooldown bubble: overlap on = off = refgrad, bitwise",
    run=run,
    technique=Technique.PIPELINE,
    spawns_ranks=True,
)

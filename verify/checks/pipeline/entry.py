"""The pipeline check's run function and its registration."""

from __future__ import annotations

from typing import Any

from gradvocab import RankResult
from refgrad.pipeline import (
    reference_training,
)
from verify.attribution import case_launch_settings
from verify.candidates.interfaces import (
    Behaviour,
    Candidate,
    LaunchSettings,
    PipelineCase,
    Technique,
)
from verify.check import Check, CheckContext, CheckRecorder, launcher_for
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
from verify.checks.pipeline.worker import PipelineRun, pipeline_worker
from verify.distributed import ItemOutcome, spawn_each


def case_settings(case: PipelineCase, overlap: bool) -> LaunchSettings:
    """The Megatron-LM settings a pipeline case stands for (fp32 params and grads)."""
    return case_launch_settings(case, overlap)


def _step_errors(rec: CheckRecorder, tag: str, results: list) -> None:
    """What a candidate reports beyond the numbers: a step it raised in and finished anyway,
    and, where it observes when the deferred output layer was drained, a drain into a bucket
    whose reduction was already in flight (the wgrads race the reduction)."""
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


def _train_all(ctx: CheckContext, candidate: Candidate, runs: list[PipelineRun]
               ) -> dict[tuple[str, bool], ItemOutcome]:
    """Every run, each on a world that is its case's grid: fresh processes per run for a
    candidate that keeps process-wide state, else one world per grid size until a crash."""
    launcher = launcher_for(candidate)
    outcomes: dict[tuple[str, bool], ItemOutcome] = {}
    for size in dict.fromkeys(run.case.world for run in runs):
        group = [run for run in runs if run.case.world == size]
        for run, outcome in zip(group, spawn_each(
                pipeline_worker, size, group, candidate,
                isolate=candidate.isolates_configurations, timeout_s=ctx.timeout_s,
                launcher=launcher), strict=True):
            outcomes[(run.case.name, run.overlap)] = outcome
    return outcomes


def _trained(rec: CheckRecorder, candidate: Candidate, case: PipelineCase,
             outcomes: dict[tuple[str, bool], ItemOutcome]) -> dict[bool, list[RankResult]]:
    """The case's runs that finished, by overlap; a crash is recorded as the run's case, and
    what the candidate cannot run as one skip."""
    trained: dict[bool, list[RankResult]] = {}
    reasons: set[str] = set()
    for overlap in (True, False):
        label = PipelineRun(case, overlap).label
        outcome = outcomes[(case.name, overlap)]
        if outcome.crash is not None:
            with rec.case(label, case_settings(case, overlap)):
                rec.crash(label, outcome.crash, candidate)
            continue
        unsupported = {r for r in outcome.results if isinstance(r, str)}
        if unsupported:
            reasons |= unsupported
            continue
        trained[overlap] = outcome.results
    if reasons:
        rec.skip(f"{case.name}: {' / '.join(sorted(reasons))}")
    return trained


def run(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """The ``pipeline`` check against ``candidate``'s pipeline training (default: fastgrad)."""
    phases = build_phases(ctx.quick, ctx.seed)[1]
    cases = [case.at(0) for phase in phases for case in phase]
    outcomes = _train_all(ctx, candidate, [PipelineRun(case, overlap) for case in cases
                                           for overlap in (True, False)])
    table: list[list[Any]] = []
    timing_rows: list[list[Any]] = []
    for case in cases:
        trained = _trained(rec, candidate, case, outcomes)
        if not trained:
            continue
        # The report helpers read results as [world rank] -> {case: {overlap: RankResult}}.
        ranks = [{case.name: {overlap: results[r] for overlap, results in trained.items()}}
                 for r in range(case.world)]
        if case.timing or (case.dp_size > 2 and not case.reduce_scatter_with_fp32_accumulation):
            _overlap_only_case(rec, candidate, case, ranks, trained, table, timing_rows)
            continue
        _bitwise_case(rec, candidate, case, ranks, trained)
        table.append([case.name, case.pp_size, case.dp_size,
                      ",".join(str(p.num_microbatches) for p in case.plans),
                      case.reduction, "yes" if case.use_distributed_optimizer else "no"])
        if len(trained) == 2:
            timing_rows.extend(timeline_rows(case, ranks))
    rec.table("timelines per configuration (step 3, M=P; tiny layers: overhead-dominated, ms)",
              ["case", "overlap", "M", "step", "bubble", "exposed sync", "sync wait"], timing_rows,
              notes=["exposed sync = step end - end of the last compute on any rank"])
    rec.table(f"pipeline cases (bitwise: {candidate.label} overlap on, off and refgrad)",
              ["case", "P", "D", "M per step", "reduction", "dist. optimizer"], table,
              notes=["a parameter of the last stage is frozen in step 3 and unfrozen in step 4"])


def _overlap_only_case(rec: CheckRecorder, candidate: Candidate, case: PipelineCase,
                       ranks: list[dict], trained: dict[bool, list[RankResult]],
                       table: list[list[Any]], timing_rows: list[list[Any]]) -> None:
    """The timing case and D > 2 without an order-fixed reduction: gloo picks the summation
    order, so each run is held to overlap on vs off (and, at D > 2, step 0 to the exact sum's
    bound) rather than to refgrad bitwise."""
    for overlap in trained:
        tag = PipelineRun(case, overlap).label
        with rec.case(tag, case_settings(case, overlap)):
            _step_errors(rec, tag, collect(case, ranks, overlap)["ranks"])
    if len(trained) < 2:
        rec.skip(f"{case.name}: overlap on vs off needs both runs")
        return
    if case.timing:
        on, off = collect(case, ranks, True), collect(case, ranks, False)
        rec.compare(f"{case.name}: grads overlap on vs off",
                    flatten_named(off["grads"], sorted(off["grads"][0][0])),
                    flatten_named(on["grads"], sorted(on["grads"][0][0])))
        if has_timelines(case, ranks):
            timing_report(rec, case, ranks)
        else:
            rec.skip(f"{case.name}: {candidate.label} recorded no timelines (no simulator "
                     "comparison)")
        return
    large_dp_report(rec, case, ranks)
    table.append([case.name, case.pp_size, case.dp_size,
                  ",".join(str(p.num_microbatches) for p in case.plans),
                  case.reduction + " (ULP report)", "no"])
    timing_rows.extend(timeline_rows(case, ranks))


def _bitwise_case(rec: CheckRecorder, candidate: Candidate, case: PipelineCase,
                  ranks: list[dict], trained: dict[bool, list[RankResult]]) -> None:
    """Each run held to refgrad's training bitwise: losses, reduced grads, params after SGD,
    where the buckets launched, relearning, bucket counts and the interleaved enables."""
    ref = reference_training(case.spec, case.plans, case.dp_size, lr=case.lr,
                             reduction=case.reduction)
    names = sorted(ref.grads[0])
    ref_losses = flatten_losses(ref.losses)
    ref_grads = concat([ref.grads[s][n] for s in range(len(case.plans))
                        for _ in range(case.dp_size) for n in names])
    ref_params = concat([ref.params[s][n] for s in range(len(case.plans))
                         for _ in range(case.dp_size) for n in names])
    for overlap in trained:
        got = collect(case, ranks, overlap)
        tag = PipelineRun(case, overlap).label
        with rec.case(tag, case_settings(case, overlap)):
            _step_errors(rec, tag, got["ranks"])
            rec.compare(f"{tag}: losses vs refgrad", ref_losses, flatten_losses(got["losses"]))
            if not rec.compare(f"{tag}: reduced grads vs refgrad", ref_grads,
                               flatten_named(got["grads"], names)):
                rec.note(f"{tag}: {differing_steps(ref.grads, got)}")
            rec.compare(f"{tag}: params after SGD vs refgrad", ref_params,
                        flatten_named(got["params"], names))
            _launch_expectations(rec, tag, got["ranks"], overlap)
            _relearn_expectation(rec, tag, case.pp_size, got["ranks"], candidate)
            documented = candidate.documented(Behaviour.ONE_BUCKET_AFTER_FIRST_STAGE)
            if documented is not None:  # where production's bucket rule departs from refgrad
                bucket_count_expectation(rec, tag, case, got["ranks"], overlap, documented)
            if case.virtual_stages > 1:
                interleaved_enable_report(rec, tag, case, got["ranks"], overlap)


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

"""The pipeline check's candidate, its run function and its registration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from refgrad.pipeline import (
    reference_training,
)
from verify.check import Check, CheckContext, CheckRecorder
from verify.checks.pipeline.cases import FAULTS, build_phases
from verify.checks.pipeline.report import (
    collect,
    concat,
    flatten_losses,
    flatten_named,
    interleaved_enable_report,
    large_dp_report,
    site_counts,
    timeline_rows,
    timing_report,
)
from verify.checks.pipeline.worker import pipeline_worker


@dataclass(frozen=True)
class PipelineCandidate:
    """The pipeline implementation under test: fastgrad's DDP and 1F1B schedules, run as is
    (``fault=None``) or with one of the known faults of ``FAULTS`` injected (a broken
    candidate the check must catch)."""

    fault: str | None = None

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"PipelineCandidate.fault must be one of {FAULTS}, got {self.fault!r}")

    @classmethod
    def default(cls) -> PipelineCandidate:
        """fastgrad as is."""
        return cls()


def run(ctx: CheckContext, rec: CheckRecorder, candidate: PipelineCandidate) -> None:
    """The ``pipeline`` check against ``candidate`` (default: fastgrad as is)."""
    from verify.distributed import spawn

    world, phases = build_phases(ctx.quick, ctx.seed, candidate.fault)
    ranks = spawn(pipeline_worker, world, phases, timeout_s=ctx.timeout_s)
    table = []
    timing_rows: list[list[Any]] = []
    for phase in phases:
        for case in phase:
            if case.timing:
                on, off = collect(case, ranks, True), collect(case, ranks, False)
                rec.compare(f"{case.name}: grads overlap on vs off",
                            flatten_named(off["grads"], sorted(off["grads"][0][0])),
                            flatten_named(on["grads"], sorted(on["grads"][0][0])))
                timing_report(rec, case, ranks)
                continue
            reduction = case.reduction
            if case.dp_size > 2 and not case.reduce_scatter_with_fp32_accumulation:
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
                rec.compare(f"{tag}: losses vs refgrad", ref_losses, flatten_losses(got["losses"]))
                rec.compare(f"{tag}: reduced grads vs refgrad", ref_grads,
                            flatten_named(got["grads"], names))
                rec.compare(f"{tag}: params after SGD vs refgrad", ref_params,
                            flatten_named(got["params"], names))
                sites = [res.launch_sites for res in got["ranks"]]
                if overlap:
                    # Step 0 learns the counts; later steps launch from hooks/dispatch only.
                    early = all(s != "finish" for per_rank in sites for step in per_rank[1:] for s in step)
                    rec.expect(f"{tag}: after the first batch every bucket launched before finish_grad_sync",
                               early, site_counts(sites))
                else:
                    rec.expect(f"{tag}: without overlap every bucket is reduced in finish_grad_sync",
                               all(s == "finish" for per_rank in sites for step in per_rank for s in step),
                               site_counts(sites))
                # Only the last stage owns the frozen parameter: it relearns on freeze and unfreeze.
                relearns = sorted((res.stage, res.relearn_count) for res in got["ranks"])
                expected = sorted((res.stage, 2 if res.stage == case.pp_size - 1 else 0)
                                  for res in got["ranks"])
                rec.expect(f"{tag}: freezing then unfreezing a parameter relearned the counts "
                           "twice on its stage only", relearns == expected,
                           f"(stage, relearn count) per rank: {relearns}")
                if case.virtual_stages > 1:
                    interleaved_enable_report(rec, tag, case, got["ranks"], overlap)
            table.append([case.name, case.pp_size, case.dp_size,
                          ",".join(str(p.num_microbatches) for p in case.plans),
                          reduction, "yes" if case.use_distributed_optimizer else "no"])
            timing_rows.extend(timeline_rows(case, ranks))
    rec.table("timelines per configuration (step 3, M=P; tiny layers: overhead-dominated, ms)",
              ["case", "overlap", "M", "step", "bubble", "exposed sync", "sync wait"], timing_rows,
              notes=["exposed sync = step end - end of the last compute on any rank"])
    rec.table("pipeline cases (bitwise: fastgrad overlap on, off and refgrad)",
              ["case", "P", "D", "M per step", "reduction", "dist. optimizer"], table,
              notes=["a parameter of the last stage is frozen in step 3 and unfrozen in step 4"])


CHECK = Check(
    name="pipeline",
    summary="1F1B with grad sync in the cooldown bubble: overlap on = off = refgrad, bitwise",
    run=run,
    default_candidate=PipelineCandidate.default(),
    spawns_ranks=True,
)

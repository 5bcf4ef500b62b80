"""The layout check's run function and the report glue."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from gradvocab import default_bucket_size
from refgrad.layout import compute_layout as reference_layout
from verify.candidates import Behaviour, Candidate, Technique, Unsupported
from verify.candidates.interfaces import BucketLayout, LayoutCase
from verify.check import Check, CheckContext, CheckRecorder, run_part
from verify.checks.layout.buffers import AlignmentFact, buffer_violations
from verify.checks.layout.cases import (
    HAND_CASES,
    compare_layouts,
    ddp_layout_of,
    hand_case_mismatch,
    random_case,
)
from verify.checks.layout.invariants import layout_violations, unpadded_bucket_violations
from verify.checks.layout.trained import check_parameter_shards, check_watched
from verify.checks.layout.worker import ScenarioResult, default_scenarios, run_reduce_scenarios
from verify.studies import layout as layout_report

# --------------------------------------------------------------------------- the check


@dataclass(frozen=True)
class _Options:
    random_cases: int
    big_params: int
    spawn_ranks: tuple[int, ...] = field(default=())


def run(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """The ``layout`` check against ``candidate``'s bucket layout and buffers."""
    options = _Options(
        random_cases=300 if ctx.quick else 3000,
        big_params=10_000 if ctx.quick else 100_000,
        spawn_ranks=() if ctx.quick else (2, 3),
    )
    _run(ctx, rec, candidate, options)


def _run(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate, options: _Options) -> None:
    # Unsupported from the accessor: nothing of the candidate can run (SKIP).
    candidate.layout()
    # Parts 1-4 and 6 in one process (this one for a candidate without process-wide state).
    run_part(ctx, rec, candidate, _inspect, options)
    # 5. Real reductions across ranks (each scenario in its own world); a DDP watched while it
    # trains, parameters sharded one by one (where the candidate has them).
    check_watched(rec, candidate, ctx.quick, ctx.seed, ctx.timeout_s)
    check_parameter_shards(rec, candidate, ctx.quick, ctx.timeout_s)
    if options.spawn_ranks:
        for world_size in options.spawn_ranks:
            record_reduce_scenarios(rec, run_reduce_scenarios(
                world_size, default_scenarios(world_size), candidate, timeout_s=ctx.timeout_s),
                candidate)
    else:
        rec.skip("multi-rank reduce-scatter through the buffers runs only without --quick")


def _inspect(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate, options: _Options) -> None:
    """Parts 1-4 (the candidate's layouts and buffers) and 6 (the padding report and the
    published worked examples), inside the candidate's layout scope."""
    with candidate.layout() as layout:
        _single_process_parts(ctx, rec, candidate, layout, options)
        _report(ctx, rec, layout, candidate)


def record_reduce_scenarios(rec: CheckRecorder, results: list[ScenarioResult],
                            candidate: Candidate) -> None:
    """Each scenario as a case: its crash, its skip, or its iterations' expectations."""
    missing: dict[str, None] = {}
    for result in results:
        if result.skipped is not None:
            rec.skip(f"{result.label}: skipped: {result.skipped}")
            continue
        with rec.case(result.label, result.settings):
            if result.crash is not None:
                rec.crash(result.label, result.crash, candidate)
                continue
            for label, passed, detail in result.checks:
                rec.expect(label, passed, detail)
        missing.update(dict.fromkeys(result.missing))
    for reason in missing:
        rec.skip(f"buffer helpers: {reason}")


def _single_process_parts(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate,
                          layout: BucketLayout, options: _Options) -> None:
    """Parts 1-4: hand-derived, random and large layouts, and the buffers on ``ctx.device``."""
    # 1. Hand-derived layouts.
    _hand_derived(rec, layout, candidate)
    # 2. Random layouts: candidate == refgrad, invariants, shard coverage.
    with rec.skip_if_unsupported():
        _random_layouts(ctx, rec, layout, options.random_cases, candidate)
    # 3. A large model: many params, exact agreement.
    with rec.skip_if_unsupported():
        big_rng = random.Random(ctx.seed + 17)
        big = [big_rng.choice((64, 4096, big_rng.randint(1, 10**6))) for _ in range(options.big_params)]
        case = LayoutCase(tuple(big), dp_size=48, bucket_size=40_000_000,
                          use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=True,
                          shared_embedding=(0, options.big_params - 1))
        (cand,) = layout.layouts([case])
        expect_layout(rec, f"{options.big_params} params: candidate == refgrad", case, cand, candidate)
    # 4. The buffers on the context's device.
    with rec.skip_if_unsupported():
        missing: list[str] = []
        # A candidate that leaves its buffers' addresses to the allocator is held to 64-element
        # offsets from each buffer's start (its model); the memory alignment is reported apart.
        documented = candidate.documented(Behaviour.BUFFER_ALIGNMENT_FROM_ALLOCATOR)
        alignment: list[AlignmentFact] | None = [] if documented is not None else None
        problems = buffer_violations(ctx.device, layout, ctx.seed, unsupported=missing,
                                     alignment=alignment)
        rec.expect(f"ParamAndGradBuffer views/alignment/padding on {ctx.device}", not problems,
                   "; ".join(problems[:5]))
        if alignment is not None:
            unaligned = [f.view for f in alignment if not f.in_memory]
            off_grid = [f.view for f in alignment if not f.from_buffer_start]
            rec.expect_documented(
                f"ParamAndGradBuffer param views 64-element aligned in memory on {ctx.device}",
                not unaligned, documented=documented, documented_holds=not off_grid,
                detail=(f"{len(unaligned)} of {len(alignment)} views not aligned in memory "
                        f"({'; '.join(unaligned[:3])}); {len(off_grid)} not at a 64-element "
                        f"offset from their buffer's start"))
        for reason in dict.fromkeys(missing):
            rec.skip(f"buffer helpers: {reason}")


def expect_layout(rec: CheckRecorder, label: str, case: LayoutCase, cand, candidate: Candidate) -> None:
    """The candidate's layout of ``case`` is refgrad's; where the candidate documents torch
    DDP's buckets, it is held to refgrad's model of them instead (``ddp_layout_of``)."""
    diff = compare_layouts(reference_layout(list(case.numels), **case.refgrad_kwargs()), cand)
    documented = candidate.documented(Behaviour.DDP_BUCKETS)
    modelled = None if documented is None else not compare_layouts(ddp_layout_of(case), cand)
    rec.expect_documented(label, not diff, documented=documented, documented_holds=modelled,
                          detail=diff)


def _hand_derived(rec: CheckRecorder, layout: BucketLayout, candidate: Candidate) -> None:
    """Each hand-derived case laid out by refgrad and by the candidate (held to refgrad's
    model of its buckets where it documents DDP's)."""
    try:
        candidate_layouts = layout.layouts([case.case() for case in HAND_CASES])
    except Unsupported as unsupported:
        rec.skip(str(unsupported))
        candidate_layouts = None
    for k, case in enumerate(HAND_CASES):
        mismatch = hand_case_mismatch(case, reference_layout(list(case.numels), **case.kwargs()))
        rec.expect(f"hand-derived (refgrad): {case.name}", not mismatch, mismatch)
        if candidate_layouts is not None:
            mismatch = hand_case_mismatch(case, candidate_layouts[k])
            documented = candidate.documented(Behaviour.DDP_BUCKETS)
            modelled = None if documented is None else not compare_layouts(
                ddp_layout_of(case.case()), candidate_layouts[k])
            rec.expect_documented(f"hand-derived (candidate): {case.name}", not mismatch,
                                  documented=documented, documented_holds=modelled, detail=mismatch)


def _random_layouts(ctx: CheckContext, rec: CheckRecorder, layout: BucketLayout, count: int,
                    candidate: Candidate) -> None:
    rng = random.Random(ctx.seed * 7919 + 4)
    cases = [random_case(rng) for _ in range(count)]
    documented = candidate.documented(Behaviour.DDP_BUCKETS)
    mismatches: list[str] = []
    violations: list[str] = []
    off_model: list[str] = []
    for case, cand in zip(cases, layout.layouts(cases), strict=True):
        diff = compare_layouts(reference_layout(list(case.numels), **case.refgrad_kwargs()), cand)
        if diff:
            mismatches.append(f"{case}: {diff}")
        try:
            broken = layout_violations(
                cand, case.numels, **case.refgrad_kwargs(), check_shards=case.dp_size <= 256
            )
        except ValueError as unshardable:  # a bucket that dp ranks cannot shard
            broken = [str(unshardable)]
        if broken:
            violations.append(f"{case}: {broken[0]}")
        if documented is not None:
            model_diff = compare_layouts(ddp_layout_of(case), cand)
            unpadded = unpadded_bucket_violations(cand, case.numels)
            if model_diff or unpadded:
                off_model.append(f"{case}: {model_diff or unpadded[0]}")
    rec.expect_documented(
        f"{count} random layouts: candidate == refgrad", not mismatches, documented=documented,
        documented_holds=None if documented is None else not off_model,
        detail="; ".join((off_model or mismatches)[:3]),
    )
    rec.expect_documented(
        f"{count} random layouts: all invariants hold, shards tile every bucket", not violations,
        documented=documented, documented_holds=None if documented is None else not off_model,
        detail="; ".join((off_model or violations)[:3]),
    )


def _report(ctx: CheckContext, rec: CheckRecorder, layout: BucketLayout,
            candidate: Candidate) -> None:
    """The padding-overhead report (``verify layout``'s rows), the candidate's layout of its
    models against refgrad, and Megatron-Core's published worked examples."""
    models = ["gpt-125m"] if ctx.quick else list(layout_report.MODELS)
    rows = layout_report.padding_rows(models, layout_report.DEFAULT_DPS)
    for row in rows:
        if row["high_busbw"] and row["dp"] & (row["dp"] - 1) == 0:
            rec.expect(
                f"{row['model']} dp={row['dp']}: high-busbw shards divisible by 2^16/dp",
                row["min_shard_pow2"] >= 2**16 // row["dp"],
                f"min 2-adic factor {row['min_shard_pow2']}",
            )
    with rec.skip_if_unsupported():
        labelled = []
        for model in models:
            numels, shared, _ = layout_report.MODELS[model].param_numels()
            for dp in layout_report.DEFAULT_DPS:
                labelled.append((f"{model} dp={dp}", LayoutCase(
                    tuple(numels), dp_size=dp, bucket_size=default_bucket_size(dp),
                    use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=True,
                    shared_embedding=tuple(shared))))
        candidate_layouts = layout.layouts([case for _, case in labelled])
        for (label, case), cand in zip(labelled, candidate_layouts, strict=True):
            expect_layout(rec, f"{label}: report layout == refgrad", case, cand, candidate)
    rec.table(
        "Padding overhead (distributed optimizer, default bucket size, fp32 grads + bf16 params)",
        layout_report.PADDING_COLUMNS,
        [[row[c] for c in layout_report.PADDING_COLUMNS] for row in rows],
        notes=[
            "padding_elements = buffer numel - parameter elements (64-alignment gaps + bucket end padding)",
            "min_shard_pow2 = smallest, over buckets, largest power of two dividing bucket_numel/dp",
        ],
    )
    examples = layout_report.published_examples()
    # Hand-derived: 40,000,000 -> ceil(40e6/65,536)=611 -> 611*65,536 = 40,042,496; /64 = 625,664 = 611*2^10.
    formula = {(r["example"], r["quantity"]): r["formula"] for r in examples}
    hand = {
        "divisor lcm(64,128,2**16)": 65_536,
        "padded bucket (elements)": 40_042_496,
        "padded / 64": 625_664,
        "largest 2^k dividing shard": 1_024,
        "625,000 % 65,536": 35_176,
    }
    for (example, quantity), value in formula.items():
        if quantity in hand and (quantity != "padded bucket (elements)" or example.startswith("2")):
            rec.expect(f"published example {example}: {quantity} = {hand[quantity]:,}",
                       value == hand[quantity], str(value))
    rec.table("Megatron-Core's published worked examples vs the formula",
              layout_report.EXAMPLE_COLUMNS,
              [[r[c] for c in layout_report.EXAMPLE_COLUMNS] for r in examples])
    for text in layout_report.published_example_findings(examples):
        rec.note(text)


CHECK = Check(
    name="layout",
    summary="bucketed padded grad buffers: the candidate's layout/buffers vs refgrad, padding report",
    run=run,
    spawns_ranks=True,
    technique=Technique.LAYOUT,
)

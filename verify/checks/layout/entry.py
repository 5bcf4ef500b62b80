"""The layout check's candidate, its run function and the report glue."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from refgrad.layout import compute_layout as reference_layout
from verify.check import Check, CheckContext, CheckRecorder
from verify.checks.layout.buffers import buffer_violations
from verify.checks.layout.cases import HAND_CASES, compare_layouts, hand_case_mismatch, random_case
from verify.checks.layout.invariants import layout_violations
from verify.checks.layout.worker import default_scenarios, run_reduce_scenarios

LayoutFunction = Callable[..., Any]

# --------------------------------------------------------------------------- the check


@dataclass(frozen=True)
class LayoutCandidate:
    """The layout implementation under test: the layout function and the buffer class."""

    compute_layout: LayoutFunction
    buffer_cls: type

    def __post_init__(self) -> None:
        if not callable(self.compute_layout):
            raise TypeError("LayoutCandidate.compute_layout must be callable")
        if not isinstance(self.buffer_cls, type):
            raise TypeError("LayoutCandidate.buffer_cls must be a class")

    @classmethod
    def default(cls, **overrides: Any) -> LayoutCandidate:
        """fastgrad's ``compute_layout`` and ``ParamAndGradBuffer`` (``overrides`` replace fields)."""
        from fastgrad.buffer import ParamAndGradBuffer
        from fastgrad.layout import compute_layout

        return cls(**{"compute_layout": compute_layout, "buffer_cls": ParamAndGradBuffer, **overrides})


@dataclass(frozen=True)
class _Options:
    random_cases: int
    big_params: int
    spawn_ranks: tuple[int, ...] = field(default=())


def run(ctx: CheckContext, rec: CheckRecorder, candidate: LayoutCandidate) -> None:
    """The ``layout`` check against ``candidate`` (default: fastgrad's layout and buffers)."""
    options = _Options(
        random_cases=300 if ctx.quick else 3000,
        big_params=10_000 if ctx.quick else 100_000,
        spawn_ranks=() if ctx.quick else (2, 3),
    )
    _run(ctx, rec, candidate, options)


def _run(ctx: CheckContext, rec: CheckRecorder, layout_candidate: LayoutCandidate, options: _Options) -> None:
    from verify.studies import layout as layout_report

    candidate = layout_candidate.compute_layout
    # 1. Hand-derived layouts.
    for case in HAND_CASES:
        for label, fn in (("refgrad", reference_layout), ("candidate", candidate)):
            mismatch = hand_case_mismatch(case, fn(list(case.numels), **case.kwargs()))
            rec.expect(f"hand-derived ({label}): {case.name}", not mismatch, mismatch)
    # 2. Random layouts: candidate == refgrad, invariants, shard coverage.
    rng = random.Random(ctx.seed * 7919 + 4)
    mismatches: list[str] = []
    violations: list[str] = []
    for _ in range(options.random_cases):
        case = random_case(rng)
        ref = reference_layout(list(case.numels), **case.kwargs())
        cand = candidate(list(case.numels), **case.kwargs())
        diff = compare_layouts(ref, cand)
        if diff:
            mismatches.append(f"{case}: {diff}")
        broken = layout_violations(
            cand, case.numels, **case.kwargs(), check_shards=case.dp_size <= 256
        )
        if broken:
            violations.append(f"{case}: {broken[0]}")
    rec.expect(
        f"{options.random_cases} random layouts: candidate == refgrad",
        not mismatches,
        "; ".join(mismatches[:3]),
    )
    rec.expect(
        f"{options.random_cases} random layouts: all invariants hold, shards tile every bucket",
        not violations,
        "; ".join(violations[:3]),
    )
    # 3. A large model: many params, exact agreement.
    big_rng = random.Random(ctx.seed + 17)
    big = [big_rng.choice((64, 4096, big_rng.randint(1, 10**6))) for _ in range(options.big_params)]
    big_kwargs = {
        "dp_size": 48,
        "bucket_size": 40_000_000,
        "use_distributed_optimizer": True,
        "pad_buckets_for_high_nccl_busbw": True,
        "shared_embedding": (0, options.big_params - 1),
    }
    diff = compare_layouts(reference_layout(big, **big_kwargs), candidate(big, **big_kwargs))
    rec.expect(f"{options.big_params} params: candidate == refgrad", not diff, diff)
    # 4. The buffers on the context's device.
    problems = buffer_violations(ctx.device, layout_candidate.buffer_cls, ctx.seed)
    rec.expect(f"ParamAndGradBuffer views/alignment/padding on {ctx.device}", not problems, "; ".join(problems[:5]))
    # 5. Real reductions across ranks.
    if options.spawn_ranks:
        for world_size in options.spawn_ranks:
            for label, passed, detail in run_reduce_scenarios(
                world_size, default_scenarios(world_size), buffer_cls=layout_candidate.buffer_cls,
                timeout_s=ctx.timeout_s,
            ):
                if detail.startswith("skipped"):
                    rec.skip(f"{label}: {detail}")
                else:
                    rec.expect(label, passed, detail)
    else:
        rec.skip("multi-rank reduce-scatter through the buffers runs only without --quick")
    # 6. The padding report and the published worked examples.
    models = ["gpt-125m"] if ctx.quick else list(layout_report.MODELS)
    rows = layout_report.padding_rows(models, layout_report.DEFAULT_DPS)
    for row in rows:
        if row["high_busbw"] and row["dp"] & (row["dp"] - 1) == 0:
            rec.expect(
                f"{row['model']} dp={row['dp']}: high-busbw shards divisible by 2^16/dp",
                row["min_shard_pow2"] >= 2**16 // row["dp"],
                f"min 2-adic factor {row['min_shard_pow2']}",
            )
    for model in models:
        numels, shared, _ = layout_report.MODELS[model].param_numels()
        for dp in layout_report.DEFAULT_DPS:
            kwargs = {
                "dp_size": dp,
                "bucket_size": max(40_000_000, 1_000_000 * dp),
                "use_distributed_optimizer": True,
                "pad_buckets_for_high_nccl_busbw": True,
                "shared_embedding": shared,
            }
            diff = compare_layouts(reference_layout(numels, **kwargs), candidate(numels, **kwargs))
            rec.expect(f"{model} dp={dp}: report layout == refgrad", not diff, diff)
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
        rec.finding(text)




CHECK = Check(
    name="layout",
    summary="bucketed padded grad buffers: fastgrad layout/buffers vs refgrad, padding report",
    run=run,
    default_candidate=LayoutCandidate.default(),
    spawns_ranks=True,
)

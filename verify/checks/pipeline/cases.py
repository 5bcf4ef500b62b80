"""The pipeline check's cases: grids, step plans, and the phases one spawned world runs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gradvocab import Averaging, ParallelDims
from refgrad.pipeline import (
    LinearStackSpec,
    StepPlan,
    stage_param_name,
)
from verify.candidates.interfaces import PipelineCase


def default_plans(pp_size: int, frozen: str, *, at_least_two: bool = False
                  ) -> tuple[StepPlan, ...]:
    """M in {1, P-1, P, 2P+1} over four steps (``at_least_two``: {P+1, P, P, 2P+1}, no step
    of one microbatch); ``frozen`` is frozen during the third."""
    counts = ((2 * pp_size + 1, pp_size + 1, pp_size, max(pp_size, 2)) if at_least_two
              else (2 * pp_size + 1, 1, pp_size, max(pp_size - 1, 1)))
    return tuple(
        StepPlan(m, frozenset({frozen}) if step == 2 else frozenset())
        for step, m in enumerate(counts)
    )


def build_phases(quick: bool, seed: int) -> tuple[int, list[list[PipelineCase]]]:
    """(world size, phases of side-by-side cases) for a quick or full run."""

    def case(name: str, pp: int, dp: int, first: int, head: bool = False,
             at_least_two: bool = False, **kw: Any) -> PipelineCase:
        spec = LinearStackSpec(num_stages=pp, layers_per_stage=2, hidden=8, microbatch_size=4,
                               seed=seed, output_head=head, tied_embedding=head)
        frozen = stage_param_name(pp - 1, "layers.0.weight")
        return PipelineCase(name, ParallelDims(pp_size=pp, dp_size=dp, first_rank=first), spec,
                            default_plans(pp, frozen, at_least_two=at_least_two), **kw)

    # The deferred head with at least two microbatches in every step: a drain never holds a
    # single wgrad, so a candidate whose drain fails on one entry still shows its reduction.
    head_every_step = case("P2 D2 all-reduce avg-in-collective, tied head, M >= 2", 2, 2, 0,
                           head=True, at_least_two=True, reduction=Averaging.AVG)

    # Interleaved P=2, V=2: M in {2P, P, 3P}, the last virtual stage's weight frozen in step 2.
    interleaved_spec = LinearStackSpec(num_stages=4, layers_per_stage=1, hidden=8,
                                       microbatch_size=4, seed=seed)
    interleaved_frozen = frozenset({stage_param_name(3, "layers.0.weight")})
    interleaved = PipelineCase(
        "P2 D2 V2 interleaved all-reduce sum", ParallelDims(pp_size=2, dp_size=2, vpp_size=2),
        interleaved_spec, (StepPlan(4), StepPlan(2, interleaved_frozen), StepPlan(6)),
        bucket_size=40,
    )
    timing_spec = LinearStackSpec(num_stages=2, layers_per_stage=4, hidden=192, microbatch_size=96, seed=seed)
    timing = PipelineCase(
        "timing P2 D2", ParallelDims(pp_size=2, dp_size=2), timing_spec,
        tuple(StepPlan(5) for _ in range(6)), bucket_size=192 * 192 + 192, timing=True,
    )
    if quick:
        return 4, [
            [case("P2 D2 all-reduce avg-in-collective, tied head", 2, 2, 0, head=True,
                  reduction=Averaging.AVG)],
            [head_every_step],
            [case("P4 D1 all-reduce sum", 4, 1, 0)],
            [interleaved],
            [replace(timing, plans=timing.plans[:3])],
        ]
    return 8, [
        [case("P4 D2 reduce-scatter prescale, tied head", 4, 2, 0, head=True,
              use_distributed_optimizer=True, reduction=Averaging.PRESCALE)],
        [head_every_step],
        [
            case("P2 D2 reduce-scatter fp32-accumulation avg", 2, 2, 0, use_distributed_optimizer=True,
                 reduce_scatter_with_fp32_accumulation=True, reduction=Averaging.AVG),
            case("P4 D1 all-reduce sum", 4, 1, 4),
        ],
        [case("P2 D1 all-reduce sum, tied head", 2, 1, 0, head=True),
         interleaved.at(4)],
        [case("P2 D4 all-reduce sum", 2, 4, 0)],
        [case("P2 D4 reduce-scatter fp32-accumulation sum", 2, 4, 0, use_distributed_optimizer=True,
              reduce_scatter_with_fp32_accumulation=True)],
        # Alone in its phase: nothing else competes for the 2 cores while it is timed.
        [timing],
    ]

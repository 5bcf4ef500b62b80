"""The pipeline check's cases: grids, step plans, the faults a broken candidate injects, and the phases one spawned world runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fastgrad.timeline import TimelineEvent
from refgrad.pipeline import (
    LinearStackSpec,
    StepPlan,
    stage_param_name,
)

# Deliberately broken candidates: "reversed_microbatches" feeds each replica's microbatches
# in reverse; "lifo_drain" gives the last stage an output layer whose deferred-wgrad drain
# runs newest first (a different fp32 sum order); "crossed_embedding_group" (TP 2, tied) pairs
# the first stage of each TP rank with the last stage of the other TP rank for the embedding
# all-reduce (same shard shape, wrong rows); "embedding_grad_first" and "dropped_head_wgrad"
# (tied at PP 1: one shared weight) add the output layer's wgrad after the first layer's grad,
# or never (verify.checks.pipeline.shared_weight). Each is applied by the rank to its own data, layer
# instance or group, never by changing a library class.
FAULTS = (None, "reversed_microbatches", "lifo_drain", "crossed_embedding_group",
          "embedding_grad_first", "dropped_head_wgrad")


@dataclass(frozen=True)
class PipelineCase:
    """One grid and configuration, run for ``plans`` (one entry per optimizer step)."""

    name: str
    pp_size: int
    dp_size: int
    first_rank: int
    spec: LinearStackSpec
    plans: tuple[StepPlan, ...]
    use_distributed_optimizer: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    reduction: str = "sum"
    bucket_size: int = 80
    lr: float = 0.05
    timing: bool = False  # the dedicated timing case: bigger layers, simulator comparison
    fault: str | None = None
    virtual_stages: int = 1  # > 1: interleaved 1F1B, spec has pp_size * virtual_stages stages
    # Production's bucket rule: only pipeline rank 0's first chunk is bucketed with
    # ``bucket_size``; every other (stage, chunk) uses this one (None: ``bucket_size`` too).
    bucket_size_elsewhere: int | None = None

    def __post_init__(self) -> None:
        for name in ("pp_size", "dp_size", "bucket_size", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelineCase.{name} must be an int >= 1, got {value!r}")
        if self.bucket_size_elsewhere is not None and (
                isinstance(self.bucket_size_elsewhere, bool)
                or not isinstance(self.bucket_size_elsewhere, int) or self.bucket_size_elsewhere < 1):
            raise ValueError(f"PipelineCase.bucket_size_elsewhere must be None or an int >= 1, "
                             f"got {self.bucket_size_elsewhere!r}")
        if isinstance(self.first_rank, bool) or not isinstance(self.first_rank, int) \
                or self.first_rank < 0:
            raise ValueError(f"PipelineCase.first_rank must be an int >= 0, got {self.first_rank!r}")
        if self.spec.num_stages != self.pp_size * self.virtual_stages:
            raise ValueError(f"PipelineCase.spec.num_stages ({self.spec.num_stages}) must equal "
                             f"pp_size * virtual_stages ({self.pp_size * self.virtual_stages})")
        if not self.plans or not all(isinstance(p, StepPlan) for p in self.plans):
            raise ValueError("PipelineCase.plans must be a non-empty tuple of StepPlan")
        if self.virtual_stages > 1:
            if self.pp_size < 2 or self.timing:
                raise ValueError("PipelineCase.virtual_stages > 1 needs pp_size >= 2 and no timing "
                                 "(the interleaved schedule has no simulator comparison)")
            bad = [p.num_microbatches for p in self.plans if p.num_microbatches % self.pp_size]
            if bad:
                raise ValueError(f"PipelineCase.plans: num_microbatches {bad} must be multiples "
                                 f"of pp_size ({self.pp_size}) when virtual_stages > 1")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) \
                or not math.isfinite(self.lr) or self.lr <= 0:
            raise ValueError(f"PipelineCase.lr must be a finite number > 0, got {self.lr!r}")
        if self.reduction not in ("sum", "avg", "prescale"):
            raise ValueError(f"PipelineCase.reduction must be sum/avg/prescale, got {self.reduction!r}")
        if self.fault not in FAULTS:
            raise ValueError(f"PipelineCase.fault must be one of {FAULTS}, got {self.fault!r}")

    def bucket_size_for(self, stage: int, chunk: int) -> int:
        """The DDP bucket size of model chunk ``chunk`` on pipeline stage ``stage``."""
        if (stage, chunk) == (0, 0) or self.bucket_size_elsewhere is None:
            return self.bucket_size
        return self.bucket_size_elsewhere

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks per (stage, DP rank): ``spec.tensor_parallel``."""
        return self.spec.tensor_parallel

    @property
    def world(self) -> int:
        """Ranks the grid occupies: ``tp_size * pp_size * dp_size``."""
        return self.tp_size * self.pp_size * self.dp_size


@dataclass
class RankResult:
    """What one rank observed for one case and overlap setting."""

    stage: int
    dp_rank: int
    tp_rank: int = 0
    losses: list[list[float]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    launch_sites: list[tuple[str, ...]] = field(default_factory=list)
    relearn_count: int = 0
    events: list[list[TimelineEvent]] = field(default_factory=list)
    # Interleaved only, per step: (chunk, which chunks had a reduce in flight) at each enable.
    chunk_enables: list[list[tuple[int, tuple[bool, ...]]]] = field(default_factory=list)


def default_plans(pp_size: int, frozen: str) -> tuple[StepPlan, ...]:
    """M in {1, P-1, P, 2P+1} over four steps; ``frozen`` is frozen during the third."""
    counts = (2 * pp_size + 1, 1, pp_size, max(pp_size - 1, 1))
    return tuple(
        StepPlan(m, frozenset({frozen}) if step == 2 else frozenset())
        for step, m in enumerate(counts)
    )


def build_phases(quick: bool, seed: int, fault: str | None = None) -> tuple[int, list[list[PipelineCase]]]:
    """(world size, phases of side-by-side cases) for a quick or full run."""

    def case(name: str, pp: int, dp: int, first: int, head: bool = False, **kw: Any) -> PipelineCase:
        spec = LinearStackSpec(num_stages=pp, layers_per_stage=2, hidden=8, microbatch_size=4,
                               seed=seed, output_head=head, tied_embedding=head)
        frozen = stage_param_name(pp - 1, "layers.0.weight")
        return PipelineCase(name, pp, dp, first, spec, default_plans(pp, frozen), fault=fault, **kw)

    # Interleaved P=2, V=2: M in {2P, P, 3P}, the last virtual stage's weight frozen in step 2.
    interleaved_spec = LinearStackSpec(num_stages=4, layers_per_stage=1, hidden=8,
                                       microbatch_size=4, seed=seed)
    interleaved_frozen = frozenset({stage_param_name(3, "layers.0.weight")})
    interleaved = PipelineCase(
        "P2 D2 V2 interleaved all-reduce sum", 2, 2, 0, interleaved_spec,
        (StepPlan(4), StepPlan(2, interleaved_frozen), StepPlan(6)), bucket_size=40,
        fault=fault, virtual_stages=2,
    )
    timing_spec = LinearStackSpec(num_stages=2, layers_per_stage=4, hidden=192, microbatch_size=96, seed=seed)
    timing = PipelineCase(
        "timing P2 D2", 2, 2, 0, timing_spec, tuple(StepPlan(5) for _ in range(6)),
        bucket_size=192 * 192 + 192, timing=True, fault=fault,
    )
    if quick:
        return 4, [
            [case("P2 D2 all-reduce avg-in-collective, tied head", 2, 2, 0, head=True,
                  reduction="avg")],
            [case("P4 D1 all-reduce sum", 4, 1, 0)],
            [interleaved],
            [replace(timing, plans=timing.plans[:3])],
        ]
    return 8, [
        [case("P4 D2 reduce-scatter prescale, tied head", 4, 2, 0, head=True,
              use_distributed_optimizer=True, reduction="prescale")],
        [
            case("P2 D2 reduce-scatter fp32-accumulation avg", 2, 2, 0, use_distributed_optimizer=True,
                 reduce_scatter_with_fp32_accumulation=True, reduction="avg"),
            case("P4 D1 all-reduce sum", 4, 1, 4),
        ],
        [case("P2 D1 all-reduce sum, tied head", 2, 1, 0, head=True),
         replace(interleaved, first_rank=4)],
        [case("P2 D4 all-reduce sum", 2, 4, 0)],
        [case("P2 D4 reduce-scatter fp32-accumulation sum", 2, 4, 0, use_distributed_optimizer=True,
              reduce_scatter_with_fp32_accumulation=True)],
        # Alone in its phase: nothing else competes for the 2 cores while it is timed.
        [timing],
    ]

"""Check ``pipeline``: grad sync in the 1F1B cooldown bubble, bitwise against refgrad.

Real gloo processes run a ``P``-stage 1F1B pipeline times ``D`` data-parallel
replicas (``fastgrad.pipeline`` + ``fastgrad.ddp``) for several optimizer
steps with rank-specific data, microbatch counts ``M`` in ``{1, P-1, P, 2P+1}``
(so ``M`` changes from step to step) and a parameter frozen for one step. Each
case runs with ``overlap_grad_reduce`` on and off. Losses, reduced gradients
and updated parameters must be bitwise equal between overlap on, overlap off
and ``refgrad.pipeline`` (one process, microbatches in order, the reference DP
reduction). That is a fixed-order claim for ``D <= 2``: a sum of two fp32
values has one rounding whatever algorithm the all-reduce uses.

All grids share one spawned world: ``(4, 2)`` uses all 8 ranks, ``(2, 2)`` and
``(4, 1)`` run side by side on ranks 0-3 and 4-7, ``(2, 1)`` on ranks 0-1. A
timing phase records per-rank timelines (overlap on vs off) and holds the
discrete-event simulator (``verify.studies.pipeline``) against them.

One interleaved case (``virtual_stages = 2``: ``fastgrad.pipeline_interleaved``,
one DDP engine per model chunk, ``M`` a changing multiple of ``P``) runs the
same comparisons against refgrad on the ``P * V``-stage model, and checks that
the chunks enable their sync in reverse order with chunk ``V - 1`` already
reducing (overlap on) when chunk 0 starts its last backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from fastgrad.timeline import TimelineEvent
from refgrad.pipeline import (
    EMBEDDING_PARAM,
    HEAD_PARAM,
    LinearStackSpec,
    StageModule,
    StepPlan,
    head_weight_init,
    microbatch_data,
    microbatch_loss,
    reference_training,
    sgd_update,
    stage_param_name,
)
from verify.check import Check, CheckContext, CheckRecorder

FAULTS = (None, "reversed_microbatches")


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

    def __post_init__(self) -> None:
        for name in ("pp_size", "dp_size", "bucket_size", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelineCase.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.first_rank, bool) or not isinstance(self.first_rank, int) \
                or self.first_rank < 0:
            raise ValueError(f"PipelineCase.first_rank must be an int >= 0, got {self.first_rank!r}")
        if self.spec.num_stages != self.pp_size * self.virtual_stages:
            raise ValueError(f"PipelineCase.spec.num_stages ({self.spec.num_stages}) must equal "
                             f"pp_size * virtual_stages ({self.pp_size * self.virtual_stages})")
        if not self.plans or not all(isinstance(p, StepPlan) for p in self.plans):
            raise ValueError("PipelineCase.plans must be a non-empty tuple of StepPlan")
        if self.virtual_stages > 1:
            if self.pp_size < 2 or self.spec.output_head or self.timing:
                raise ValueError("PipelineCase.virtual_stages > 1 needs pp_size >= 2, no output "
                                 "head and no timing (the interleaved schedule has neither)")
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

    @property
    def world(self) -> int:
        """Ranks the grid occupies: ``pp_size * dp_size``."""
        return self.pp_size * self.dp_size


@dataclass
class RankResult:
    """What one rank observed for one case and overlap setting."""

    stage: int
    dp_rank: int
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


def _ddp_config(case: PipelineCase, overlap: bool):
    from fastgrad.config import DDPConfig

    return DDPConfig(
        use_distributed_optimizer=case.use_distributed_optimizer,
        reduce_scatter_with_fp32_accumulation=case.reduce_scatter_with_fp32_accumulation,
        average_in_collective=case.reduction == "avg",
        overlap_grad_reduce=overlap,
        bucket_size=case.bucket_size,
    )


def _full_reduced_grads(ddp: Any, case: PipelineCase, dp_group: Any) -> None:
    """With the distributed optimizer only the local shard is reduced: gather the others."""
    if not case.use_distributed_optimizer or case.dp_size == 1:
        return
    from fastgrad.comm import all_gather_into

    for bucket in ddp.buffer.buckets:
        gathered = torch.empty_like(bucket.grad_data)
        all_gather_into(gathered, bucket.local_grad_shard.clone(), group=dp_group)
        bucket.grad_data.copy_(gathered)


class _BodyWithHead(torch.nn.Module):
    """The last stage with an output head: ``head(body(x))``."""

    def __init__(self, body: torch.nn.Module, head: torch.nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class _RecordingSync:
    """Forward to one chunk's DDP; at its enable, note which chunks already launched a reduce."""

    def __init__(self, ddps: list[Any], chunk: int, log: list) -> None:
        self.ddp, self.ddps, self.chunk, self.log = ddps[chunk], ddps, chunk, log

    def enable_grad_sync(self) -> None:
        self.log.append((self.chunk, tuple(d.any_reduce_in_flight for d in self.ddps)))
        self.ddp.enable_grad_sync()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ddp, name)


def run_interleaved_case_on_rank(case: PipelineCase, groups: Any, overlap: bool) -> RankResult:
    """Train an interleaved ``case`` (one DDP engine per model chunk) on this rank."""
    from fastgrad.ddp import DistributedDataParallel
    from fastgrad.pipeline_interleaved import forward_backward_interleaved
    from fastgrad.timeline import Timeline

    P, V, stage = case.pp_size, case.virtual_stages, groups.stage
    chunks = [StageModule(case.spec, c * P + stage) for c in range(V)]
    named = {stage_param_name(c * P + stage, n): p
             for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()}
    ddps = [DistributedDataParallel(chunk, config=_ddp_config(case, overlap),
                                    dp_group=groups.dp_group, average=case.reduction != "sum")
            for chunk in chunks]
    result = RankResult(stage=stage, dp_rank=groups.dp_rank)
    timeline = Timeline(groups.rank)
    for step, plan in enumerate(case.plans):
        for name, p in named.items():
            p.requires_grad_(name not in plan.frozen)
        for ddp in ddps:
            ddp.zero_grad_buffer()
        m = plan.num_microbatches
        inputs, targets = microbatch_data(case.spec, groups.dp_rank, step, m)
        if case.fault == "reversed_microbatches":
            inputs, targets = inputs[::-1], targets[::-1]
        timeline.clear()
        dist.barrier(group=groups.pp_group)
        log: list[tuple[int, tuple[bool, ...]]] = []
        losses = forward_backward_interleaved(
            chunks,
            groups=groups,
            grad_syncs=[_RecordingSync(ddps, c, log) for c in range(V)],
            num_microbatches=m,
            activation_shape=case.spec.activation_shape,
            loss_fn=lambda out, target, m=m: microbatch_loss(out, target, m),
            inputs=inputs if groups.is_first_stage else None,
            targets=targets if groups.is_last_stage else None,
            timeline=timeline,
        )
        result.events.append(list(timeline.events))
        for ddp in ddps:
            _full_reduced_grads(ddp, case, groups.dp_group)
        result.losses.append([float(v) for v in losses])
        result.grads.append({n: p.main_grad.detach().clone() for n, p in named.items()})
        result.launch_sites.append(tuple(s for ddp in ddps for s in ddp.last_launch_sites))
        result.chunk_enables.append(log)
        with torch.no_grad():
            for name, p in named.items():
                if name not in plan.frozen:
                    p.copy_(sgd_update(p, p.main_grad, case.lr))
        result.params.append({n: p.detach().clone() for n, p in named.items()})
    result.relearn_count = sum(ddp.relearn_count for ddp in ddps)
    for ddp in ddps:
        ddp.remove_hooks()
    return result


def run_case_on_rank(case: PipelineCase, groups: Any, overlap: bool) -> RankResult:
    """Train ``case`` on this rank of its grid; return what it saw."""
    if case.virtual_stages > 1:
        return run_interleaved_case_on_rank(case, groups, overlap)
    from fastgrad.ddp import DistributedDataParallel
    from fastgrad.pipeline import forward_backward_1f1b
    from fastgrad.timeline import Timeline

    stage = groups.stage
    spec = case.spec
    body = StageModule(spec, stage)
    named = {stage_param_name(stage, n): p for n, p in body.named_parameters()}
    module, head, tied = body, None, []
    if spec.output_head and groups.is_last_stage:
        from fastgrad.deferred_wgrad import ColumnParallelOutputLayer, EmbeddingWgradConfig

        head = ColumnParallelOutputLayer(
            head_weight_init(spec),
            EmbeddingWgradConfig(defer_embedding_wgrad_compute=True,
                                 pipeline_model_parallel_size=case.pp_size),
        )
        module = _BodyWithHead(body, head)
        named[stage_param_name(stage, HEAD_PARAM)] = head.weight
        if spec.tied_embedding:
            tied = [head.weight]
    if spec.tied_embedding and groups.is_first_stage:
        tied = [named[stage_param_name(0, EMBEDDING_PARAM)]]
    for param in tied:
        # Own bucket, same bucket-relative offsets on both stages: the DP shards of the
        # two copies line up, so the embedding all-reduce is right on every shard.
        param.shared_embedding = True
    ddp = DistributedDataParallel(
        module,
        config=_ddp_config(case, overlap),
        dp_group=groups.dp_group,
        average=case.reduction != "sum",
        external_grad_params=[] if head is None else [head.weight],
    )
    result = RankResult(stage=stage, dp_rank=groups.dp_rank)
    timeline = Timeline(groups.rank)
    for step, plan in enumerate(case.plans):
        for name, p in named.items():
            p.requires_grad_(name not in plan.frozen)
        ddp.zero_grad_buffer()
        if head is not None:
            head.start_step()
        inputs, targets = microbatch_data(case.spec, groups.dp_rank, step, plan.num_microbatches)
        if case.fault == "reversed_microbatches":
            inputs, targets = inputs[::-1], targets[::-1]
        m = plan.num_microbatches
        timeline.clear()
        if case.pp_size > 1:
            dist.barrier(group=groups.pp_group)
        losses = forward_backward_1f1b(
            module,
            groups=groups,
            grad_sync=ddp,
            num_microbatches=m,
            activation_shape=case.spec.activation_shape,
            loss_fn=lambda out, target, m=m: microbatch_loss(out, target, m),
            inputs=inputs if groups.is_first_stage else None,
            targets=targets if groups.is_last_stage else None,
            timeline=timeline,
            deferred_wgrad=head,
            embedding_params=tied,
        )
        result.events.append(list(timeline.events))
        _full_reduced_grads(ddp, case, groups.dp_group)
        result.losses.append([float(v) for v in losses])
        result.grads.append({n: p.main_grad.detach().clone() for n, p in named.items()})
        result.launch_sites.append(ddp.last_launch_sites)
        with torch.no_grad():
            for name, p in named.items():
                if name not in plan.frozen:
                    p.copy_(sgd_update(p, p.main_grad, case.lr))
        result.params.append({n: p.detach().clone() for n, p in named.items()})
    result.relearn_count = ddp.relearn_count
    ddp.remove_hooks()
    return result


def pipeline_worker(rank: int, world_size: int, phases: list[list[PipelineCase]]) -> dict:
    """Spawned entry point: run every phase's grids side by side; results by case name."""
    from fastgrad.pipeline import build_parallel_groups

    out: dict[str, dict[bool, RankResult]] = {}
    for phase in phases:
        mine = []
        for case in phase:
            groups = build_parallel_groups(case.pp_size, case.dp_size, first_rank=case.first_rank)
            if groups is not None:
                mine.append((case, groups))
        for case, groups in mine:
            out[case.name] = {
                overlap: run_case_on_rank(case, groups, overlap) for overlap in (True, False)
            }
        dist.barrier()
    return out


# ---------------------------------------------------------------- parent side


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


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def _collect(case: PipelineCase, ranks: list[dict], overlap: bool) -> dict[str, Any]:
    """Reassemble per-step losses [dp][mb], grads and params (per replica) from the ranks."""
    results = [r[case.name][overlap] for r in ranks if case.name in r]
    steps = len(case.plans)
    losses = [[[] for _ in range(case.dp_size)] for _ in range(steps)]
    grads = [[{} for _ in range(case.dp_size)] for _ in range(steps)]
    params = [[{} for _ in range(case.dp_size)] for _ in range(steps)]
    for res in results:
        for step in range(steps):
            if res.stage == case.pp_size - 1:
                losses[step][res.dp_rank] = res.losses[step]
            grads[step][res.dp_rank].update(res.grads[step])
            params[step][res.dp_rank].update(res.params[step])
    return {"losses": losses, "grads": grads, "params": params, "ranks": results}


def _site_counts(sites: list[list[tuple[str, ...]]]) -> str:
    """'where buckets launched' summed over ranks, per step: e.g. step 1: hook=6 dispatch=2."""
    parts = []
    for step in range(len(sites[0]) if sites else 0):
        counts: dict[str, int] = {}
        for per_rank in sites:
            for site in per_rank[step]:
                counts[site] = counts.get(site, 0) + 1
        parts.append(f"step {step}: " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return "; ".join(parts)


def _flatten_losses(losses: list[list[list[float]]]) -> torch.Tensor:
    return torch.tensor([v for step in losses for replica in step for v in replica], dtype=torch.float32)


def _flatten_named(per_step: list[list[dict[str, torch.Tensor]]], names: list[str]) -> torch.Tensor:
    return _concat([replica[n] for step in per_step for replica in step for n in names])


UNIT_ROUNDOFF_FP32 = Fraction(1, 2**24)


def _gamma(n: int) -> Fraction:
    """Higham's ``gamma(n) = n u / (1 - n u)`` for fp32."""
    return n * UNIT_ROUNDOFF_FP32 / (1 - n * UNIT_ROUNDOFF_FP32)


def _large_dp_report(rec: CheckRecorder, case: PipelineCase, ranks: list[dict]) -> None:
    """D > 2: the all-reduce's summation order is gloo's choice, so no bitwise claim.

    Step 0 starts from identical weights, so its per-replica grad sums are
    exactly refgrad's. Any order of fp32 recursive summation of D values lies
    within ``gamma(D-1) * sum|x_d|`` of the exact sum (Higham, Accuracy and
    Stability, eq. 4.4); every element must meet that bound. The ULP distance to
    the correctly rounded sum is reported, not bounded: under cancellation the
    bound above is many ULPs of a small result. Later steps start from weights
    that already differ in the last bits, so they are only checked for overlap
    on vs off.
    """
    from refgrad.exact import correctly_rounded_sum, exact_sum
    from refgrad.formats import decode_tensor
    from verify.metrics import compare

    ref = reference_training(case.spec, case.plans[:1], case.dp_size, lr=case.lr, reduction="sum")
    names = sorted(ref.grads[0])
    replicas = [_concat([sums[n] for n in names]) for sums in ref.replica_sums[0]]
    rounded = correctly_rounded_sum(replicas, torch.float32)
    decoded = [decode_tensor(r) for r in replicas]
    exact = [exact_sum(vals) for vals in zip(*decoded)]
    bound = [_gamma(case.dp_size - 1) * exact_sum(abs(v) for v in vals) for vals in zip(*decoded)]
    rows = []
    results = {}
    for overlap in (True, False):
        got = _collect(case, ranks, overlap)
        results[overlap] = got
        for replica in range(case.dp_size):
            cand = _concat([got["grads"][0][replica][n] for n in names])
            errors = [abs(Fraction(c) - e) for c, e in zip(decode_tensor(cand), exact)]
            within = all(err <= b for err, b in zip(errors, bound))
            worst = max((err / b for err, b in zip(errors, bound) if b > 0), default=Fraction(0))
            tag = f"{case.name}, overlap {'on' if overlap else 'off'}, replica {replica}"
            rec.expect(f"{tag}: step-0 grads within gamma(D-1)*sum|x| of the exact sum",
                       within, f"largest error / bound = {float(worst):.3g}")
            cmp = compare(rounded, cand)
            rows.append([tag, cmp.max_ulp, cmp.n_mismatch, cmp.n, cmp.bitwise_equal])
        rec.compare(f"{case.name}, overlap {'on' if overlap else 'off'}: step-0 losses vs refgrad",
                    _flatten_losses(ref.losses), _flatten_losses(got["losses"][:1]))
    on, off = results[True], results[False]
    step0 = compare(_concat([off["grads"][0][0][n] for n in names]),
                    _concat([on["grads"][0][0][n] for n in names]))
    every = compare(_flatten_named(off["grads"], names), _flatten_named(on["grads"], names))
    rows.append(["overlap on vs off, step 0", step0.max_ulp, step0.n_mismatch, step0.n,
                 step0.bitwise_equal])
    rows.append(["overlap on vs off, all steps", every.max_ulp, every.n_mismatch, every.n,
                 every.bitwise_equal])
    if not every.bitwise_equal:
        rec.finding(
            f"{case.name}: overlap on and off give different grads (max {every.max_ulp} ULP over "
            f"{len(case.plans)} steps). gloo's all-reduce splits each message into per-rank "
            "chunks, so an element's summation order depends on its offset inside its bucket, "
            "and overlap off uses one bucket while overlap on uses several: production's "
            "'loss differs with overlap on vs off' for D > 2. An order-fixed reduction "
            "(the fp32-accumulating reduce-scatter, rank order) is bitwise in both modes."
        )
    rec.table(f"{case.name}: step-0 reduced grads vs the correctly rounded sum",
              ["candidate", "max ULP", "mismatches", "elements", "bitwise"], rows,
              notes=["gloo picks the all-reduce algorithm (and so the summation order) for D > 2"])


def _timeline_rows(case: PipelineCase, ranks: list[dict], step: int = 2) -> list[list[Any]]:
    from fastgrad.timeline import summarize_step

    step = min(step, len(case.plans) - 1)  # a case with fewer steps reports its last one
    rows = []
    for overlap in (True, False):
        events = [e for r in ranks if case.name in r for e in r[case.name][overlap].events[step]]
        report = summarize_step(events)
        rows.append([case.name, "on" if overlap else "off", case.plans[step].num_microbatches,
                     round(report.step_time * 1e3, 3), round(report.bubble_fraction, 3),
                     round(report.exposed_grad_sync * 1e3, 3), round(report.grad_sync_wait * 1e3, 3)])
    return rows


def _timing_report(rec: CheckRecorder, case: PipelineCase, ranks: list[dict]) -> None:
    from fastgrad.timeline import summarize_step
    from verify.studies.pipeline import PipelineCosts, simulate

    rows = []
    reports = {}
    for overlap in (True, False):
        per_rank = [r[case.name][overlap] for r in ranks if case.name in r]
        # Step 0 warms up allocators and gloo connections; report the later steps.
        for step in range(1, len(case.plans)):
            events = [e for res in per_rank for e in res.events[step]]
            report = summarize_step(events)
            reports.setdefault(overlap, []).append(report)
    for overlap, reps in reports.items():
        best = min(reps, key=lambda r: r.step_time)
        rows.append([
            "on" if overlap else "off",
            round(best.step_time * 1e3, 3),
            round(best.bubble_fraction, 4),
            round(best.exposed_grad_sync * 1e3, 3),
            round(best.grad_sync_wait * 1e3, 3),
            round(best.mean_forward * 1e3, 3),
            round(best.mean_backward * 1e3, 3),
        ])
    on = min(reports[True], key=lambda r: r.step_time)
    off = min(reports[False], key=lambda r: r.step_time)
    rec.table(
        f"measured 1F1B timelines, {case.name}, M={case.plans[1].num_microbatches} (best of "
        f"{len(reports[True])} steps, ms)",
        ["overlap", "step", "bubble", "exposed sync", "sync wait", "mean fwd", "mean bwd"],
        rows,
        notes=[
            "exposed sync = step end - end of the last compute on any rank (what the sync adds "
            "to the critical path); sync wait = longest finish_grad_sync on one rank",
            "gloo on a shared 2-core machine: absolute times are noisy, compare within the table",
        ],
    )
    costs = PipelineCosts(
        forward=on.mean_forward,
        backward=on.mean_backward,
        grad_sync=off.grad_sync_wait,
        num_buckets=4,
    )
    m = case.plans[1].num_microbatches
    predicted_on = simulate(case.pp_size, m, costs, "overlap")
    predicted_off = simulate(case.pp_size, m, costs, "after-compute")
    rec.table(
        "simulator vs measured (same costs: measured mean fwd/bwd, overlap-off sync time)",
        ["overlap", "measured step ms", "simulated step ms", "ratio", "measured bubble",
         "simulated bubble"],
        [
            ["on", round(on.step_time * 1e3, 3), round(predicted_on.step_time * 1e3, 3),
             round(on.step_time / predicted_on.step_time, 3), round(on.bubble_fraction, 4),
             round(predicted_on.bubble_fraction, 4)],
            ["off", round(off.step_time * 1e3, 3), round(predicted_off.step_time * 1e3, 3),
             round(off.step_time / predicted_off.step_time, 3), round(off.bubble_fraction, 4),
             round(predicted_off.bubble_fraction, 4)],
        ],
        notes=["the simulator ignores point-to-point latency and Python overhead between ops, "
               "so a measured/simulated ratio above 1 is expected"],
    )
    rec.expect(
        "timelines recorded forward, backward and communication events on every rank",
        all(
            {e.kind for e in res.events[1]} >= {"forward", "backward", "grad_sync_wait"}
            for r in ranks if case.name in r for res in r[case.name].values()
        ),
    )


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
                on, off = _collect(case, ranks, True), _collect(case, ranks, False)
                rec.compare(f"{case.name}: grads overlap on vs off",
                            _flatten_named(off["grads"], sorted(off["grads"][0][0])),
                            _flatten_named(on["grads"], sorted(on["grads"][0][0])))
                _timing_report(rec, case, ranks)
                continue
            reduction = case.reduction
            if case.dp_size > 2 and not case.reduce_scatter_with_fp32_accumulation:
                _large_dp_report(rec, case, ranks)
                table.append([case.name, case.pp_size, case.dp_size,
                              ",".join(str(p.num_microbatches) for p in case.plans),
                              reduction + " (ULP report)", "no"])
                timing_rows.extend(_timeline_rows(case, ranks))
                continue
            ref = reference_training(case.spec, case.plans, case.dp_size, lr=case.lr, reduction=reduction)
            names = sorted(ref.grads[0])
            ref_losses = _flatten_losses(ref.losses)
            ref_grads = _concat([ref.grads[s][n] for s in range(len(case.plans))
                                 for _ in range(case.dp_size) for n in names])
            ref_params = _concat([ref.params[s][n] for s in range(len(case.plans))
                                  for _ in range(case.dp_size) for n in names])
            for overlap in (True, False):
                got = _collect(case, ranks, overlap)
                tag = f"{case.name}, overlap {'on' if overlap else 'off'}"
                rec.compare(f"{tag}: losses vs refgrad", ref_losses, _flatten_losses(got["losses"]))
                rec.compare(f"{tag}: reduced grads vs refgrad", ref_grads,
                            _flatten_named(got["grads"], names))
                rec.compare(f"{tag}: params after SGD vs refgrad", ref_params,
                            _flatten_named(got["params"], names))
                sites = [res.launch_sites for res in got["ranks"]]
                if overlap:
                    # Step 0 learns the counts; later steps launch from hooks/dispatch only.
                    early = all(s != "finish" for per_rank in sites for step in per_rank[1:] for s in step)
                    rec.expect(f"{tag}: after the first batch every bucket launched before finish_grad_sync",
                               early, _site_counts(sites))
                else:
                    rec.expect(f"{tag}: without overlap every bucket is reduced in finish_grad_sync",
                               all(s == "finish" for per_rank in sites for step in per_rank for s in step),
                               _site_counts(sites))
                # Only the last stage owns the frozen parameter: it relearns on freeze and unfreeze.
                relearns = sorted((res.stage, res.relearn_count) for res in got["ranks"])
                expected = sorted((res.stage, 2 if res.stage == case.pp_size - 1 else 0)
                                  for res in got["ranks"])
                rec.expect(f"{tag}: freezing then unfreezing a parameter relearned the counts "
                           "twice on its stage only", relearns == expected,
                           f"(stage, relearn count) per rank: {relearns}")
                if case.virtual_stages > 1:
                    _interleaved_enable_report(rec, tag, case, got["ranks"], overlap)
            table.append([case.name, case.pp_size, case.dp_size,
                          ",".join(str(p.num_microbatches) for p in case.plans),
                          reduction, "yes" if case.use_distributed_optimizer else "no"])
            timing_rows.extend(_timeline_rows(case, ranks))
    rec.table("timelines per configuration (step 3, M=P; tiny layers: overhead-dominated, ms)",
              ["case", "overlap", "M", "step", "bubble", "exposed sync", "sync wait"], timing_rows,
              notes=["exposed sync = step end - end of the last compute on any rank"])
    rec.table("pipeline cases (bitwise: fastgrad overlap on, off and refgrad)",
              ["case", "P", "D", "M per step", "reduction", "dist. optimizer"], table,
              notes=["a parameter of the last stage is frozen in step 3 and unfrozen in step 4"])


def _interleaved_enable_report(rec: CheckRecorder, tag: str, case: PipelineCase,
                               results: list[RankResult], overlap: bool) -> None:
    """Chunks enable their sync once each, in reverse order; with overlap, chunk V-1 is
    already reducing when chunk 0 starts its last backward (its sync hides behind it)."""
    V = case.virtual_stages
    logs = [log for res in results for log in res.chunk_enables]
    order_ok = all([c for c, _ in log] == list(range(V - 1, -1, -1)) for log in logs)
    rec.expect(f"{tag}: chunks enabled their grad sync once each, last chunk first", order_ok,
               f"enable orders: {sorted({tuple(c for c, _ in log) for log in logs})}")
    in_flight = {log[-1][1][V - 1] for log in logs}
    rec.expect(f"{tag}: chunk {V - 1} {'was' if overlap else 'was not'} reducing when chunk 0 "
               "started its last backward", in_flight == {overlap},
               f"chunk {V - 1} in flight at chunk 0's enable: {sorted(in_flight)}")


CHECK = Check(
    name="pipeline",
    summary="1F1B with grad sync in the cooldown bubble: overlap on = off = refgrad, bitwise",
    run=run,
    default_candidate=PipelineCandidate.default(),
)

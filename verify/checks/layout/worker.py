"""Multi-rank part of the layout check: real gloo reductions through the buffers vs exact sums."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from gradvocab import Averaging, DDPConfig, ParallelDims
from refgrad.layout import Layout
from refgrad.layout import compute_layout as reference_layout
from verify.candidates import Candidate, LaunchSettings, Unsupported
from verify.candidates.interfaces import (
    BucketLayout,
    GradBuffer,
    GradBufferGroup,
    GradPiece,
)
from verify.check import launcher_for
from verify.checks.layout.buffers import padding_mask
from verify.distributed import DEFAULT_TIMEOUT_S, RankCrashed, spawn_each
from verify.metrics import bitwise_equal

# --------------------------------------------------------------------------- multi-rank


def grad_value(rank: int, iteration: int, microbatch: int, param_index: int, flat_index: int) -> int:
    """Integer test gradient in [-8, 8]: sums over <= 3 ranks x 2 microbatches stay exact in bf16."""
    return (param_index * 7 + flat_index * 3 + rank * 5 + iteration * 11 + microbatch * 13) % 17 - 8


def _grad_tensor(rank: int, iteration: int, microbatch: int, param_index: int, numel: int) -> torch.Tensor:
    flat = torch.arange(numel, dtype=torch.int64)
    const = param_index * 7 + rank * 5 + iteration * 11 + microbatch * 13
    return ((flat * 3 + const) % 17 - 8).to(torch.float64)


@dataclass(frozen=True)
class ReduceScenario:
    """One buffer configuration to reduce across real ranks (picklable)."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    config: DDPConfig
    shared: tuple[int, ...] = ()
    # how the replicas are combined: SUM, or the mean (PRESCALE: a 1/dp pre-scale; AVG, with
    # config.average_in_collective)
    averaging: Averaging = Averaging.SUM
    iterations: int = 2
    microbatches: int = 2

    def __post_init__(self) -> None:
        self.config.resolve_averaging(self.averaging)  # a bool or a contradiction is refused




def default_scenarios(world_size: int) -> list[ReduceScenario]:
    """Reduce-scatter (plain, averaged, fp32-accumulating), all-reduce, an all-padding shard."""
    shapes = ((3, 5), (40,), (7, 3), (64,), (30, 2), (1,))
    dtypes = ("bfloat16", "float32", "bfloat16", "bfloat16", "float32", "bfloat16")
    dist_opt = DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=60)
    fp32_accumulation = replace(dist_opt, reduce_scatter_with_fp32_accumulation=True)
    scenarios = [
        ReduceScenario("reduce-scatter SUM, mixed dtypes, shared embedding", shapes, dtypes, dist_opt, shared=(0,)),
        ReduceScenario(
            "all-reduce SUM (no distributed optimizer)", shapes, dtypes,
            DDPConfig(overlap_grad_reduce=True, bucket_size=60),
        ),
        ReduceScenario(
            "reduce-scatter with fp32 accumulation", shapes, ("bfloat16",) * len(shapes),
            fp32_accumulation,
        ),
        ReduceScenario(
            "one tiny param: most ranks' shards are all padding", ((5,),), ("bfloat16",),
            DDPConfig(use_distributed_optimizer=True),
        ),
    ]
    if world_size & (world_size - 1) == 0:  # averaging is exact only for power-of-two dp
        scenarios += [
            ReduceScenario(
                "reduce-scatter AVG in the collective", shapes, dtypes,
                replace(dist_opt, average_in_collective=True), averaging=Averaging.AVG,
            ),
            ReduceScenario(
                "fp32 grads of bf16 params, pre-scaled by 1/dp", shapes, ("bfloat16",) * len(shapes),
                replace(dist_opt, grad_reduce_in_fp32=True), averaging=Averaging.PRESCALE,
            ),
            ReduceScenario(  # the scaling folded into the fp32-accumulating reduction
                "fp32 accumulation, pre-scaled by 1/dp", shapes, ("bfloat16",) * len(shapes),
                fp32_accumulation, averaging=Averaging.PRESCALE,
            ),
        ]
    return scenarios


def _scenario_params(scenario: ReduceScenario, device: str) -> list[torch.Tensor]:
    params = []
    for i, (shape, dtype) in enumerate(zip(scenario.shapes, scenario.dtypes)):
        numel = math.prod(shape)
        values = (torch.arange(numel, dtype=torch.float64) % 5 + i).reshape(shape)
        p = torch.nn.Parameter(values.to(getattr(torch, dtype)).to(device))
        if i in scenario.shared:
            p.shared_embedding = True
        params.append(p)
    return params


def _regions(group: GradBufferGroup, rank: int, sharded: bool) -> list[tuple[int, int]]:
    """Where this rank's reduced grads are in the group buffer: its shard of each bucket (read
    from the shard views the candidate hands out), or every whole bucket (all-reduce)."""
    if not sharded:
        return [(b.start, b.end) for b in group.buckets]
    base, size = group.grad_data.data_ptr(), group.grad_data.element_size()
    regions = []
    for bucket in group.buckets:
        shard = bucket.grad_shard(rank)
        lo = (shard.data_ptr() - base) // size
        regions.append((lo, lo + shard.numel()))
    return regions


def _padding_is_zero(buffer: GradBuffer, masks: Sequence[torch.Tensor]) -> bool:
    """Every element where refgrad's layout puts no parameter is zero, in every group."""
    groups = buffer.groups
    if len(groups) != len(masks):
        return False
    for group, mask in zip(groups, masks):
        if group.grad_data.numel() != mask.numel() or bool(group.grad_data[mask].ne(0).any()):
            return False
    return True


def _unless_unsupported(helper: Callable[..., Any], missing: list[str], *args: Any) -> Any:
    """``helper(*args)``, or None with the reason noted when the candidate lacks the helper."""
    try:
        return helper(*args)
    except Unsupported as unsupported:
        if str(unsupported) not in missing:
            missing.append(str(unsupported))
        return None


def _plain_checkpoint(pieces: dict[int, list[GradPiece]] | None) -> dict | None:
    """Shard checkpoint pieces as plain lists (spawn results must not hold tensors)."""
    if pieces is None:
        return None
    return {i: [(piece.param_offset, piece.values.double().tolist()) for piece in ps]
            for i, ps in pieces.items()}


def reduce_worker(rank: int, world_size: int, scenario: ReduceScenario,
                  candidate: Candidate) -> dict[str, Any]:
    """Per rank: build one scenario's buffer, accumulate rank-specific grads, reduce, report.
    One scenario is one item of ``spawn_each``: what the candidate raises ends the world at
    once and is the scenario's crash (nothing is caught here)."""
    with candidate.layout() as layout:
        return _reduce_scenario(rank, world_size, scenario, layout)


def _reduce_scenario(rank: int, world_size: int, scenario: ReduceScenario,
                     layout: BucketLayout) -> dict[str, Any]:
    """One scenario on this rank: its iterations' records, or why the candidate skipped it."""
    params = _scenario_params(scenario, "cpu")
    before = [p.detach().clone() for p in params]
    try:
        buffer = layout.build_buffer(
            params, scenario.config, dp_size=world_size, dp_group=dist.group.WORLD,
            averaging=scenario.averaging,
        )
    except Unsupported as unsupported:
        return {"skipped": str(unsupported)}
    sharded = scenario.config.use_distributed_optimizer
    masks = [padding_mask(ref, "cpu") for _, _, ref in reference_layouts(scenario, world_size)]
    missing: list[str] = []
    out: dict[str, Any] = {
        "params_kept": all(bitwise_equal(a, p) for a, p in zip(before, params)),
        "iterations": [],
        "unsupported": missing,
    }
    for it in range(scenario.iterations):
        buffer.zero_grad()
        for mb in range(scenario.microbatches):
            for i, p in enumerate(params):
                g = _grad_tensor(rank, it, mb, i, p.numel()).reshape(p.shape)
                p.main_grad.add_(g.to(p.main_grad.dtype))
        in_flight = []
        for bucket in reversed(buffer.buckets):  # backprop order is reverse of layout
            bucket.start_grad_sync()
            in_flight.append(bucket.reduce_in_flight)
        for bucket in buffer.buckets:
            bucket.finish_grad_sync()
        norm_sq = _unless_unsupported(buffer.local_shard_grad_norm_sq, missing, rank) if sharded else 0.0
        pieces = _unless_unsupported(buffer.shard_checkpoint_grads, missing, rank) if sharded else {}
        record = {
            "in_flight_seen": all(in_flight),
            "padding_zero": _padding_is_zero(buffer, masks),
            "padding_helper": _unless_unsupported(buffer.padding_is_zero, missing),
            "groups": [],
            "local_norm_sq": None if norm_sq is None else float(norm_sq),
            "checkpoint": _plain_checkpoint(pieces),
        }
        for group in buffer.groups:
            regions = _regions(group, rank, sharded)
            record["groups"].append(
                {
                    "key": (str(group.param_dtype), str(group.grad_dtype)),
                    "regions": regions,
                    # Plain lists: tensors in spawn results travel through shared-memory
                    # file descriptors that vanish when the child exits.
                    "values": [group.grad_data[lo:hi].double().tolist() for lo, hi in regions],
                }
            )
        out["iterations"].append(record)
    return out


def reference_layouts(
    scenario: ReduceScenario, world_size: int
) -> list[tuple[tuple[str, str], list[int], Layout]]:
    """Per (param dtype, grad dtype) group in first-seen order: its key, its members'
    registration indices and refgrad's layout of them."""
    config = scenario.config
    groups: dict[tuple[str, str], list[int]] = {}
    for i, dtype in enumerate(scenario.dtypes):
        grad_dtype = "float32" if config.grad_reduce_in_fp32 else dtype
        groups.setdefault((f"torch.{dtype}", f"torch.{grad_dtype}"), []).append(i)
    return [
        (key, members, reference_layout(
            [math.prod(scenario.shapes[i]) for i in members],
            dp_size=world_size,
            bucket_size=config.resolved_bucket_size(world_size),
            use_distributed_optimizer=config.use_distributed_optimizer,
            pad_buckets_for_high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
            shared_embedding=[k for k, i in enumerate(members) if i in scenario.shared],
        ))
        for key, members in groups.items()
    ]


def expected_reduction(
    scenario: ReduceScenario, world_size: int, rank: int, iteration: int
) -> list[dict[str, Any]]:
    """Per group: this rank's regions and their exact reduced values, laid out by refgrad."""
    config = scenario.config
    expected = []
    for key, members, layout in reference_layouts(scenario, world_size):
        values = [Fraction(0)] * layout.numel
        scale = Fraction(1, world_size) if scenario.averaging.averages else Fraction(1)
        for k, i in enumerate(members):
            start, end, _ = layout.param_index_map[k]
            for flat in range(end - start):
                total = sum(
                    grad_value(q, iteration, mb, i, flat)
                    for q in range(world_size)
                    for mb in range(scenario.microbatches)
                )
                values[start + flat] = total * scale
        if config.use_distributed_optimizer:
            regions = [layout.shard(b, rank) for b in range(len(layout.bucket_indices))]
        else:
            regions = list(layout.bucket_indices)
        expected.append(
            {
                "key": key,
                "regions": regions,
                "values": [
                    torch.tensor([float(v) for v in values[lo:hi]], dtype=torch.float64)
                    for lo, hi in regions
                ],
                "all_values": values,
                "layout": layout,
                "members": members,
            }
        )
    return expected


def _checkpoint_problems(
    per_rank_checkpoints: Sequence[dict], expected: Sequence[dict[str, Any]], numels: Sequence[int]
) -> list[str]:
    """Shard checkpoints of all ranks hold every param element once, reduced, and no padding."""
    problems: list[str] = []
    location = {}
    for group in expected:
        for k, i in enumerate(group["members"]):
            location[i] = (group, group["layout"].param_index_map[k][0])
    covered = [[0] * n for n in numels]
    for rank, checkpoint in enumerate(per_rank_checkpoints):
        for i, pieces in checkpoint.items():
            group, start = location[i]
            for (lo, hi), values in pieces:
                for offset in range(lo, hi):
                    covered[i][offset] += 1
                want = torch.tensor(
                    [float(v) for v in group["all_values"][start + lo : start + hi]], dtype=torch.float64
                )
                # values against exact Fractions, which carry no sign of zero: a value test
                if not torch.equal(torch.tensor(values, dtype=torch.float64), want):
                    problems.append(f"rank {rank}: checkpoint piece of param {i} holds wrong values")
    for i, counts in enumerate(covered):
        if any(c != 1 for c in counts):
            problems.append(f"param {i}: shard checkpoints cover some elements {set(counts)} times")
    return problems


def scenario_settings(scenario: ReduceScenario, world_size: int) -> LaunchSettings:
    """The Megatron-LM settings a reduction scenario stands for."""
    config = scenario.config
    params = "bfloat16" if "bfloat16" in scenario.dtypes else "float32"
    return LaunchSettings(
        dims=ParallelDims(dp_size=world_size), params_dtype=params,
        grad_dtype="float32" if config.grad_reduce_in_fp32 else params,
        use_distributed_optimizer=config.use_distributed_optimizer,
        overlap_grad_reduce=config.overlap_grad_reduce,
        ddp_reduce_scatter_with_fp32_accumulation=config.reduce_scatter_with_fp32_accumulation,
        ddp_average_in_collective=config.average_in_collective,
        calculate_per_token_loss=scenario.averaging.megatron_flags().calculate_per_token_loss,
        has_output_layer=False,
        microbatches=(scenario.microbatches,) * scenario.iterations)


@dataclass(frozen=True)
class ScenarioResult:
    """One scenario across the ranks: its (label, passed, detail) checks, or the crash that
    ended its world, or why the candidate skipped it."""

    label: str
    settings: LaunchSettings
    checks: tuple[tuple[str, bool, str], ...] = ()
    crash: RankCrashed | None = None
    skipped: str | None = None
    missing: tuple[str, ...] = ()  # the buffer helpers the candidate lacks (reasons)


def run_reduce_scenarios(
    world_size: int,
    scenarios: Sequence[ReduceScenario],
    candidate: Candidate,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[ScenarioResult]:
    """Each scenario on ``world_size`` gloo ranks reducing through ``candidate``'s buffers:
    fresh processes per scenario for a candidate that keeps process-wide state (so none
    reaches the next), else one world until a crash."""
    outcomes = spawn_each(reduce_worker, world_size, list(scenarios), candidate,
                          isolate=candidate.isolates_configurations, timeout_s=timeout_s,
                          launcher=launcher_for(candidate))
    results = []
    for scenario, outcome in zip(scenarios, outcomes, strict=True):
        label = f"dp={world_size}: {scenario.name}"
        settings = scenario_settings(scenario, world_size)
        if outcome.crash is not None:
            results.append(ScenarioResult(label, settings, crash=outcome.crash))
            continue
        per_rank = outcome.results
        if "skipped" in per_rank[0]:
            results.append(ScenarioResult(label, settings, skipped=per_rank[0]["skipped"]))
            continue
        missing = tuple(dict.fromkeys(reason for r in range(world_size)
                                      for reason in per_rank[r]["unsupported"]))
        results.append(ScenarioResult(label, settings, tuple(
            _iteration_checks(label, scenario, world_size, per_rank)), missing=missing))
    return results


def _iteration_checks(label: str, scenario: ReduceScenario, world_size: int,
                      per_rank: list[dict]) -> list[tuple[str, bool, str]]:
    """(label, passed, detail) for each iteration of one scenario, every rank's record held
    to refgrad's layout and the exact reduced values."""
    checks = []
    for it in range(scenario.iterations):
        norm_total: float | None = 0.0
        problems: list[str] = []
        expected_norm = None
        for rank in range(world_size):
            got = per_rank[rank]
            record = got["iterations"][it]
            if not got["params_kept"]:
                problems.append(f"rank {rank}: param values changed when remapped")
            if not record["in_flight_seen"]:
                problems.append(f"rank {rank}: reduce_in_flight was False after start")
            if not record["padding_zero"]:
                problems.append(f"rank {rank}: padding became non-zero")
            if record["padding_helper"] is not None and record["padding_helper"] != record["padding_zero"]:
                problems.append(f"rank {rank}: padding_is_zero says {record['padding_helper']}, "
                                f"the padding refgrad's layout gives is {'' if record['padding_zero'] else 'not '}zero")
            want = expected_reduction(scenario, world_size, rank, it)
            if [g["key"] for g in record["groups"]] != [g["key"] for g in want]:
                problems.append(f"rank {rank}: groups {[g['key'] for g in record['groups']]}")
                continue
            for g_got, g_want in zip(record["groups"], want):
                if [tuple(r) for r in g_got["regions"]] != [tuple(r) for r in g_want["regions"]]:
                    problems.append(f"rank {rank} {g_want['key']}: shard ranges differ from refgrad")
                    continue
                for b, (v_got, v_want) in enumerate(zip(g_got["values"], g_want["values"])):
                    v_got = torch.tensor(v_got, dtype=torch.float64)
                    # v_want holds exact Fractions, which carry no sign of zero: a value test
                    if not torch.equal(v_got, v_want):
                        bad = int((v_got != v_want).sum())
                        problems.append(f"rank {rank} {g_want['key']} bucket {b}: {bad} elements differ")
            if record["local_norm_sq"] is None:
                norm_total = None
            elif norm_total is not None:
                norm_total += record["local_norm_sq"]
            if expected_norm is None:
                expected_norm = sum(float(v) ** 2 for g in want for v in g["all_values"])
        checkpoints = [per_rank[r]["iterations"][it]["checkpoint"] for r in range(world_size)]
        if scenario.config.use_distributed_optimizer and None not in checkpoints:
            problems += _checkpoint_problems(
                checkpoints,
                expected_reduction(scenario, world_size, 0, it),
                [math.prod(shape) for shape in scenario.shapes],
            )
        if (scenario.config.use_distributed_optimizer and expected_norm is not None
                and norm_total is not None):
            # Integer/dyadic grads: every square and partial sum is exact in float64.
            if norm_total != expected_norm:
                problems.append(f"sum of local shard norms^2 {norm_total} != exact {expected_norm}")
        checks.append((f"{label}, iteration {it}", not problems, "; ".join(problems[:5])))
    return checks

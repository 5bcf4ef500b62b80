"""The reduce_scatter check's multi-rank part: the candidate's collectives on real gloo groups vs refgrad.

One world of ``max(sizes, average_sizes)`` ranks; every rank creates the groups of ranks
``0..W-1`` and, inside ``with candidate.grad_reduction()``, runs the candidate's
fp32-accumulating reduce-scatter in every mode the check's :class:`CollectivePlan` holds
(those the candidate takes). Then each DDP bucket case (:mod:`verify.checks.reduce_scatter.buckets`)
in a world of its own size; their refgrad references are computed meanwhile in a process of
their own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradvocab import Averaging, ParallelDims
from refgrad import reduce_scatter as refc
from refgrad.formats import tensor_bit_patterns
from verify.candidates import Candidate, LaunchSettings, Unsupported
from verify.candidates.interfaces import (
    REDUCTION_BEHAVIOURS,
    Behaviour,
    DocumentedBehaviour,
    GradReduction,
)
from verify.check import CheckContext, CheckRecorder, launcher_for, run_part
from verify.checks.reduce_scatter.buckets import (
    bucket_references_process,
    bucket_worker,
    check_bucket_cases,
)
from verify.checks.reduce_scatter.cases import (
    AVERAGE_SIZES,
    COLLECTIVE_AVERAGINGS,
    DTYPE_NAMES,
    ITERATIONS,
    MODES,
    BucketCase,
    average_sensitive_input,
    bucket_cases,
    order_sensitive_input,
    rank_input,
)
from verify.distributed import ItemOutcome, spawn, spawn_each


@dataclass(frozen=True)
class CollectivePlan:
    """The ops (as averagings) the candidate's fp32-accumulating reduce-scatter takes, plain
    and through a caller's scratch: decided in the check's process, where an op the candidate
    lacks is recorded as a skip."""

    ops: tuple[Averaging, ...]
    scratch_ops: tuple[Averaging, ...]

    def modes(self, averaging: Averaging) -> tuple[str, ...]:
        """The modes ``averaging`` runs in (``MODES`` without ``scratch`` where it has none)."""
        return tuple(m for m in MODES if m != "scratch" or averaging in self.scratch_ops)


def collective_plan(reduction: GradReduction, rec: CheckRecorder) -> CollectivePlan:
    """Ask the candidate for each op's collectives; each it lacks is a skip naming the parts."""
    ops, scratch_ops = [], []
    for averaging in COLLECTIVE_AVERAGINGS:
        op = averaging.reduce_op
        try:
            reduction.reduce_scatter(op)
        except Unsupported as unsupported:
            rec.skip(f"fp32-accumulating reduce-scatter with op={averaging} (every mode, the "
                     f"order-sensitive and average-sensitive inputs): {unsupported}")
            continue
        ops.append(averaging)
        try:
            reduction.scratch_reduce_scatter(op)
        except Unsupported as unsupported:
            rec.skip(f"fp32-accumulating reduce-scatter with op={averaging} through a caller's "
                     f"scratch: {unsupported}")
            continue
        scratch_ops.append(averaging)
    return CollectivePlan(tuple(ops), tuple(scratch_ops))


def run_modes(reduction: GradReduction, plan: CollectivePlan, rank: int, size: int, group,
              shard: int, seed: int) -> list[dict]:
    """Every (dtype, iteration, op, mode) of the candidate's reduce-scatter on this rank of
    ``group``: sync, async, caller scratch and in place (the output a view of the input)."""
    records = []
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for it in range(ITERATIONS):
            x = rank_input(rank, size, size * shard, dtype, it, seed)
            record = {"dtype": dtype_name, "it": it, "input": x.clone()}
            for averaging in plan.ops:
                op = averaging.reduce_op
                reduce_scatter = reduction.reduce_scatter(op)
                out = torch.empty(shard, dtype=dtype)
                reduce_scatter(out, x, group=group, op=op)
                record[(averaging, "sync")] = out
                out = torch.empty(shard, dtype=dtype)
                reduce_scatter(out, x, group=group, op=op, async_op=True).wait()
                record[(averaging, "async")] = out
                if averaging in plan.scratch_ops:
                    out = torch.empty(shard, dtype=dtype)
                    scratch = torch.empty(x.numel(), dtype=dtype)
                    reduction.scratch_reduce_scatter(op)(out, x, scratch, group=group, op=op)
                    record[(averaging, "scratch")] = out
                buffer = x.clone()
                view = buffer[rank * shard : (rank + 1) * shard]
                reduce_scatter(view, buffer, group=group, op=op, async_op=True).wait()
                record[(averaging, "in_place")] = view.clone()
            records.append(record)
    return records


def _run_order_sensitive(reduction: GradReduction, plan: CollectivePlan, rank: int, size: int,
                         group, shard: int, seed: int) -> list[dict]:
    """Order-sensitive inputs through the candidate (sync, every op it takes) on one group."""
    records = []
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for it in range(ITERATIONS):
            x = order_sensitive_input(rank, size, size * shard, dtype, it, seed)
            record = {"dtype": dtype_name, "it": it, "input": x.clone()}
            for averaging in plan.ops:
                out = torch.empty(shard, dtype=dtype)
                reduction.reduce_scatter(averaging.reduce_op)(out, x, group=group, op=averaging.reduce_op)
                record[averaging] = out
            records.append(record)
    return records


def _run_average_sensitive(reduction: GradReduction, rank: int, size: int, group, shard: int,
                           seed: int) -> list[dict]:
    """AVG (sync and async) of inputs on which production's pre-scale differs from fp32 sum / W."""
    records = []
    avg = Averaging.AVG.reduce_op
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for it in range(ITERATIONS):
            x = average_sensitive_input(rank, size, size * shard, dtype, it, seed)
            record = {"dtype": dtype_name, "it": it, "input": x.clone()}
            out = torch.empty(shard, dtype=dtype)
            reduction.reduce_scatter(avg)(out, x, group=group, op=avg)
            record["sync"] = out
            out = torch.empty(shard, dtype=dtype)
            reduction.reduce_scatter(avg)(out, x, group=group, op=avg, async_op=True).wait()
            record["async"] = out
            records.append(record)
    return records


def _rank_worker(rank: int, world_size: int, item: str, sizes, average_sizes, shard: int,
                 seed: int, candidate: Candidate, plan: CollectivePlan) -> dict:
    """One spawned rank: every mode on groups of ranks 0..size-1 for each size, the
    order-sensitive inputs on groups of 3 or more ranks, AVG of average-sensitive inputs on
    groups of each of ``average_sizes`` (where the candidate's collective takes AVG)."""
    del item  # the one item of the collectives' world
    results, ordered, averaged = {}, {}, {}
    # Every rank creates every group, in the same order (torch.distributed's rule).
    groups = {size: dist.new_group(list(range(size))) if size < world_size else None
              for size in sorted({*sizes, *average_sizes})}
    with candidate.grad_reduction() as reduction:
        for size in sizes:
            if rank < size:
                results[size] = run_modes(reduction, plan, rank, size, groups[size], shard, seed)
                if size >= 3:
                    ordered[size] = _run_order_sensitive(reduction, plan, rank, size, groups[size],
                                                         shard, seed)
        for size in average_sizes if Averaging.AVG in plan.ops else ():
            if rank < size:
                averaged[size] = _run_average_sensitive(reduction, rank, size, groups[size], shard,
                                                        seed)
    return {"modes": results, "order_sensitive": ordered, "average_sensitive": averaged}


COLLECTIVES = "the fp32-accumulating reduce-scatter called directly"


def collectives_settings(world: int) -> LaunchSettings:
    """The collectives part is a direct call of the candidate's reduce-scatter function."""
    return LaunchSettings(dims=ParallelDims(dp_size=world), params_dtype="bfloat16",
                          grad_dtype="bfloat16", use_distributed_optimizer=True,
                          ddp_reduce_scatter_with_fp32_accumulation=True, has_output_layer=False,
                          direct_call=f"{COLLECTIVES} on process groups of 2 to {world} ranks")


def _plan_and_behaviour(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate,
                        cases: list[BucketCase]
                        ) -> tuple[CollectivePlan, dict[Behaviour, DocumentedBehaviour],
                                   dict[BucketCase, str]]:
    """Which ops the candidate's collectives take, its documented reduction behaviour, and
    the bucket cases it refuses up front (with why)."""
    with candidate.grad_reduction() as reduction:
        return (collective_plan(reduction, rec), candidate.departures(REDUCTION_BEHAVIOURS),
                bucket_refusals(reduction, cases))


def check_multi_rank(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """The candidate's reduce-scatter on real gloo groups (every mode, SUM and AVG) vs
    refgrad fp32/rank, bitwise; at W >= 3 also on order-sensitive inputs; then its DDP
    bucket reduction vs refgrad's DP mean (or sum), each case in a world of its own size,
    documented departures classified."""
    sizes = (2, 3) if ctx.quick else (2, 3, 4)
    average_sizes = AVERAGE_SIZES[:2] if ctx.quick else AVERAGE_SIZES
    shard = 16 if ctx.quick else 96
    cases = bucket_cases(average_sizes)
    plan, behaviour, refused = run_part(ctx, rec, candidate, _plan_and_behaviour, cases)
    running = [case for case in cases if case not in refused]
    world = max(*sizes, *average_sizes)
    launcher = launcher_for(candidate)
    # refgrad's bucket references (seconds of exact arithmetic) in a process of their own,
    # while the ranks run; only for the cases the candidate runs
    with ThreadPoolExecutor(max_workers=1) as pool:
        references = pool.submit(spawn, bucket_references_process, 1, running, behaviour, ctx.seed,
                                 timeout_s=ctx.timeout_s, launcher=launcher)
        collectives = None
        if plan.ops:  # a candidate without the fp32-accumulating collective: nothing to run
            (collectives,) = spawn_each(_rank_worker, world, [COLLECTIVES], sizes, average_sizes,
                                        shard, ctx.seed, candidate, plan, isolate=True,
                                        timeout_s=ctx.timeout_s, launcher=launcher)
        bucket_outcomes = {case: ItemOutcome([{"skip": reason}]) for case, reason in refused.items()}
        for size in dict.fromkeys(case.size for case in running):
            group = [case for case in running if case.size == size]
            bucket_outcomes.update(zip(group, spawn_each(
                bucket_worker, size, group, candidate, ctx.seed,
                isolate=candidate.isolates_configurations, timeout_s=ctx.timeout_s,
                launcher=launcher), strict=True))
        computed = references.result()[0]
    expected = {(cases.index(running[index]), dtype, it): value
                for (index, dtype, it), value in computed.items()}
    if collectives is not None:
        with rec.case(COLLECTIVES, collectives_settings(world)):
            if collectives.crash is not None:
                rec.crash(COLLECTIVES, collectives.crash, candidate)
            else:
                _check_collectives(rec, candidate, collectives.results, plan, sizes, average_sizes)
    check_bucket_cases(rec, [bucket_outcomes[case] for case in cases], cases, behaviour,
                       expected, candidate)


def bucket_refusals(reduction: GradReduction, cases: list) -> dict:
    """The bucket cases the candidate refuses up front (Unsupported from the accessor, asked in
    the check's process), with the reason: no ranks and no references for them."""
    refused = {}
    for case in cases:
        try:
            if case.reduce_dtype is None:
                reduction.bucket_reduction(case.config)
            else:
                reduction.reduce_in(case.config, getattr(torch, case.reduce_dtype))
        except Unsupported as unsupported:
            refused[case] = str(unsupported)
    return refused


def _check_collectives(rec: CheckRecorder, candidate: Candidate, per_rank: list[dict],
                       plan: CollectivePlan, sizes, average_sizes) -> None:
    for size in sizes:
        records = [per_rank[r]["modes"][size] for r in range(size)]
        for i, first in enumerate(records[0]):
            inputs = [records[r][i]["input"] for r in range(size)]
            for averaging in plan.ops:
                expected_rs = refc.reduce_scatter(inputs, accumulate="fp32", order="rank",
                                                  op=averaging)
                for mode in plan.modes(averaging):
                    got = torch.cat([records[r][i][(averaging, mode)] for r in range(size)])
                    rec.compare(
                        f"{candidate.name} vs refgrad fp32/rank: W={size} {first['dtype']} "
                        f"it={first['it']} op={averaging} {mode}",
                        torch.cat(expected_rs), got,
                    )
    for size in (s for s in sizes if s >= 3):
        records = [per_rank[r]["order_sensitive"][size] for r in range(size)]
        for i, first in enumerate(records[0]):
            inputs = [records[r][i]["input"] for r in range(size)]
            for averaging in plan.ops:
                expected_rs = refc.reduce_scatter(inputs, accumulate="fp32", order="rank",
                                                  op=averaging)
                got = torch.cat([records[r][i][averaging] for r in range(size)])
                rec.compare(
                    f"order-sensitive reduce-scatter vs refgrad fp32/rank: W={size} "
                    f"{first['dtype']} it={first['it']} op={averaging}",
                    torch.cat(expected_rs), got,
                )
    if Averaging.AVG in plan.ops:
        check_average_sensitive(rec, per_rank, average_sizes)


def check_average_sensitive(rec: CheckRecorder, per_rank: list[dict], average_sizes) -> None:
    """AVG on average-sensitive inputs vs refgrad's fp32 sum / W, bitwise; first proves
    with refgrad that production's pre-scale in the 16-bit dtype gives other bits on
    most elements there, so a candidate that pre-scales cannot pass."""
    for size in average_sizes:
        records = [per_rank[r]["average_sensitive"][size] for r in range(size)]
        for i, first in enumerate(records[0]):
            inputs = [records[r][i]["input"] for r in range(size)]
            tag = f"W={size} {first['dtype']} it={first['it']}"
            expected = torch.cat(refc.reduce_scatter(inputs, accumulate="fp32", order="rank",
                                                     op=Averaging.AVG))
            prescaled = refc.prescale_like_torch(inputs, Averaging.PRESCALE.factors(size).pre_scale)
            production = torch.cat(refc.reduce_scatter(prescaled, accumulate="fp32",
                                                       order="rank", op=Averaging.SUM))
            differ = int((tensor_bit_patterns(production) != tensor_bit_patterns(expected)).sum())
            rec.expect(
                f"average-sensitive inputs ({tag}): refgrad's model of production's pre-scale "
                "by 1/W in the 16-bit dtype differs from fp32 sum / W on most elements",
                2 * differ > expected.numel(),
                f"elements that differ: {differ} of {expected.numel()}",
            )
            for mode in ("sync", "async"):
                got = torch.cat([records[r][i][mode] for r in range(size)])
                rec.compare(f"average-sensitive AVG vs refgrad fp32 sum / W: {tag} {mode}",
                            expected, got)

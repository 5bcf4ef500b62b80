"""The reduce_scatter check's multi-rank part: the candidate on real gloo groups vs refgrad, bitwise."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from fastgrad.reduce_scatter import AVG
from refgrad import reduce_scatter as refc
from refgrad.formats import tensor_bit_patterns
from verify.check import CheckContext, CheckRecorder
from verify.checks.reduce_scatter.candidate import ReduceScatterCandidate
from verify.checks.reduce_scatter.cases import (
    AVERAGE_SIZES,
    DTYPE_NAMES,
    ITERATIONS,
    MODES,
    OPS,
    average_sensitive_input,
    order_sensitive_input,
    rank_input,
)
from verify.distributed import spawn


def run_modes(candidate: Callable, rank: int, size: int, group, shard: int, seed: int):
    """Every (dtype, iteration, op, mode) of ``candidate`` on this rank of ``group``:
    sync, async, caller scratch and in place (the output a view of the input buffer)."""
    records = []
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for it in range(ITERATIONS):
            x = rank_input(rank, size, size * shard, dtype, it, seed)
            record = {"dtype": dtype_name, "it": it, "input": x.clone()}
            for op_name, op in OPS.items():
                out = torch.empty(shard, dtype=dtype)
                candidate(out, x, group=group, op=op)
                record[(op_name, "sync")] = out
                out = torch.empty(shard, dtype=dtype)
                candidate(out, x, group=group, op=op, async_op=True).wait()
                record[(op_name, "async")] = out
                out = torch.empty(shard, dtype=dtype)
                scratch = torch.empty(x.numel(), dtype=dtype)
                candidate(out, x, group=group, op=op, scratch=scratch)
                record[(op_name, "scratch")] = out
                buffer = x.clone()
                view = buffer[rank * shard : (rank + 1) * shard]
                candidate(view, buffer, group=group, op=op, async_op=True).wait()
                record[(op_name, "in_place")] = view.clone()
            records.append(record)
    return records


def _run_order_sensitive(candidate: Callable, rank: int, size: int, group, shard: int, seed: int):
    """Order-sensitive inputs through the candidate (sync, SUM and AVG) on one group."""
    records = []
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for it in range(ITERATIONS):
            x = order_sensitive_input(rank, size, size * shard, dtype, it, seed)
            record = {"dtype": dtype_name, "it": it, "input": x.clone()}
            for op_name, op in OPS.items():
                out = torch.empty(shard, dtype=dtype)
                candidate(out, x, group=group, op=op)
                record[op_name] = out
            records.append(record)
    return records


def _run_average_sensitive(candidate: Callable, rank: int, size: int, group, shard: int,
                           seed: int):
    """AVG (sync and async) of inputs on which production's pre-scale differs from fp32 sum / W."""
    records = []
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for it in range(ITERATIONS):
            x = average_sensitive_input(rank, size, size * shard, dtype, it, seed)
            record = {"dtype": dtype_name, "it": it, "input": x.clone()}
            out = torch.empty(shard, dtype=dtype)
            candidate(out, x, group=group, op=AVG)
            record["sync"] = out
            out = torch.empty(shard, dtype=dtype)
            candidate(out, x, group=group, op=AVG, async_op=True).wait()
            record["async"] = out
            records.append(record)
    return records


def _rank_worker(rank: int, world_size: int, sizes, average_sizes, shard: int, seed: int,
                 candidate) -> dict:
    """One spawned rank: every mode on groups of ranks 0..size-1 for each size, the
    order-sensitive inputs on groups of 3 or more ranks, then AVG of average-sensitive
    inputs on groups of each of ``average_sizes``."""
    results, ordered, averaged = {}, {}, {}
    # Every rank creates every group, in the same order (torch.distributed's rule).
    groups = {size: dist.new_group(list(range(size))) if size < world_size else None
              for size in sorted({*sizes, *average_sizes})}
    for size in sizes:
        if rank < size:
            results[size] = run_modes(candidate, rank, size, groups[size], shard, seed)
            if size >= 3:
                ordered[size] = _run_order_sensitive(candidate, rank, size, groups[size], shard,
                                                     seed)
    for size in average_sizes:
        if rank < size:
            averaged[size] = _run_average_sensitive(candidate, rank, size, groups[size], shard,
                                                    seed)
    return {"modes": results, "order_sensitive": ordered, "average_sensitive": averaged}


def check_multi_rank(
    ctx: CheckContext, rec: CheckRecorder, candidate: ReduceScatterCandidate
) -> None:
    """The candidate's reduce-scatter on real gloo groups (every mode, SUM and AVG) vs
    refgrad fp32/rank, bitwise; at W >= 3 also on order-sensitive inputs."""
    sizes = (2, 3) if ctx.quick else (2, 3, 4)
    average_sizes = AVERAGE_SIZES[:2] if ctx.quick else AVERAGE_SIZES
    shard = 16 if ctx.quick else 96
    per_rank = spawn(_rank_worker, max(*sizes, *average_sizes), sizes, average_sizes, shard,
                     ctx.seed, candidate.reduce_scatter, timeout_s=ctx.timeout_s)
    for size in sizes:
        records = [per_rank[r]["modes"][size] for r in range(size)]
        for i, first in enumerate(records[0]):
            inputs = [records[r][i]["input"] for r in range(size)]
            for op_name in OPS:
                expected = refc.reduce_scatter(inputs, accumulate="fp32", order="rank", op=op_name)
                for mode in MODES:
                    got = torch.cat([records[r][i][(op_name, mode)] for r in range(size)])
                    rec.compare(
                        f"fastgrad vs refgrad fp32/rank: W={size} {first['dtype']} "
                        f"it={first['it']} op={op_name} {mode}",
                        torch.cat(expected), got,
                    )
    for size in (s for s in sizes if s >= 3):
        records = [per_rank[r]["order_sensitive"][size] for r in range(size)]
        for i, first in enumerate(records[0]):
            inputs = [records[r][i]["input"] for r in range(size)]
            for op_name in OPS:
                expected = refc.reduce_scatter(inputs, accumulate="fp32", order="rank", op=op_name)
                got = torch.cat([records[r][i][op_name] for r in range(size)])
                rec.compare(
                    f"order-sensitive reduce-scatter vs refgrad fp32/rank: W={size} "
                    f"{first['dtype']} it={first['it']} op={op_name}",
                    torch.cat(expected), got,
                )
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
                                                     op="avg"))
            prescaled = refc.prescale_like_torch(inputs, 1.0 / size)
            production = torch.cat(refc.reduce_scatter(prescaled, accumulate="fp32",
                                                       order="rank", op="sum"))
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

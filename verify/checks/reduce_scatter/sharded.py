"""The reduce_scatter check's part for parameters sharded one by one (FSDP2's): uneven dim-0
shards, several microbatches a step with the grad sync on the last one only, each
``reduce_dtype``.

Every rank's microbatch grads are rank-specific and whole (one per parameter, in the
unsharded parameters' dtype); the candidate reduces them (``GradReduction.sharded_reduction``)
and returns its rows of every parameter's reduced grad. The spec is refgrad's: the exact DP
mean of the grads summed over the microbatches, rounded once to the sharded parameters' dtype,
the rows of ``refgrad.layout_torch.fsdp2_shards``. A candidate documenting its averaging
(``Behaviour.DIVIDE_FACTORS``) is held bitwise to refgrad's model of it:
``refgrad.reduce_torch.fsdp2_accumulate`` per rank, the reduce-scatter input laid out by
``fsdp2_reduce_scatter_placement``, ``fsdp2_reduce_scatter`` in gloo's order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction

import torch

from gradvocab import ParallelDims
from refgrad import formats
from refgrad.layout_torch import fsdp2_reduce_scatter_placement, fsdp2_shards
from refgrad.reduce_torch import fsdp2_accumulate, fsdp2_reduce_scatter
from verify.candidates import Candidate, LaunchSettings, Unsupported
from verify.candidates.interfaces import (
    REDUCTION_BEHAVIOURS,
    Behaviour,
    DocumentedBehaviour,
    ShardedGradCase,
)
from verify.check import CheckContext, CheckRecorder
from verify.distributed import RankLauncher, spawn_each

SHAPES = ((5, 3), (7,), (2, 4), (1,), (9, 2))
ITERATIONS = 2
CASES = (
    ShardedGradCase(SHAPES, "float32", "bfloat16", "float32"),  # torchtitan's mixed precision
    ShardedGradCase(SHAPES, "float32", "bfloat16", "bfloat16"),
    ShardedGradCase(SHAPES, "float32", "float16", "float16"),
    ShardedGradCase(SHAPES, "float32", "float32", None),
    ShardedGradCase(SHAPES, "bfloat16", "bfloat16", None),
)


def sharded_label(case: ShardedGradCase) -> str:
    """How reports name a sharded-gradient case."""
    reduce = case.reduce_dtype or "none"
    return (f"params {case.orig_dtype}, compute {case.param_dtype}, reduce_dtype {reduce}, "
            f"{case.microbatches} microbatches, shapes {list(case.shapes)}")


def microbatch_grads(rank: int, case: ShardedGradCase, iteration: int, seed: int
                     ) -> list[list[torch.Tensor]]:
    """Rank ``rank``'s grads of every microbatch (per parameter, whole, ``param_dtype``)."""
    g = torch.Generator().manual_seed(seed * 7919 + 977 * iteration + 13 * rank + 5)
    dtype = getattr(torch, case.param_dtype)
    return [[(torch.randn(shape, generator=g) * (rank + 1)).to(dtype) for shape in case.shapes]
            for _ in range(case.microbatches)]


def _worker(rank: int, world: int, case: ShardedGradCase, candidate: Candidate, seed: int) -> list:
    with candidate.grad_reduction() as reduction:
        step = reduction.sharded_reduction(case)
        return [step(microbatch_grads(rank, case, it, seed), group=None) for it in range(ITERATIONS)]


def spec(case: ShardedGradCase, world: int, per_rank: list[list[list[torch.Tensor]]]
         ) -> list[torch.Tensor]:
    """Every parameter's exact DP mean of the microbatch sums, rounded once to ``orig_dtype``."""
    fmt = formats.format_of(getattr(torch, case.orig_dtype))
    out = []
    for i, shape in enumerate(case.shapes):
        columns = [formats.decode_tensor(per_rank[r][m][i]) for r in range(world)
                   for m in range(case.microbatches)]
        values = [sum((Fraction(c[j]) for c in columns), Fraction(0)) / world
                  for j in range(math.prod(shape))]
        out.append(formats.round_values_to_tensor(fmt, values, shape))
    return out


def model(case: ShardedGradCase, world: int, per_rank: list[list[list[torch.Tensor]]]
          ) -> list[list[torch.Tensor]]:
    """refgrad's model of FSDP2: per rank, every parameter's reduced rows (module docstring)."""
    reduce = None if case.reduce_dtype is None else getattr(torch, case.reduce_dtype)
    placement = fsdp2_reduce_scatter_placement(case.shapes, world)
    inputs = []
    for r in range(world):
        accumulated = [fsdp2_accumulate([per_rank[r][m][i] for m in range(case.microbatches)],
                                        reduce_dtype=reduce) for i in range(len(case.shapes))]
        chunks = []
        for c in range(world):
            for acc, shape in zip(accumulated, case.shapes):
                shard = fsdp2_shards(shape[0], world)[c]
                padded = acc.new_zeros((shard.padded_rows, *shape[1:]))
                padded[:shard.rows] = acc[shard.start:shard.stop]
                chunks.append(padded.reshape(-1))
        inputs.append(torch.cat(chunks))
    outputs = fsdp2_reduce_scatter(inputs, reduce_dtype=reduce,
                                   orig_dtype=getattr(torch, case.orig_dtype),
                                   order="rank" if world <= 2 else "gloo_ring")
    rows = []
    for r in range(world):
        mine = []
        for offset, shape in zip(placement.offsets, case.shapes):
            shard = fsdp2_shards(shape[0], world)[r]
            numel = shard.rows * math.prod(shape[1:])
            mine.append(outputs[r][offset:offset + numel].reshape(shard.rows, *shape[1:]))
        rows.append(mine)
    return rows


def _documented(behaviour: Mapping[Behaviour, DocumentedBehaviour]) -> DocumentedBehaviour | None:
    parts = [behaviour[b] for b in (Behaviour.DIVIDE_FACTORS, Behaviour.WIRE_COLLECTIVE) if b in behaviour]
    if Behaviour.DIVIDE_FACTORS not in behaviour:
        return None
    return DocumentedBehaviour("; then ".join(b.summary for b in parts), "; ".join(b.where for b in parts))


def check_sharded(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """Every case at each DP size against the spec (the model where documented)."""
    with candidate.grad_reduction() as reduction:
        try:
            reduction.sharded_reduction(CASES[0])
        except Unsupported as unsupported:
            rec.skip(f"parameters sharded one by one (uneven shards, microbatches without grad "
                     f"sync, each reduce_dtype): {unsupported}")
            return
        documented = _documented(candidate.departures(REDUCTION_BEHAVIOURS))
    launcher = RankLauncher().preloading(*candidate.preload_modules)
    for world in (3,) if ctx.quick else (2, 3, 4):
        outcomes = spawn_each(_worker, world, list(CASES), candidate, ctx.seed,
                              isolate=candidate.isolates_configurations, timeout_s=ctx.timeout_s,
                              launcher=launcher)
        for case, outcome in zip(CASES, outcomes, strict=True):
            label = f"W={world} sharded parameters: {sharded_label(case)}"
            api = (f"MixedPrecisionPolicy(param_dtype={case.param_dtype}, "
                   f"reduce_dtype={case.reduce_dtype})", "set_requires_gradient_sync(False) but on "
                   "the last microbatch")
            settings = LaunchSettings(dims=ParallelDims(dp_size=world), has_output_layer=False,
                                      microbatches=(case.microbatches,) * ITERATIONS, torch_api=api)
            with rec.case(label, settings):
                if outcome.crash is not None:
                    rec.crash(label, outcome.crash, candidate)
                    continue
                _compare(rec, label, case, world, outcome.results, ctx.seed, documented)


def _compare(rec: CheckRecorder, label: str, case: ShardedGradCase, world: int, results: list,
             seed: int, documented: DocumentedBehaviour | None) -> None:
    for it in range(ITERATIONS):
        per_rank = [microbatch_grads(r, case, it, seed) for r in range(world)]
        exact = spec(case, world, per_rank)
        modelled = None if documented is None else model(case, world, per_rank)
        for i, shape in enumerate(case.shapes):
            shards = fsdp2_shards(shape[0], world)
            want = torch.cat([exact[i][s.start:s.stop].reshape(-1) for s in shards])
            got = torch.cat([results[r][it][i].reshape(-1) for r in range(world)])
            reference = (None if modelled is None
                         else torch.cat([modelled[r][i].reshape(-1) for r in range(world)]))
            rec.compare_documented(f"{label}, iteration {it + 1}: param {i} {list(shape)}", want,
                                   got, documented=documented, documented_reference=reference)

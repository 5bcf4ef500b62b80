"""The deferred_wgrad check's multi-rank worker: each case, deferred and immediate, on one rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradvocab import ParallelDims
from refgrad.deferred_wgrad import (
    deferred_accumulation_order,
)
from verify.candidates import Candidate, Unsupported
from verify.candidates.interfaces import DeferredWgrad, OutputLayerConfig
from verify.checks.deferred_wgrad.cases import (
    BATCH,
    HIDDEN,
    ITERATIONS,
    SEQ,
    VOCAB,
    WgradCase,
    case_data,
)
from verify.checks.deferred_wgrad.single import guard_facts, stale_step_facts
from verify.metrics import bitwise_equal


def run_layer(case, wgrad: DeferredWgrad, config, weight, xs, gos, rank, order_of):
    """Run ITERATIONS steps; return main_grad after each, drain counts, dgrads, empty-drain facts.

    What the candidate raises (a drain that fails) is not caught: it ends the case's world
    and is the case's crash."""
    tp = case.tp
    vshard = VOCAB // tp
    sshard = SEQ // tp if case.sequence_parallel else SEQ
    vrank = rank if tp > 1 else 0
    layer = wgrad.output_layer(
        weight[vrank * vshard : (vrank + 1) * vshard],
        config,
        main_grad_dtype=getattr(torch, case.main_grad_dtype),
    )
    grads_after, drained, dgrads, empty_drain_ok = [], [], [], True
    for it in range(ITERATIONS):
        layer.start_step()
        step_dgrads = {}
        for k in order_of(it):
            x_full = xs[it][k]
            x = x_full[vrank * sshard : (vrank + 1) * sshard] if case.sequence_parallel else x_full
            x = x.clone().requires_grad_(True)
            go = gos[it][k][..., vrank * vshard : (vrank + 1) * vshard].contiguous()
            layer(x).backward(go)
            step_dgrads[k] = x.grad
        drained.append(layer.drain())
        snapshot = layer.main_grad.clone()
        # A second drain finds 0 entries: it must return 0 and leave main_grad alone.
        empty_drain_ok &= layer.drain() == 0
        empty_drain_ok &= bitwise_equal(layer.main_grad, snapshot)
        grads_after.append(snapshot)
        dgrads.append([step_dgrads[k] for k in range(case.num_microbatches)])
    return grads_after, drained, dgrads, empty_drain_ok


def run_case_on_rank(
    case: WgradCase,
    seed: int,
    rank: int,
    tp_group: dist.ProcessGroup | None,
    wgrad: DeferredWgrad,
) -> dict:
    """Deferred, immediate, and immediate-in-drain-order runs of one case on this rank."""
    data_rank = rank if case.tp == 1 else 0
    weight, xs, gos = case_data(case, seed, data_rank)
    m = case.num_microbatches
    # The last stage of a PP 2 pipeline (the drain runs in its flush), TP over the case's group.
    dims = ParallelDims(tp_size=case.tp, pp_size=2, sequence_parallel=case.sequence_parallel)
    if case.tp > 1:
        dims = dims.with_groups(tp_group=tp_group)
    deferred_cfg = OutputLayerConfig(defer_embedding_wgrad_compute=True,
                                     wgrad_deferral_limit=case.limit, dims=dims)
    immediate_cfg = OutputLayerConfig(dims=dims)
    natural = lambda it: range(m)  # noqa: E731
    drain_order = lambda it: deferred_accumulation_order(m, case.limit)  # noqa: E731
    deferred = run_layer(case, wgrad, deferred_cfg, weight, xs, gos, rank, natural)
    immediate = run_layer(case, wgrad, immediate_cfg, weight, xs, gos, rank, natural)
    reordered = run_layer(case, wgrad, immediate_cfg, weight, xs, gos, rank, drain_order)
    dgrad_equal = all(
        bitwise_equal(a, b)
        for it in range(ITERATIONS)
        for a, b in zip(deferred[2][it], immediate[2][it])
    )
    return {
        "deferred": deferred[0],
        "immediate": immediate[0],
        "reordered": reordered[0],
        "drained": deferred[1],
        "immediate_drained": immediate[1],
        "empty_drain_ok": deferred[3] and immediate[3],
        "dgrad_equal": dgrad_equal,
    }


def _tied_embedding_on_rank(rank: int, seed: int, main_grad_dtype: str, wgrad: DeferredWgrad) -> list[dict]:
    """Stage 0: word-embedding grads; stage 1: deferred output layer; then the tied all-reduce."""
    dtype = getattr(torch, main_grad_dtype)
    g = torch.Generator().manual_seed(seed * 31 + 5)
    weight = torch.randn(VOCAB, HIDDEN, generator=g).bfloat16()
    out = []
    if rank == 0:
        main_grad = torch.zeros(VOCAB, HIDDEN, dtype=dtype)
    else:
        config = OutputLayerConfig(defer_embedding_wgrad_compute=True, dims=ParallelDims(pp_size=2))
        layer = wgrad.output_layer(weight, config, main_grad_dtype=dtype)
        main_grad = layer.main_grad
    for _ in range(ITERATIONS):
        # Every iteration starts from zeros, as after the optimizer step's zero_grad.
        main_grad.zero_()
        if rank == 1:
            layer.start_step()
        for _ in range(3):
            if rank == 0:
                tokens = torch.randint(0, VOCAB, (SEQ * BATCH,), generator=g)
                rows = torch.randn(SEQ * BATCH, HIDDEN, generator=g).bfloat16()
                main_grad.index_add_(0, tokens, rows.to(dtype))
            else:
                x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).bfloat16().requires_grad_(True)
                go = torch.randn(SEQ, BATCH, VOCAB, generator=g).bfloat16()
                layer(x).backward(go)
        if rank == 1:
            layer.drain()
        before = main_grad.clone()
        wgrad.allreduce_tied_embedding_grad(main_grad, dist.group.WORLD)
        out.append({"before": before, "after": main_grad.clone()})
    return out


@dataclass(frozen=True)
class WorldItem:
    """One item of the check's 2-rank worlds: a case (``WgradCase`` fields), the tied
    embedding in one ``main_grad`` dtype, or one of the single-process parts (``guard``,
    ``stale``), which every rank runs alike (rank 0's result is read)."""

    kind: str  # "case" | "tied" | "guard" | "stale"
    case: tuple[tuple[str, Any], ...] = ()
    dtype: str = ""

    @property
    def label(self) -> str:
        if self.kind == "case":
            return WgradCase(**dict(self.case)).label
        return {"tied": f"tied/{self.dtype}", "guard": "guard", "stale": "stale step"}[self.kind]


def item_worker(rank: int, world_size: int, item: WorldItem, seed: int,
                candidate: Candidate) -> Any:
    """One item on this rank, inside its own ``with candidate.deferred_wgrad()`` (a
    candidate's process-wide setup, Megatron's global memory buffer, is made and undone
    around each item); ``{"unsupported": reason}`` where the candidate cannot run it."""
    del world_size
    try:
        with candidate.deferred_wgrad() as wgrad:
            if item.kind == "case":
                case = WgradCase(**dict(item.case))
                return run_case_on_rank(case, seed, rank,
                                        dist.group.WORLD if case.tp > 1 else None, wgrad)
            if item.kind == "tied":
                return _tied_embedding_on_rank(rank, seed, item.dtype, wgrad)
            if item.kind == "guard":
                return guard_facts(seed, wgrad)
            return stale_step_facts(seed, wgrad)
    except Unsupported as unsupported:
        return {"unsupported": str(unsupported)}

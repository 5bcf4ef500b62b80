"""The deferred_wgrad check's comparisons: rank results vs immediate mode, the drain order and refgrad; the guard and stale-step cases; the wgrad GEMM methods."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

import torch

from gradvocab import ParallelDims
from refgrad.deferred_wgrad import (
    deferred_accumulation_order,
    fastgrad_error_factor,
    reference_main_grad,
    tied_embedding_grad_sum,
)
from verify.candidates import Candidate, LaunchSettings
from verify.candidates.interfaces import DeferredWgrad, WgradGemm
from verify.check import CheckContext, CheckRecorder, launcher_for
from verify.checks.deferred_wgrad.cases import (
    BATCH,
    HIDDEN,
    ITERATIONS,
    SEQ,
    VOCAB,
    WORLD,
    WgradCase,
    build_cases,
    case_data,
    compared_with_refgrad,
)
from verify.checks.deferred_wgrad.single import STALE_LIMIT
from verify.checks.deferred_wgrad.worker import WorldItem, item_worker
from verify.distributed import ItemOutcome, spawn_each
from verify.metrics import compare


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and compare(a, b).bitwise_equal


def abs_products(xs, gos) -> torch.Tensor:
    """``A = sum_k |G_k|ᵀ|X_k|`` over both iterations in float64 (products exact; 2^-40 slack)."""
    total = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
    for it in range(ITERATIONS):
        for k in range(len(xs[it])):
            go = gos[it][k].reshape(-1, VOCAB).double().abs()
            x = xs[it][k].reshape(-1, HIDDEN).double().abs()
            total += go.t() @ x
    return total * (1 + 2.0**-40)


def _reference(case: WgradCase, xs, gos, order: list[int]) -> torch.Tensor:
    """refgrad over both iterations as one sequence of 2M microbatches in ``order`` per step."""
    m = case.num_microbatches
    flat_x = [x for it in range(ITERATIONS) for x in xs[it]]
    flat_g = [g for it in range(ITERATIONS) for g in gos[it]]
    full_order = [it * m + k for it in range(ITERATIONS) for k in order]
    return reference_main_grad(
        flat_g, flat_x, main_grad_dtype=getattr(torch, case.main_grad_dtype), order=full_order
    )


def _ulp_row(label: str, ref: torch.Tensor, cand: torch.Tensor, bound_ok: bool) -> list:
    c = compare(ref, cand)
    return [label, c.bitwise_equal, c.max_ulp, round(c.mean_ulp, 3), bound_ok]


def case_settings(case: WgradCase) -> LaunchSettings:
    """The Megatron-LM settings a case stands for: the last stage of PP 2 (where the drain
    runs), its TP layout, deferral, and M microbatches in each of its steps."""
    return LaunchSettings(
        dims=ParallelDims(tp_size=case.tp, pp_size=2, sequence_parallel=case.sequence_parallel),
        params_dtype="bfloat16", grad_dtype=case.main_grad_dtype,
        defer_embedding_wgrad_compute=True, wgrad_deferral_limit=case.limit,
        microbatches=(case.num_microbatches,) * ITERATIONS)


TIED_SETTINGS = LaunchSettings(dims=ParallelDims(pp_size=2), params_dtype="bfloat16",
                               defer_embedding_wgrad_compute=True, microbatches=(3,) * ITERATIONS)
STALE_SETTINGS = LaunchSettings(dims=ParallelDims(pp_size=2), params_dtype="bfloat16",
                                defer_embedding_wgrad_compute=True,
                                wgrad_deferral_limit=STALE_LIMIT, microbatches=(2,),
                                after_abandoned_step=True)
GUARD_SETTINGS = LaunchSettings(dims=ParallelDims(pp_size=2), params_dtype="bfloat16",
                                defer_embedding_wgrad_compute=True, microbatches=(1,),
                                direct_call="a drain told that the weight's bucket is reducing")


def _values(rec: CheckRecorder, item: WorldItem, outcome: ItemOutcome, candidate: Candidate,
            settings: LaunchSettings) -> list | None:
    """Every rank's value of an item, or None after recording its crash (as the case
    ``item.label``) or a skip where the candidate cannot run it."""
    if outcome.crash is not None:
        with rec.case(item.label, settings):
            rec.crash(item.label, outcome.crash, candidate)
        return None
    reasons = {v["unsupported"] for v in outcome.results
               if isinstance(v, dict) and "unsupported" in v}
    if reasons:
        rec.skip(f"{item.label}: {' / '.join(sorted(reasons))}")
        return None
    return outcome.results


def _run_items(ctx: CheckContext, candidate: Candidate, items: list[WorldItem]
               ) -> list[ItemOutcome]:
    """Every item on 2-rank worlds, one world until an item crashes. The items are the
    output layer's per-layer settings (microbatches, deferral limit, main-grad dtype) on the
    check's two layouts: nothing of one lives on after it (each builds its own layers, and
    the candidate's process-wide setup is made and undone around each), so they share a
    world whatever the candidate; a crash still ends its world at once and the next item
    starts a fresh one."""
    return spawn_each(item_worker, WORLD, items, ctx.seed, candidate, isolate=False,
                      timeout_s=ctx.timeout_s,
                      launcher=launcher_for(candidate))


def _case_expectations(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate,
                       case: WgradCase, results: list, expected_drained: list[int],
                       deferred_vs_immediate: list, ref_rows: list) -> None:
    """One case's expectations and comparisons on every rank: drain counts, deferred vs
    immediate (bitwise, or in the drain order), and refgrad where the case is compared."""
    m, limit = case.num_microbatches, case.limit
    ranks = range(WORLD)
    for r, res in zip(ranks, results):
        tag = f"{case.label}/rank{r}"
        rec.expect(f"{tag}: drain count", res["drained"] == expected_drained,
                   f"drained {res['drained']}, expected {expected_drained}")
        rec.expect(f"{tag}: immediate drain is empty", res["immediate_drained"] == [0] * ITERATIONS,
                   f"immediate mode drained {res['immediate_drained']}")
        rec.expect(f"{tag}: 0-entry drain leaves main_grad unchanged", res["empty_drain_ok"])
        rec.expect(f"{tag}: dgrads deferred == immediate (bitwise)", res["dgrad_equal"])
        for it in range(ITERATIONS):
            d, i, o = res["deferred"][it], res["immediate"][it], res["reordered"][it]
            rec.expect(
                f"{tag}/iter{it}: deferred == immediate in drain order (bitwise)",
                bits_equal(d, o),
                "the deferred run must equal the immediate path that adds in order "
                f"{deferred_accumulation_order(m, limit)}",
            )
            if not case.reorders or case.lane == "grid":
                # Same order of adds, or every partial sum exact: must be bitwise.
                rec.compare(f"{tag}/iter{it}: deferred vs immediate", i, d, max_ulp=0)
            else:
                deferred_vs_immediate.append((case, r, it, i, d))

    # refgrad: gather the TP shards into the full [V, H] gradient per data rank.
    data_ranks = list(ranks) if case.tp == 1 else [0]
    for dr in data_ranks if compared_with_refgrad(case, ctx.quick) else []:
        _, xs, gos = case_data(case, ctx.seed, dr)
        order = deferred_accumulation_order(m, limit)
        final = (
            results[dr]["deferred"][-1]
            if case.tp == 1
            else torch.cat([res["deferred"][-1] for res in results], dim=0)
        )
        ref = _reference(case, xs, gos, order)
        tag = f"{case.label}/data{dr}"
        if case.lane == "grid":
            rec.compare(f"{tag}: {candidate.name} vs refgrad (exact grid)", ref, final, max_ulp=0)
        else:
            factor = fastgrad_error_factor(
                SEQ * BATCH, ITERATIONS * m, main_grad_dtype=getattr(torch, case.main_grad_dtype)
            )
            a = abs_products(xs, gos)
            err = (final.double() - ref.double()).abs()
            ok = bool((err <= a * float(factor)).all())
            rec.expect(
                f"{tag}: |{candidate.name} - refgrad| <= {float(factor):.3g}·A",
                ok,
                f"max err/A = {float((err / a.clamp_min(1e-300)).max()):.3g}",
            )
            ref_rows.append(_ulp_row(tag, ref, final, ok))


def run_deferred_wgrad_check(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """The multi-rank cases, the tied embedding, the guard and the stale step, each an item
    of the check's 2-rank worlds (the ranks ask the candidate for their own interface)."""
    cases = build_cases(ctx.quick)
    multi = [c for c in cases if c.tp > 1]
    single = [c for c in cases if c.tp == 1]
    items = ([WorldItem("case", tuple(asdict(c).items())) for c in cases]
             + [WorldItem("tied", dtype=d) for d in ("float32", "bfloat16")]
             + [WorldItem("guard"), WorldItem("stale")])
    outcomes = dict(zip(items, _run_items(ctx, candidate, items), strict=True))

    deferred_vs_immediate, drain_order_rows, ref_rows = [], [], []
    for case, item in zip(cases, items):
        results = _values(rec, item, outcomes[item], candidate, case_settings(case))
        if results is None:
            continue
        m, limit = case.num_microbatches, case.limit
        expected_drained = [m if limit == 0 else min(limit, m)] * ITERATIONS
        with rec.case(case.label, case_settings(case)):
            _case_expectations(ctx, rec, candidate, case, results, expected_drained,
                               deferred_vs_immediate, ref_rows)

    # Reordered cases: not bitwise; hold them to the bound and report ULPs.
    for case, r, it, imm, dfr in deferred_vs_immediate:
        _, xs, gos = case_data(case, ctx.seed, r if case.tp == 1 else 0)
        factor = fastgrad_error_factor(
            SEQ * BATCH, ITERATIONS * case.num_microbatches,
            main_grad_dtype=getattr(torch, case.main_grad_dtype),
        )
        a = abs_products(xs, gos)
        if case.tp > 1:
            vshard = VOCAB // case.tp
            a = a[r * vshard : (r + 1) * vshard]
        ok = bool(((imm.double() - dfr.double()).abs() <= a * float(factor)).all())
        tag = f"{case.label}/rank{r}/iter{it}"
        rec.expect(f"{tag}: deferred vs immediate within the reorder bound", ok)
        drain_order_rows.append(_ulp_row(tag, imm, dfr, ok))

    rec.table(
        "deferred vs immediate where deferral reorders the fp32 adds (0 < limit < M)",
        ["case", "bitwise", "max ulp", "mean ulp", "within bound"],
        drain_order_rows,
        notes=[
            "Order of adds: limit..M-1 then 0..limit-1 (production's drain). Bitwise equal "
            "to the immediate path run in that order (expectations above).",
            "Bound: 2((1+γ(T))(1+γ'(2M+1))-1)·A, A = Σ|G||X|, γ' with the main_grad format's "
            "accumulation roundoff; no ULP bound exists in general (cancellation).",
        ],
    )
    rec.table(
        f"{candidate.name} vs refgrad, random bf16 data (refgrad in the real order of adds)",
        ["case", "bitwise", "max ulp", "mean ulp", "within bound"],
        ref_rows,
        notes=["The GEMM's fp32 summation order (BLAS/cuBLAS) is the only unfixed rounding."],
    )

    # Tied embeddings: both stages equal, and equal to the exact sum rounded once.
    for dtype in ("float32", "bfloat16"):
        item = WorldItem("tied", dtype=dtype)
        stages = _values(rec, item, outcomes[item], candidate, TIED_SETTINGS)
        if stages is None:
            continue
        stage0, stage1 = stages
        with rec.case(item.label, TIED_SETTINGS):
            for it in range(ITERATIONS):
                tag = f"tied/{dtype}/iter{it}"
                rec.compare(f"{tag}: stage0 vs stage1 after all-reduce", stage0[it]["after"],
                            stage1[it]["after"])
                expected = tied_embedding_grad_sum([stage0[it]["before"], stage1[it]["before"]])
                rec.compare(f"{tag}: vs refgrad tied sum", expected, stage1[it]["after"])

    item = WorldItem("guard")
    guard = _values(rec, item, outcomes[item], candidate, GUARD_SETTINGS)
    if guard is not None:
        with rec.case(item.label, GUARD_SETTINGS):
            facts = guard[0]
            rec.expect("guard: drain into an in-flight bucket raises LifecycleError", facts["raised"])
            rec.expect("guard: main_grad untouched after the refusal", facts["untouched"])
            rec.expect("guard: the deferred entry is still there to drain later", facts["kept"])
    item = WorldItem("stale")
    stale = _values(rec, item, outcomes[item], candidate, STALE_SETTINGS)
    if stale is not None:
        with rec.case(item.label, STALE_SETTINGS):
            rec.expect("stale step: start_step clears both buffers (bitwise equal to a fresh "
                       "layer)", stale[0]["same"], stale[0]["detail"])
    rec.note(
        f"{len(cases)} cases ({len(single)} at TP 1 on each of {WORLD} processes, {len(multi)} at TP 2), "
        f"{ITERATIONS} iterations each; {len(drain_order_rows)} (case, rank, iteration) results "
        "reorder the fp32 adds under deferral and are not bitwise equal to microbatch order "
        f"({sum(1 for row in drain_order_rows if not row[1])} of them actually differ)."
    )


def compare_wgrad_gemms_on(
    device: str, rec: CheckRecorder, seed: int, gemms: Sequence[WgradGemm]
) -> None:
    """``main_grad += goᵀ·x`` on ``device`` with each of a candidate's wgrad GEMMs vs
    refgrad, on the exact grid.

    On the grid lane every product and partial sum is exact, so any summation
    order inside the GEMM must give refgrad's bits.
    """
    for dtype in ("float32", "bfloat16"):
        case = WgradCase(1, False, 3, 0, dtype, "grid")
        _, xs, gos = case_data(case, seed, data_rank=0)
        expected = reference_main_grad(gos[0], xs[0], main_grad_dtype=getattr(torch, dtype))
        for gemm in gemms:
            main_grad = torch.zeros(VOCAB, HIDDEN, dtype=getattr(torch, dtype), device=device)
            try:
                for x, go in zip(xs[0], gos[0]):
                    gemm(main_grad, go.to(device), x.to(device))
            except (RuntimeError, NotImplementedError) as exc:
                # addmm with both out_dtype and out= has been broken in some torch releases.
                rec.note(f"{device} wgrad method {gemm.name!r} is unavailable on this torch: {exc}")
                continue
            rec.compare(f"{device} wgrad {gemm.name}: main_grad {dtype} (exact grid)",
                        expected, main_grad.cpu())


def check_cuda_wgrad(ctx: CheckContext, rec: CheckRecorder, wgrad: DeferredWgrad) -> None:
    """With ``--device cuda``: the candidate's fp32-accumulating wgrad GEMMs (cuBLAS) vs refgrad."""
    if ctx.device != "cuda":
        rec.skip("CUDA wgrad GEMM (cuBLAS, fp32 output) vs refgrad: run `verify run --device cuda`")
        return
    compare_wgrad_gemms_on("cuda", rec, ctx.seed, wgrad.wgrad_gemms("cuda"))

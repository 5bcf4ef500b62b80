"""Check ``deferred_wgrad``: deferred embedding wgrad vs immediate, vs refgrad, and tied grads.

What it establishes, on real gloo process groups (2 processes):

1. Deferred vs immediate ``main_grad``, bitwise, over two iterations (``main_grad``
   carries over from the first into the second), for M in {1, 3, 8}
   microbatches, limit in {0, 1, 2, M}, TP 1 (rank-specific data on each
   process) and TP 2 with sequence parallelism off and on, fp32 and bf16
   ``main_grad``. Where the deferral changes the order of the fp32 adds
   (``0 < limit < M``) bitwise equality with microbatch order does not hold
   (fp32 addition is not associative); there the check requires bitwise equality
   with the immediate path run in production's drain order
   (``limit..M-1, 0..limit-1``) instead, and holds the microbatch-order result
   to the Higham bound, reporting the ULP distances it finds.
   dgrads must be bitwise equal in every case (they always run at once).
2. fastgrad vs refgrad (``refgrad.deferred_wgrad.reference_main_grad`` in the order
   the adds really happen): bitwise on a small-integer grid where every partial
   sum is exact in the ``main_grad`` format; within
   ``fastgrad_error_factor(T, 2M) * A`` elementwise on random data (the GEMM's
   summation order is the only unfixed rounding), with ULPs reported.
3. The 0-entry drain (immediate mode; a second drain) returns 0 and leaves
   ``main_grad`` bitwise unchanged; 1-entry drains run (limit 1, M = 1).
4. Tied embeddings (stage 0 = word embedding, stage 1 = deferred output layer):
   after the embedding-group all-reduce both stages hold bitwise the same
   ``main_grad``, equal to refgrad's correctly rounded sum of the two.
5. The in-flight guard refuses to drain into a bucket whose reduce has started.
6. A step abandoned after a backward (entries left in both buffers) does not
   leak into the next step: ``start_step`` clears both (production clears one).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from fastgrad.deferred_wgrad import (
    CUDA_WGRAD_METHODS,
    ColumnParallelOutputLayer,
    EmbeddingWgradConfig,
    accumulate_wgrad_,
    allreduce_tied_embedding_grad,
)
from fastgrad.errors import LifecycleError
from refgrad.deferred_wgrad import (
    deferred_accumulation_order,
    fastgrad_error_factor,
    reference_main_grad,
    tied_embedding_grad_sum,
)
from verify.check import Check, CheckContext, CheckRecorder
from verify.distributed import spawn
from verify.metrics import compare

SEQ, BATCH, HIDDEN, VOCAB = 4, 2, 8, 8
ITERATIONS = 2
WORLD = 2
LANES = ("random", "grid")


@dataclass(frozen=True)
class WgradCase:
    """One configuration of the output layer to run deferred and immediate."""

    tp: int
    sequence_parallel: bool
    num_microbatches: int
    limit: int
    main_grad_dtype: str  # "float32" | "bfloat16"
    lane: str  # "random" (bf16 normals) | "grid" (values in {-1, 0, 1}·2^-k)

    def __post_init__(self) -> None:
        for name in ("tp", "num_microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WgradCase.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 0:
            raise ValueError(f"WgradCase.limit must be an int >= 0, got {self.limit!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(
                f"WgradCase.sequence_parallel must be a bool, got {type(self.sequence_parallel).__name__}"
            )
        if self.main_grad_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"WgradCase.main_grad_dtype must be 'float32' or 'bfloat16', got {self.main_grad_dtype!r}"
            )
        if self.lane not in LANES:
            raise ValueError(f"WgradCase.lane must be one of {LANES}, got {self.lane!r}")

    @property
    def label(self) -> str:
        sp = "sp" if self.sequence_parallel else "nosp"
        return (
            f"tp{self.tp}-{sp}-M{self.num_microbatches}-limit{self.limit}-"
            f"{self.main_grad_dtype}-{self.lane}"
        )

    @property
    def reorders(self) -> bool:
        """True when deferral changes the order of the fp32 adds (0 < limit < M)."""
        return 0 < self.limit < self.num_microbatches


def build_cases(quick: bool) -> list[WgradCase]:
    """Every case the check runs; ``quick`` drops M = 8."""
    counts = (1, 3) if quick else (1, 3, 8)
    parallel = ((1, False), (2, False), (2, True))
    cases = []
    for (tp, sp), m, dtype, lane in itertools.product(
        parallel, counts, ("float32", "bfloat16"), LANES
    ):
        for limit in sorted({0, 1, 2, m}):
            cases.append(WgradCase(tp, sp, m, limit, dtype, lane))
    return cases


def compared_with_refgrad(case: WgradCase, quick: bool) -> bool:
    """The cases whose result is also compared with refgrad (Fraction arithmetic is slow).

    Each parallel layout and dtype in both lanes, with the drain reordering the adds
    (M = 3, limit 1); the full run adds one microbatch alone and a long step (M = 8, limit 2).
    """
    picked = {(3, 1)} if quick else {(3, 1), (1, 0), (8, 2)}
    return (case.num_microbatches, case.limit) in picked


def case_data(
    case: WgradCase, seed: int, data_rank: int
) -> tuple[torch.Tensor, list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Full (unsharded) weight, inputs and output grads: ``xs[it][k]``, ``gos[it][k]``."""
    # Not hash(label): str hashes are salted per process, and the parent regenerates this data.
    offset = int.from_bytes(case.label.encode()[-8:], "little") + len(case.label)
    g = torch.Generator().manual_seed(seed * 7919 + data_rank * 104_729 + offset)

    def tensor(shape, scale_exp: int) -> torch.Tensor:
        if case.lane == "grid":
            # Products are multiples of 2^-5 with |p| <= 2^-5; 8 tokens x 2M <= 16
            # microbatches sum to <= 2^2: every partial sum is exact even in bf16.
            return (torch.randint(-1, 2, shape, generator=g) * 2.0**-scale_exp).bfloat16()
        return torch.randn(shape, generator=g).bfloat16()

    weight = tensor((VOCAB, HIDDEN), 3)
    xs = [[tensor((SEQ, BATCH, HIDDEN), 2) for _ in range(case.num_microbatches)] for _ in range(ITERATIONS)]
    gos = [[tensor((SEQ, BATCH, VOCAB), 3) for _ in range(case.num_microbatches)] for _ in range(ITERATIONS)]
    return weight, xs, gos


def _run_layer(case, layer_cls, config, weight, xs, gos, rank, order_of, tp_group):
    """Run ITERATIONS steps; return main_grad after each, drain counts, dgrads, empty-drain facts."""
    tp = case.tp
    vshard = VOCAB // tp
    sshard = SEQ // tp if case.sequence_parallel else SEQ
    vrank = rank if tp > 1 else 0
    layer = layer_cls(
        weight[vrank * vshard : (vrank + 1) * vshard],
        config,
        tp_group=tp_group,
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
        drained.append(layer.drain_deferred_wgrad())
        snapshot = layer.weight.main_grad.clone()
        # A second drain finds 0 entries: it must return 0 and leave main_grad alone.
        empty_drain_ok &= layer.drain_deferred_wgrad() == 0
        empty_drain_ok &= torch.equal(
            layer.weight.main_grad.view(torch.int16 if snapshot.itemsize == 2 else torch.int32),
            snapshot.view(torch.int16 if snapshot.itemsize == 2 else torch.int32),
        )
        grads_after.append(snapshot)
        dgrads.append([step_dgrads[k] for k in range(case.num_microbatches)])
    return grads_after, drained, dgrads, empty_drain_ok


def run_case_on_rank(
    case: WgradCase,
    seed: int,
    rank: int,
    tp_group: dist.ProcessGroup | None,
    layer_cls: type[ColumnParallelOutputLayer],
) -> dict:
    """Deferred, immediate, and immediate-in-drain-order runs of one case on this rank."""
    data_rank = rank if case.tp == 1 else 0
    weight, xs, gos = case_data(case, seed, data_rank)
    m = case.num_microbatches
    deferred_cfg = EmbeddingWgradConfig(
        defer_embedding_wgrad_compute=True,
        wgrad_deferral_limit=case.limit,
        pipeline_model_parallel_size=2,
        tensor_model_parallel_size=case.tp,
        sequence_parallel=case.sequence_parallel,
    )
    immediate_cfg = EmbeddingWgradConfig(
        pipeline_model_parallel_size=2,
        tensor_model_parallel_size=case.tp,
        sequence_parallel=case.sequence_parallel,
    )
    natural = lambda it: range(m)  # noqa: E731
    drain_order = lambda it: deferred_accumulation_order(m, case.limit)  # noqa: E731
    deferred = _run_layer(case, layer_cls, deferred_cfg, weight, xs, gos, rank, natural, tp_group)
    immediate = _run_layer(case, ColumnParallelOutputLayer, immediate_cfg, weight, xs, gos, rank, natural, tp_group)
    reordered = _run_layer(case, ColumnParallelOutputLayer, immediate_cfg, weight, xs, gos, rank, drain_order, tp_group)
    dgrad_equal = all(
        torch.equal(a, b)
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


def _tied_embedding_on_rank(rank: int, seed: int, main_grad_dtype: str, layer_cls) -> list[dict]:
    """Stage 0: word-embedding grads; stage 1: deferred output layer; then the tied all-reduce."""
    dtype = getattr(torch, main_grad_dtype)
    g = torch.Generator().manual_seed(seed * 31 + 5)
    weight = torch.randn(VOCAB, HIDDEN, generator=g).bfloat16()
    out = []
    if rank == 0:
        main_grad = torch.zeros(VOCAB, HIDDEN, dtype=dtype)
    else:
        config = EmbeddingWgradConfig(defer_embedding_wgrad_compute=True, pipeline_model_parallel_size=2)
        layer = layer_cls(weight, config, main_grad_dtype=dtype)
        main_grad = layer.weight.main_grad
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
            layer.drain_deferred_wgrad()
        before = main_grad.clone()
        allreduce_tied_embedding_grad(main_grad, dist.group.WORLD)
        out.append({"before": before, "after": main_grad.clone()})
    return out


def _rank_main(rank: int, world_size: int, cases: list[dict], seed: int, layer_cls) -> dict:
    """Everything that needs processes: the TP cases and the tied-embedding exchange."""
    results = {}
    for spec in cases:
        case = WgradCase(**spec)
        results[case.label] = run_case_on_rank(
            case, seed, rank, dist.group.WORLD if case.tp > 1 else None, layer_cls
        )
    tied = {d: _tied_embedding_on_rank(rank, seed, d, layer_cls) for d in ("float32", "bfloat16")}
    return {"cases": results, "tied": tied}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and compare(a, b).bitwise_equal


def _abs_products(xs, gos) -> torch.Tensor:
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


@dataclass(frozen=True)
class DeferredWgradCandidate:
    """The deferred-wgrad implementation under test: the layer class and the wgrad GEMM."""

    layer_cls: type = ColumnParallelOutputLayer
    accumulate: Callable = accumulate_wgrad_

    def __post_init__(self) -> None:
        if not isinstance(self.layer_cls, type):
            raise TypeError("DeferredWgradCandidate.layer_cls must be a class")
        if not callable(self.accumulate):
            raise TypeError("DeferredWgradCandidate.accumulate must be callable")

    @classmethod
    def default(cls) -> DeferredWgradCandidate:
        """fastgrad's ``ColumnParallelOutputLayer`` and ``accumulate_wgrad_``."""
        return cls()


def run_deferred_wgrad_check(
    ctx: CheckContext, rec: CheckRecorder, candidate: DeferredWgradCandidate
) -> None:
    """The multi-rank cases, the tied embedding, the guard and the stale step."""
    layer_cls = candidate.layer_cls
    cases = build_cases(ctx.quick)
    multi = [c for c in cases if c.tp > 1]
    single = [c for c in cases if c.tp == 1]
    # TP-1 cases run on every process with that process's own data (rank-specific).
    per_rank = [
        r for r in spawn(_rank_main, WORLD, [asdict(c) for c in cases], ctx.seed, layer_cls,
                   timeout_s=ctx.timeout_s)
    ]

    deferred_vs_immediate, drain_order_rows, ref_rows = [], [], []
    for case in cases:
        ranks = range(WORLD)
        results = [per_rank[r]["cases"][case.label] for r in ranks]
        m, limit = case.num_microbatches, case.limit
        expected_drained = [m if limit == 0 else min(limit, m)] * ITERATIONS
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
                    _bits_equal(d, o),
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
                rec.compare(f"{tag}: fastgrad vs refgrad (exact grid)", ref, final, max_ulp=0)
            else:
                factor = fastgrad_error_factor(
                    SEQ * BATCH, ITERATIONS * m, main_grad_dtype=getattr(torch, case.main_grad_dtype)
                )
                a = _abs_products(xs, gos)
                err = (final.double() - ref.double()).abs()
                ok = bool((err <= a * float(factor)).all())
                rec.expect(
                    f"{tag}: |fastgrad - refgrad| <= {float(factor):.3g}·A",
                    ok,
                    f"max err/A = {float((err / a.clamp_min(1e-300)).max()):.3g}",
                )
                ref_rows.append(_ulp_row(tag, ref, final, ok))

    # Reordered cases: not bitwise; hold them to the bound and report ULPs.
    for case, r, it, imm, dfr in deferred_vs_immediate:
        _, xs, gos = case_data(case, ctx.seed, r if case.tp == 1 else 0)
        factor = fastgrad_error_factor(
            SEQ * BATCH, ITERATIONS * case.num_microbatches,
            main_grad_dtype=getattr(torch, case.main_grad_dtype),
        )
        a = _abs_products(xs, gos)
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
        "fastgrad vs refgrad, random bf16 data (refgrad in the real order of adds)",
        ["case", "bitwise", "max ulp", "mean ulp", "within bound"],
        ref_rows,
        notes=["The GEMM's fp32 summation order (BLAS/cuBLAS) is the only unfixed rounding."],
    )

    # Tied embeddings: both stages equal, and equal to the exact sum rounded once.
    for dtype in ("float32", "bfloat16"):
        stage0, stage1 = per_rank[0]["tied"][dtype], per_rank[1]["tied"][dtype]
        for it in range(ITERATIONS):
            tag = f"tied/{dtype}/iter{it}"
            rec.compare(f"{tag}: stage0 vs stage1 after all-reduce", stage0[it]["after"], stage1[it]["after"])
            expected = tied_embedding_grad_sum([stage0[it]["before"], stage1[it]["before"]])
            rec.compare(f"{tag}: vs refgrad tied sum", expected, stage1[it]["after"])

    _guard_case(ctx, rec, layer_cls)
    _stale_step_case(ctx, rec, layer_cls)
    rec.finding(
        f"{len(cases)} cases ({len(single)} at TP 1 on each of {WORLD} processes, {len(multi)} at TP 2), "
        f"{ITERATIONS} iterations each; {len(drain_order_rows)} (case, rank, iteration) results "
        "reorder the fp32 adds under deferral and are not bitwise equal to microbatch order "
        f"({sum(1 for row in drain_order_rows if not row[1])} of them actually differ)."
    )


def _guard_case(ctx: CheckContext, rec: CheckRecorder, layer_cls) -> None:
    """Draining into a bucket whose reduce is in flight must raise and write nothing."""
    config = EmbeddingWgradConfig(defer_embedding_wgrad_compute=True, pipeline_model_parallel_size=2)
    g = ctx.generator(3)  # seed 0: manual_seed(3)
    layer = layer_cls(torch.randn(VOCAB, HIDDEN, generator=g).bfloat16(), config)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).bfloat16().requires_grad_(True)
    layer(x).backward(torch.randn(SEQ, BATCH, VOCAB, generator=g).bfloat16())
    before = layer.weight.main_grad.clone()
    raised = False
    try:
        layer.drain_deferred_wgrad(reduce_in_flight=lambda p: p is layer.weight)
    except LifecycleError:
        raised = True
    rec.expect("guard: drain into an in-flight bucket raises LifecycleError", raised)
    rec.expect("guard: main_grad untouched after the refusal", torch.equal(before, layer.weight.main_grad))
    rec.expect("guard: the deferred entry is still there to drain later", layer.num_deferred == 1)


def _stale_step_case(ctx: CheckContext, rec: CheckRecorder, layer_cls) -> None:
    """A step abandoned after a backward leaves entries in both buffers; the next step must not see them.

    Production clears only the activation buffer at step start, so a stale
    grad_output would be paired with the next step's first input.
    """
    config = EmbeddingWgradConfig(
        defer_embedding_wgrad_compute=True, wgrad_deferral_limit=2, pipeline_model_parallel_size=2
    )
    g = ctx.generator(11)  # seed 0: manual_seed(11)
    weight = torch.randn(VOCAB, HIDDEN, generator=g).bfloat16()
    xs = [torch.randn(SEQ, BATCH, HIDDEN, generator=g).bfloat16() for _ in range(3)]
    gos = [torch.randn(SEQ, BATCH, VOCAB, generator=g).bfloat16() for _ in range(3)]

    def full_step(layer) -> None:
        layer.start_step()
        for x, go in zip(xs[1:], gos[1:]):
            layer(x.clone().requires_grad_(True)).backward(go)
        layer.drain_deferred_wgrad()

    fresh = layer_cls(weight, config)
    full_step(fresh)
    reused = layer_cls(weight, config)
    reused.start_step()
    reused(xs[0].clone().requires_grad_(True)).backward(gos[0])  # abandoned: no drain
    reused.weight.main_grad.zero_()
    try:
        full_step(reused)
        same = torch.equal(
            fresh.weight.main_grad.view(torch.int32), reused.weight.main_grad.view(torch.int32)
        )
        detail = "main_grad differs from a fresh layer's"
    except LifecycleError as exc:
        same, detail = False, f"LifecycleError: {exc}"
    rec.expect("stale step: start_step clears both buffers (bitwise equal to a fresh layer)", same, detail)


def compare_wgrad_methods_on(
    device: str, rec: CheckRecorder, seed: int, methods, accumulate: Callable = accumulate_wgrad_
) -> None:
    """``main_grad += goᵀ·x`` on ``device`` with each wgrad method vs refgrad, on the exact grid.

    On the grid lane every product and partial sum is exact, so any summation
    order inside the GEMM must give refgrad's bits.
    """
    for dtype in ("float32", "bfloat16"):
        case = WgradCase(1, False, 3, 0, dtype, "grid")
        _, xs, gos = case_data(case, seed, data_rank=0)
        expected = reference_main_grad(gos[0], xs[0], main_grad_dtype=getattr(torch, dtype))
        for method in methods:
            main_grad = torch.zeros(VOCAB, HIDDEN, dtype=getattr(torch, dtype), device=device)
            try:
                for x, go in zip(xs[0], gos[0]):
                    accumulate(main_grad, go.to(device), x.to(device), cuda_method=method)
            except (RuntimeError, NotImplementedError) as exc:
                # addmm with both out_dtype and out= has been broken in some torch releases.
                rec.finding(f"{device} wgrad method {method!r} is unavailable on this torch: {exc}")
                continue
            rec.compare(f"{device} wgrad {method}: main_grad {dtype} (exact grid)",
                        expected, main_grad.cpu())


def check_cuda_wgrad(ctx: CheckContext, rec: CheckRecorder, candidate: DeferredWgradCandidate) -> None:
    """With ``--device cuda``: the fp32-accumulating wgrad GEMM (cuBLAS) vs refgrad."""
    if ctx.device != "cuda":
        rec.skip("CUDA wgrad GEMM (cuBLAS, fp32 output) vs refgrad: run `verify run --device cuda`")
        return
    compare_wgrad_methods_on("cuda", rec, ctx.seed, CUDA_WGRAD_METHODS, candidate.accumulate)


def run(ctx: CheckContext, rec: CheckRecorder, candidate: DeferredWgradCandidate) -> None:
    """The ``deferred_wgrad`` check against ``candidate`` (default: fastgrad's layer)."""
    run_deferred_wgrad_check(ctx, rec, candidate)
    check_cuda_wgrad(ctx, rec, candidate)


CHECK = Check(
    name="deferred_wgrad",
    summary="Deferred embedding wgrad: bitwise vs immediate (or the drain order), vs refgrad, tied grads",
    run=run,
    default_candidate=DeferredWgradCandidate.default(),
)

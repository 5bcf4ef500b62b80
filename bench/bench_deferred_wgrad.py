"""Benchmark the deferred embedding wgrad: drain vs immediate, GEMM throughput, all-gather hiding.

Usage::

    .venv/bin/python bench/bench_deferred_wgrad.py            # CPU sections; GPU ones skip
    .venv/bin/python bench/bench_deferred_wgrad.py --quick    # small shapes
    .venv/bin/python bench/bench_deferred_wgrad.py --json out.json

Every number is a ratio against a baseline measured in the same run:

1. CPU, TP 1: backward time of M microbatches with the wgrad computed at once vs
   deferred (the saving on the critical path), and the drain time vs the same M
   wgrad GEMMs called directly (the drain's own overhead).
2. CPU, TP 2 with sequence parallelism on gloo: fraction of the all-gather time
   hidden behind GEMMs in the drain, ``(t_gather + t_gemm - t_drain) / t_gather``
   from separate timings of the gathers alone, the GEMMs alone, and the drain.
3. CUDA (skipped without it): TFLOP/s of the fp32-accumulating wgrad GEMM per
   ``cuda_wgrad_method`` vs a plain bf16 ``torch.mm`` of the same shape, timed
   interleaved (``bench/bench_gpu_kernels.py`` judges the goal, >= 95%); whether
   ``torch.addmm(..., out_dtype=torch.float32, out=main_grad)`` works in place on
   this torch; with >= 2 GPUs the all-gather hiding of section 2 over NCCL.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from _timing import interleaved_medians  # bench/ is on sys.path when a script runs

from fastgrad.comm import all_gather_into
from fastgrad.deferred_wgrad import (
    ColumnParallelOutputLayer,
    EmbeddingWgradConfig,
    accumulate_wgrad_,
)
from gradvocab import ParallelDims
from verify.distributed import spawn
from verify.metrics import bitwise_equal


def _data(m, seq, batch, hidden, vocab, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(seq, batch, hidden, generator=g).bfloat16().to(device) for _ in range(m)]
    gos = [torch.randn(seq, batch, vocab, generator=g).bfloat16().to(device) for _ in range(m)]
    w = torch.randn(vocab, hidden, generator=g).bfloat16().to(device)
    return w, xs, gos


def bench_cpu_drain(m: int, seq: int, batch: int, hidden: int, vocab: int, repeats: int) -> dict:
    """Section 1: backward with immediate vs deferred wgrad, and the drain."""
    w, xs, gos = _data(m, seq, batch, hidden, vocab)
    immediate = ColumnParallelOutputLayer(w, EmbeddingWgradConfig())
    deferred = ColumnParallelOutputLayer(
        w, EmbeddingWgradConfig(defer_embedding_wgrad_compute=True),
        parallel_dims=ParallelDims(pp_size=2),
    )

    def backward_all(layer):
        layer.start_step()
        for x, go in zip(xs, gos):
            layer(x.clone().requires_grad_(True)).backward(go)

    main_grad = torch.zeros(vocab, hidden)
    t_def_bwd, t_drain = [], []

    def deferred_round():
        # Times its two phases itself: the backward (deferred) and the drain after it.
        start = time.perf_counter()
        backward_all(deferred)
        mid = time.perf_counter()
        deferred.drain_deferred_wgrad()
        t_def_bwd.append(mid - start)
        t_drain.append(time.perf_counter() - mid)

    def gemms():
        for x, go in zip(xs, gos):
            accumulate_wgrad_(main_grad, go, x)

    times = interleaved_medians({
        "immediate": lambda: backward_all(immediate),
        "deferred": deferred_round,
        "gemms": gemms,
    }, repeats)
    t_imm, t_gemms = times["immediate"], times["gemms"]
    # The first round is interleaved_medians' warm-up call.
    t_def, t_dr = statistics.median(t_def_bwd[1:]), statistics.median(t_drain[1:])
    return {
        "shape": {"M": m, "tokens": seq * batch, "hidden": hidden, "vocab": vocab},
        "immediate_backward_s": t_imm,
        "deferred_backward_s": t_def,
        "drain_s": t_dr,
        "deferred_backward_over_immediate": t_def / t_imm,
        "wgrad_gemms_s": t_gemms,
        "drain_over_wgrad_gemms": t_dr / t_gemms,
        "critical_path_saved_over_wgrad_gemms": (t_imm - t_def) / t_gemms,
    }


def _overlap_worker(rank: int, world: int, m, seq, batch, hidden, vocab, repeats, device) -> dict:
    if device == "cuda":
        torch.cuda.set_device(rank)
    w, xs, gos = _data(m, seq, batch, hidden, vocab // world, device, seed=rank)
    sshard = seq // world
    cfg = EmbeddingWgradConfig(defer_embedding_wgrad_compute=True)
    dims = ParallelDims(tp_size=world, pp_size=2, sequence_parallel=True).with_groups(
        tp_group=dist.group.WORLD)  # the last stage of a PP 2 grid, TP over the whole world
    layer = ColumnParallelOutputLayer(w, cfg, parallel_dims=dims)
    locals_ = [x[rank * sshard : (rank + 1) * sshard].contiguous() for x in xs]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def fill():
        layer.start_step()
        layer.activation_buffer.extend(locals_)
        layer.grad_output_buffer.extend(gos)

    def gathers():
        for x in locals_:
            out = torch.empty((seq, batch, hidden), dtype=x.dtype, device=x.device)
            all_gather_into(out, x, group=dist.group.WORLD)

    gathered = [torch.empty((seq, batch, hidden), dtype=torch.bfloat16, device=device) for _ in xs]
    for out, x in zip(gathered, locals_):
        all_gather_into(out, x)

    def gemms():
        for x, go in zip(gathered, gos):
            accumulate_wgrad_(layer.weight.main_grad, go, x)

    def drain():
        layer.drain_deferred_wgrad()

    drains = []

    def drain_round():
        # Times the drain itself, after the buffers are refilled and every rank is ready.
        fill()
        dist.barrier()
        sync()
        start = time.perf_counter()
        drain()
        sync()
        drains.append(time.perf_counter() - start)

    # Every rank runs the same interleaved order, so the collectives line up.
    times = interleaved_medians({"gathers": gathers, "gemms": gemms, "drain": drain_round},
                                repeats, device=device)
    t_gather, t_gemm = times["gathers"], times["gemms"]
    t_drain = statistics.median(drains[1:])  # the first is the warm-up call
    hidden_frac = (t_gather + t_gemm - t_drain) / t_gather if t_gather > 0 else float("nan")
    return {"gather_s": t_gather, "gemm_s": t_gemm, "drain_s": t_drain,
            "gather_hidden_fraction": max(0.0, min(1.0, hidden_frac)), "raw_hidden_fraction": hidden_frac}


def bench_allgather_hiding(m, seq, batch, hidden, vocab, repeats, device="cpu") -> dict:
    """Section 2 (gloo on CPU) or its NCCL twin on >= 2 GPUs."""
    backend = "nccl" if device == "cuda" else "gloo"
    per_rank = spawn(_overlap_worker, 2, m, seq, batch, hidden, vocab, repeats, device, backend=backend)
    return {"backend": backend, "rank0": per_rank[0], "rank1": per_rank[1]}


def probe_inplace_addmm() -> dict:
    """Does ``addmm(..., out_dtype=float32, out=main_grad)`` give the copy version's bits?"""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(256, 64, generator=g).bfloat16().cuda()
    b = torch.randn(256, 96, generator=g).bfloat16().cuda()
    base = torch.randn(64, 96, generator=g).cuda()
    expected = torch.addmm(base, a.t(), b, out_dtype=torch.float32)
    mg = base.clone()
    try:
        torch.addmm(mg, a.t(), b, out_dtype=torch.float32, out=mg)
    except Exception as exc:  # noqa: BLE001 - the finding is which error this torch raises
        return {"works": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    torch.cuda.synchronize()
    # By bits, not values (torch.equal calls -0 and +0 equal): the in-place method is benched
    # (works) only where it is the copy version bit for bit.
    same_bits = bitwise_equal(mg, expected)
    return {"works": same_bits, "bitwise_equal_to_copy_version": same_bits}


def bench_gpu_gemm(tokens: int, hidden: int, vocab: int, repeats: int, device: str = "cuda") -> dict:
    """Section 3: fp32-accumulating wgrad GEMM vs plain bf16 mm, per cuda_wgrad_method.

    Every method and the bf16 ``torch.mm`` of the same shape are timed interleaved
    (CUDA events on CUDA). ``device="cpu"`` rehearses the code: there every method
    takes the CPU path and the in-place probe is skipped.
    """
    g = torch.Generator(device=device).manual_seed(2)
    go = torch.randn(tokens, vocab, generator=g, device=device).bfloat16()
    x = torch.randn(tokens, hidden, generator=g, device=device).bfloat16()
    flops = 2.0 * tokens * vocab * hidden
    out = {"device": device, "shape": {"tokens": tokens, "hidden": hidden, "vocab": vocab},
           "methods": {}}
    if device == "cuda":
        out["inplace_addmm_out_dtype"] = inplace = probe_inplace_addmm()
    else:
        inplace = {"works": True}  # the CPU path ignores cuda_method: rehearse every method
    methods = ["addmm_out_dtype", "fp32_upcast"] + (["addmm_out_dtype_inplace"] if inplace["works"] else [])
    candidates = {"plain_bf16_mm": lambda: torch.mm(go.t(), x)}
    for method in methods:
        mg = torch.zeros(vocab, hidden, device=device)
        try:  # one call first: a method this torch cannot run is recorded, not timed
            accumulate_wgrad_(mg, go, x, cuda_method=method)
        except Exception as exc:  # noqa: BLE001 - recorded, e.g. out_dtype missing in old torch
            out["methods"][method] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            continue
        candidates[method] = lambda method=method, mg=mg: accumulate_wgrad_(mg, go, x, cuda_method=method)
    mg16 = torch.zeros(vocab, hidden, device=device, dtype=torch.bfloat16)
    candidates["bf16_main_grad_addmm_"] = lambda: accumulate_wgrad_(mg16, go, x)
    times = interleaved_medians(candidates, repeats, device=device)
    t_bf16 = times.pop("plain_bf16_mm")
    out["plain_bf16_mm_tflops"] = flops / t_bf16 / 1e12
    for method, t in times.items():
        out["methods"][method] = {"tflops": flops / t / 1e12, "fraction_of_plain_bf16": t_bf16 / t}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--json", help="also write the results to this path")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    results: dict = {"torch": torch.__version__}
    if args.quick:
        m, seq, batch, hidden, vocab, repeats = 4, 64, 2, 128, 256, 3
    else:
        m, seq, batch, hidden, vocab, repeats = 8, 256, 2, 512, 2048, 5
    torch.set_num_threads(1)
    results["cpu_drain"] = r = bench_cpu_drain(m, seq, batch, hidden, vocab, repeats)
    print(f"[cpu tp1] M={m} tokens={seq * batch} H={hidden} V={vocab}: backward deferred/immediate = "
          f"{r['deferred_backward_over_immediate']:.3f}; drain / the same M wgrad GEMMs called directly = "
          f"{r['drain_over_wgrad_gemms']:.3f}; backward time saved / those GEMMs = "
          f"{r['critical_path_saved_over_wgrad_gemms']:.3f}")
    results["cpu_gloo_sp_overlap"] = o = bench_allgather_hiding(m, seq, batch, hidden, vocab, repeats)
    print(f"[cpu gloo tp2 sp] all-gather hidden in the drain: rank0 {o['rank0']['gather_hidden_fraction']:.2f}, "
          f"rank1 {o['rank1']['gather_hidden_fraction']:.2f} (gather {o['rank0']['gather_s'] * 1e3:.2f} ms, "
          f"gemm {o['rank0']['gemm_s'] * 1e3:.2f} ms, drain {o['rank0']['drain_s'] * 1e3:.2f} ms)")
    if not torch.cuda.is_available():
        print("[gpu] skipped: CUDA is not available")
        results["gpu"] = "skipped: no CUDA"
    else:
        gshape = (2048, 1024, 4096) if args.quick else (8192, 4096, 32768)
        results["gpu"] = gpu = bench_gpu_gemm(*gshape, repeats=10)
        print(f"[gpu] {torch.cuda.get_device_name()} tokens={gshape[0]} H={gshape[1]} V={gshape[2]}: "
              f"plain bf16 mm {gpu['plain_bf16_mm_tflops']:.1f} TFLOP/s")
        for name, v in gpu["methods"].items():
            print(f"[gpu]   {name}: " + (v["error"] if "error" in v else
                  f"{v['tflops']:.1f} TFLOP/s = {v['fraction_of_plain_bf16']:.3f} of plain bf16"))
        print(f"[gpu] addmm(out_dtype=float32, out=main_grad) in place: {gpu['inplace_addmm_out_dtype']}")
        if torch.cuda.device_count() >= 2:
            results["gpu_nccl_sp_overlap"] = n = bench_allgather_hiding(
                m, 4096, 2, 4096, 65536, repeats, device="cuda"
            )
            print(f"[gpu nccl tp2 sp] all-gather hidden: {n['rank0']['gather_hidden_fraction']:.2f}")
        else:
            print("[gpu nccl] skipped: the all-gather hiding needs >= 2 GPUs")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

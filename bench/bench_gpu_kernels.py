"""GPU acceptance of fastgrad's CUDA kernels: bits against refgrad, then speed against the goals.

Usage::

    python3 bench/bench_gpu_kernels.py --json out.json        # on a GPU node (CUDA events)
    python3 bench/bench_gpu_kernels.py --quick                # smaller tensors, fewer repeats
    python3 bench/bench_gpu_kernels.py --section reduction    # one section (e.g. under ncu)
    python bench/bench_gpu_kernels.py --device cpu --quick    # rehearse the code on a CPU

Without CUDA, and without ``--device cpu``, it says that it skipped and exits 0.
``--device cpu`` runs every line of the GPU code on the CPU's torch paths; its
figures mean nothing for the goals, which it reports as not judged.

First every path is checked bitwise on small inputs against refgrad, on the
device: the fp32-accumulating reduction (W = 2, 8, 64; a shard a multiple of 16
elements and one that is not; sum and average) against
``refgrad.reduce_scatter.all_reduce(accumulate="fp32", order="rank")``; MXFP8
quantization (bf16 and fp32, four scale modes, output poisoned first) against
``refgrad.mxfp8.quantize``; the fp32-output wgrad GEMM (every ``cuda_wgrad_method``)
against ``refgrad.deferred_wgrad.reference_main_grad`` on values where every
partial sum is exact, and at the timed shape against an fp64 GEMM of such values.

Then each kernel is timed with the measurement of its technique's own benchmark
(one way per measurement), candidates interleaved, by CUDA events, against a
baseline measured in the same run:

* reduction (``bench_reduce_scatter.run``): bytes moved (``(2W + 2) * shard``) per
  second as a fraction of a device-to-device copy of as many bytes (goal >= 90%),
  and the speed-up over production's ``torch.sum(dtype=float32)`` + copy as a share
  of the byte ceiling ``(2W + 10) / (2W + 2)`` (goal >= 95%);
* MXFP8 (``bench_mxfp8.gpu_section``): bytes moved per second as a fraction of a copy
  of the input (goal >= 80%);
* wgrad GEMM (``bench_deferred_wgrad.bench_gpu_gemm``): throughput of the default
  ``cuda_wgrad_method`` as a fraction of a bf16 ``torch.mm`` of the same shape (goal
  >= 95%).

Each goal is printed as a ``goal MET|MISSED|n/a`` line with the figure. The exit
status is 1 when a bitwise check failed or a section crashed (the other sections
still run), else 0: a missed speed goal is a finding, not a failure.
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

# bench/ is on sys.path when a script runs: the measurements live in each technique's benchmark.
from bench_deferred_wgrad import bench_gpu_gemm
from bench_mxfp8 import gpu_section as mxfp8_rows
from bench_reduce_scatter import run as reduction_rows

from fastgrad import mxfp8
from fastgrad.deferred_wgrad import CUDA_WGRAD_METHODS, EmbeddingWgradConfig, accumulate_wgrad_
from fastgrad.kernels import triton_available
from fastgrad.reduce_scatter import reduce_shards_fp32
from gradvocab import Averaging
from refgrad import mxfp8 as ref_mxfp8
from refgrad.deferred_wgrad import reference_main_grad
from refgrad.reduce_scatter import all_reduce as ref_all_reduce
from verify.fixtures.mxfp8_inputs import random_blocks
from verify.metrics import bitwise_equal

SECTIONS = ("reduction", "mxfp8", "gemm")
WORLD_SIZES = (2, 8, 64)
REDUCTION_COPY_GOAL = 0.90
REDUCTION_CEILING_GOAL = 0.95
MXFP8_COPY_GOAL = 0.80
WGRAD_GEMM_GOAL = 0.95
JUDGED_WGRAD_METHOD = EmbeddingWgradConfig().cuda_wgrad_method  # what users get by default
OPT_IN_WGRAD_METHODS = ("addmm_out_dtype_inplace",)  # broken in some torch releases


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one run: ``shards`` holds a multiple of 16 elements and a size that is not."""

    shards: tuple[int, int]
    mxfp8_numel: int
    gemm: tuple[int, int, int]  # tokens, hidden, vocab
    repeats: int

    def __post_init__(self) -> None:
        if self.shards[0] % 16 or not self.shards[1] % 16:
            raise ValueError(f"shards must be (a multiple of 16, a non-multiple), got {self.shards}")
        if self.mxfp8_numel % 1024:
            raise ValueError(f"mxfp8_numel must be a multiple of 1024, got {self.mxfp8_numel}")


def sizes_for(device: str, quick: bool) -> Sizes:
    """Several times the H200's 60 MB L2 on CUDA (rotating nothing, so it must not fit); tiny on CPU."""
    if device == "cpu":
        return Sizes(shards=(2**12, 2**12 + 1), mxfp8_numel=2**14, gemm=(128, 64, 256), repeats=2)
    if quick:
        return Sizes(shards=(2**22, 2**22 + 1), mxfp8_numel=2**22, gemm=(2048, 1024, 4096), repeats=5)
    return Sizes(shards=(2**26, 2**26 + 1), mxfp8_numel=2**28, gemm=(8192, 4096, 32768), repeats=15)


@dataclass(frozen=True)
class BitCheck:
    """One bitwise comparison; ``passed`` is None where the path is not offered on this torch."""

    name: str
    passed: bool | None
    detail: str = ""


@dataclass(frozen=True)
class Goal:
    """One speed goal: ``measured`` against ``target``; ``met`` is None when not judged."""

    name: str
    measured: float | None
    target: float
    met: bool | None
    note: str = ""

    def line(self) -> str:
        """``goal MET|MISSED|n/a  name: figure (goal >= target[; short by ...])``."""
        verdict = {True: "MET", False: "MISSED", None: "n/a"}[self.met]
        figure = "no figure" if self.measured is None else f"{100 * self.measured:.1f}%"
        text = f"goal {verdict:<6} {self.name}: {figure} (goal >= {100 * self.target:.0f}%"
        if self.met is False and self.measured is not None:
            text += f"; short by {100 * (self.target - self.measured):.1f} points"
        return text + (f"; {self.note})" if self.note else ")")


def judge(name: str, measured: float | None, target: float, judged: bool, note: str = "") -> Goal:
    """A goal from a figure: not judged on a CPU rehearsal; missed when there is no figure."""
    if not judged:
        return Goal(name, measured, target, None, note or "CPU rehearsal: not judged")
    if measured is None:
        return Goal(name, None, target, False, note or "no measurement")
    return Goal(name, measured, target, measured >= target, note)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included), on the CPU."""
    return bitwise_equal(a.detach().cpu(), b.detach().cpu())


# --- bitwise checks against refgrad -------------------------------------------------------


def order_revealing_shards(world_size: int, numel: int, generator: torch.Generator) -> torch.Tensor:
    """bf16 ``[W, numel]``: per column a pair ``+b, -b`` in two random rows among terms 2^30 smaller.

    The terms added while ``b`` is in the fp32 accumulator are lost, the others kept, so the
    rounded sum depends on the order of the adds (reversing it changes most columns at W >= 8);
    mixed-exponent normal values alone sum exactly in fp32 in any order, and would not.
    """
    small = (torch.randn(world_size, numel, generator=generator)
             * torch.exp2(-30 - 8 * torch.rand(world_size, numel, generator=generator)))
    big = torch.randn(numel, generator=generator) * torch.exp2(
        torch.randint(0, 8, (numel,), generator=generator).float())
    big = big.bfloat16().float()  # -b cancels b exactly
    rows = torch.stack([torch.randperm(world_size, generator=generator)[:2] for _ in range(numel)])
    columns = torch.arange(numel)
    small[rows[:, 0], columns] = big
    small[rows[:, 1], columns] = -big
    return small.bfloat16()


def check_reduction(device: str) -> list[BitCheck]:
    """reduce_shards_fp32 on the device vs refgrad's fp32 rank-order all-reduce, W = 2, 8, 64."""
    checks = []
    for world_size in WORLD_SIZES:
        for numel in (16 * 9, 16 * 9 + 5):
            g = torch.Generator().manual_seed(1000 * world_size + numel)
            inputs = {"mixed exponents": (torch.randn(world_size, numel, generator=g) * torch.exp2(
                -16 * torch.rand(world_size, numel, generator=g))).bfloat16()}
            if world_size > 2:  # two terms commute: no order to reveal
                inputs["order-revealing"] = order_revealing_shards(world_size, numel, g)
            for kind, shards in inputs.items():
                for op in (Averaging.SUM, Averaging.AVG):
                    out = torch.full((numel,), float("nan"), dtype=torch.bfloat16, device=device)
                    reduce_shards_fp32(shards.to(device), out, op=op)
                    expected = ref_all_reduce(list(shards), accumulate="fp32", order="rank",
                                              op=op)[0]
                    checks.append(BitCheck(
                        f"reduction W={world_size} shard={numel} {kind} "
                        f"{op} vs refgrad", same_bits(out, expected)))
    return checks


def check_mxfp8(device: str) -> list[BitCheck]:
    """fastgrad.mxfp8.quantize on the device vs refgrad.mxfp8.quantize, every scale mode."""
    checks = []
    for dtype in (torch.bfloat16, torch.float32):
        x = random_blocks(48, torch.Generator().manual_seed(29), dtype)  # NaN/inf/subnormal blocks too
        for mode in mxfp8.SCALE_MODES:
            expected = ref_mxfp8.quantize(x, scale_mode=mode)
            out = (torch.full(expected[0].shape, 0xAB, dtype=torch.uint8, device=device),
                   torch.full(expected[1].shape, 0xAB, dtype=torch.uint8, device=device))
            mxfp8.quantize(x.to(device), scale_mode=mode, out=out)
            checks.append(BitCheck(f"mxfp8 {dtype} {mode} vs refgrad",
                                   same_bits(out[0], expected[0]) and same_bits(out[1], expected[1])))
    return checks


def exact_grid(shape: tuple[int, ...], generator: torch.Generator, exponent: int,
               device: str = "cpu") -> torch.Tensor:
    """bf16 integers in [-7, 7] times 2^-exponent.

    A product is at most 49 units, so every partial sum of up to 2^24 / 49 (342,000) tokens
    is exact in fp32, in any order; the sums need more than bf16's 8 bits, so a wgrad
    rounded to 16 bits on the way is seen.
    """
    values = torch.randint(-7, 8, shape, generator=generator, device=device)
    return (values * 2.0**-exponent).bfloat16()


def check_wgrad_gemm(device: str, timed_shape: tuple[int, int, int]) -> list[BitCheck]:
    """accumulate_wgrad_ per cuda_wgrad_method vs refgrad on exact values, and at the timed shape."""
    checks = []
    g = torch.Generator().manual_seed(31)
    tokens, hidden, vocab = 32, 16, 24
    xs = [exact_grid((tokens, hidden), g, 2) for _ in range(2)]
    gos = [exact_grid((tokens, vocab), g, 3) for _ in range(2)]
    cases = [(method, torch.float32) for method in CUDA_WGRAD_METHODS]
    cases.append((JUDGED_WGRAD_METHOD, torch.bfloat16))
    for method, mg_dtype in cases:
        name = f"wgrad GEMM {method} main_grad {mg_dtype} vs refgrad"
        expected = reference_main_grad(gos, xs, main_grad_dtype=mg_dtype)
        main_grad = torch.zeros(vocab, hidden, dtype=mg_dtype, device=device)
        try:
            for x, go in zip(xs, gos):
                accumulate_wgrad_(main_grad, go.to(device), x.to(device), cuda_method=method)
        except Exception as exc:  # noqa: BLE001 - an opt-in method this torch cannot run is a finding
            if method not in OPT_IN_WGRAD_METHODS:
                raise
            checks.append(BitCheck(name, None, f"not offered by this torch: {type(exc).__name__}: "
                                               f"{str(exc)[:160]}"))
            continue
        checks.append(BitCheck(name, same_bits(main_grad, expected)))
    # The timed shape (its own cuBLAS kernel choice): fp64 GEMM of exact values is exact too.
    tokens, hidden, vocab = timed_shape
    if tokens > 2**24 // 49:
        raise ValueError(f"the exact-grid check needs at most {2**24 // 49} tokens, got {tokens}")
    gd = torch.Generator(device=device).manual_seed(37)
    x = exact_grid((tokens, hidden), gd, 2, device)
    go = exact_grid((tokens, vocab), gd, 3, device)
    main_grad = torch.zeros(vocab, hidden, device=device)
    accumulate_wgrad_(main_grad, go, x, cuda_method=JUDGED_WGRAD_METHOD)
    expected = torch.mm(go.t().double(), x.double()).float()
    checks.append(BitCheck(f"wgrad GEMM {JUDGED_WGRAD_METHOD} at {timed_shape} vs exact fp64 GEMM",
                           same_bits(main_grad, expected)))
    return checks


# --- timings and goals --------------------------------------------------------------------


def reduction_section(device: str, sizes: Sizes, judged: bool) -> tuple[list[dict], list[Goal]]:
    """bench_reduce_scatter's timings at W = 2, 8, 64 on both shard sizes, and their goals."""
    rows = []
    for shard in sizes.shards:
        rows += reduction_rows(device, WORLD_SIZES, shard, sizes.repeats)
    goals = []
    for row in rows:
        label = f"reduction W={row['W']} shard={row['shard_numel']}"
        goals.append(judge(f"{label}: fraction of copy bandwidth",
                           row.get("fraction_of_copy_bandwidth"), REDUCTION_COPY_GOAL, judged))
        goals.append(judge(
            f"{label}: speed-up over torch.sum+copy, share of the "
            f"{row['speedup_ceiling_by_bytes']:.3f}x byte ceiling",
            row["share_of_ceiling"], REDUCTION_CEILING_GOAL, judged,
            f"{row['speedup_vs_production']:.3f}x measured"))
    return rows, goals


def mxfp8_section(device: str, sizes: Sizes, judged: bool) -> tuple[list[dict], list[Goal]]:
    """bench_mxfp8's GPU timings (bf16 and fp32 input, four modes) and their goals."""
    rows = mxfp8_rows(sizes.mxfp8_numel, sizes.repeats, device)
    if not rows:
        return rows, [judge("mxfp8 quantization: fraction of copy bandwidth", None, MXFP8_COPY_GOAL,
                            judged, "no rows: Triton missing?")]
    return rows, [judge(f"mxfp8 {row['dtype']} {row['mode']}: fraction of copy bandwidth",
                        row["fraction of copy bandwidth"], MXFP8_COPY_GOAL, judged) for row in rows]


def gemm_section(device: str, sizes: Sizes, judged: bool) -> tuple[dict, list[Goal]]:
    """bench_deferred_wgrad's GEMM timings and the default method's goal."""
    result = bench_gpu_gemm(*sizes.gemm, repeats=sizes.repeats, device=device)
    judged_row = result["methods"].get(JUDGED_WGRAD_METHOD, {})
    note = judged_row.get("error", "")
    goal = judge(f"wgrad GEMM {JUDGED_WGRAD_METHOD} {sizes.gemm}: fraction of bf16 torch.mm throughput",
                 judged_row.get("fraction_of_plain_bf16"), WGRAD_GEMM_GOAL, judged, note)
    return result, [goal]


def guarded(name: str, fn: Callable[[], Any], errors: dict[str, str]) -> Any:
    """Run one section; a crash is recorded and printed, and the next section still runs."""
    try:
        return fn()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - one GPU run must report every section
        traceback.print_exc()
        errors[name] = f"{type(exc).__name__}: {exc}"
        return None
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run(device: str, quick: bool, sections: tuple[str, ...]) -> dict[str, Any]:
    """Checks, then timings, of the selected sections; everything JSON-ready."""
    judged = device == "cuda"
    sizes = sizes_for(device, quick)
    errors: dict[str, str] = {}
    results: dict[str, Any] = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if judged else "cpu",
        "torch": torch.__version__,
        "triton": triton_available(),
        "mode": "gpu" if judged else "cpu rehearsal",
        "quick": quick,
        "sizes": asdict(sizes),
        "checks": [],
        "goals": [],
        "errors": errors,
    }
    check_fns = {"reduction": lambda: check_reduction(device), "mxfp8": lambda: check_mxfp8(device),
                 "gemm": lambda: check_wgrad_gemm(device, sizes.gemm)}
    section_fns = {"reduction": reduction_section, "mxfp8": mxfp8_section, "gemm": gemm_section}
    for name in sections:
        checks = guarded(f"{name} checks", check_fns[name], errors) or []
        results["checks"] += [asdict(c) for c in checks]
        timed = guarded(f"{name} timings", lambda name=name: section_fns[name](device, sizes, judged),
                        errors)
        if timed is not None:
            results[name], goals = timed
            results["goals"] += [asdict(goal) for goal in goals]
    failed = [c for c in results["checks"] if c["passed"] is False]
    note = f"{len(failed)} of {len(results['checks'])} differ"
    if errors:
        note += "; crashed, so not all checked: " + ", ".join(errors)
    results["goals"].append(asdict(Goal(
        "bitwise checks equal to refgrad (or exact)",
        (len(results["checks"]) - len(failed)) / max(1, len(results["checks"])), 1.0,
        not failed and not errors, note)))
    return results


def print_report(results: dict[str, Any]) -> None:
    """The checks that failed, the ceilings measured, and one line per goal."""
    for check in results["checks"]:
        if check["passed"] is not True:
            state = "FAILED" if check["passed"] is False else "n/a"
            print(f"check {state}: {check['name']} {check['detail']}".rstrip())
    passed = sum(c["passed"] is True for c in results["checks"])
    print(f"{passed} of {len(results['checks'])} bitwise checks equal")
    copy_rates = [r["copy GB/s"] for r in results.get("mxfp8", [])]
    copy_rates += [r["copy_bandwidth_GBps"] for r in results.get("reduction", [])
                   if "copy_bandwidth_GBps" in r]
    if copy_rates:
        print(f"device copy bandwidth (read + write) in this run: {min(copy_rates):.0f} to "
              f"{max(copy_rates):.0f} GB/s")
    if "gemm" in results:
        print(f"bf16 torch.mm in this run: {results['gemm']['plain_bf16_mm_tflops']:.4g} TFLOP/s")
    for name, error in results["errors"].items():
        print(f"section {name} crashed: {error}")
    for goal in results["goals"]:
        print(Goal(**goal).line())


def main(argv: list[str] | None = None) -> int:
    """Parse the options; skip without CUDA, else check, time and report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cuda (default when available) or cpu: a rehearsal, no goal judged")
    parser.add_argument("--quick", action="store_true", help="smaller tensors, fewer repeats")
    parser.add_argument("--section", choices=SECTIONS, action="append",
                        help="run only this section (repeatable; default: all)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was given but CUDA is not available on this machine")
    if args.device is None and not torch.cuda.is_available():
        print("bench_gpu_kernels: skipped: CUDA is not available on this machine "
              "(--device cpu rehearses the code on the CPU)")
        results: dict[str, Any] = {"skipped": "CUDA is not available", "torch": torch.__version__}
    else:
        device = args.device or "cuda"
        results = run(device, args.quick, tuple(args.section or SECTIONS))
        print_report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"wrote {args.json}")
    failed = any(c["passed"] is False for c in results.get("checks", []))
    return 1 if failed or results.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())

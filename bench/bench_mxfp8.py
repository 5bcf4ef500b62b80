"""MXFP8 quantization throughput: fastgrad vs torchao vs a plain torch reference, same run.

Usage::

    .venv/bin/python bench/bench_mxfp8.py                # CPU; the GPU section skips
    .venv/bin/python bench/bench_mxfp8.py --quick        # small tensors
    .venv/bin/python bench/bench_mxfp8.py --json out.json

Every number is a ratio against a baseline measured in the same run:

1. CPU: best-of-R GB/s (input bytes read per second; candidates interleaved) of ``fastgrad.mxfp8.quantize`` per
   scale mode, of torchao's ``to_mx`` (when installed) and of a plain torch
   reference (``(amax/448).to(float8_e8m0fnu)``, ``(x/scale).to(float8_e4m3fn)``),
   each as a ratio to the plain reference. These do not compute the same bits
   (``verify run --check mxfp8`` has the conformance table); the ratio is the
   price of the exact spec.
2. CUDA (skipped without it): ``fastgrad.mxfp8.quantize`` (the Triton kernel; output
   preallocated with ``out=``) bytes moved per second (input read + elements and
   scales written) as a fraction of the measured device copy bandwidth
   (``torch.Tensor.copy_`` of the same input: read + write), interleaved with the
   copy. The goal is at least 80% (``bench/bench_gpu_kernels.py`` judges it and
   checks the bits against refgrad). The kernel's bits are checked equal to the
   torch path first, so a faster wrong answer is not reported.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
from _timing import interleaved_best, interleaved_medians  # bench/ is on sys.path

from fastgrad import mxfp8
from verify.fixtures import mxfp8 as support


def cpu_section(numel: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    g = torch.Generator().manual_seed(0)
    torchao = support.torchao_to_mx()
    baseline_name = "plain torch casts (baseline)"
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(numel // 1024, 1024, generator=g) * 3).to(dtype)
        input_gb = x.numel() * x.element_size() / 1e9
        candidates: dict[str, Callable[[], Any]] = {
            baseline_name: lambda x=x: support.torch_cast_quantize(x, "floor")
        }
        for mode in mxfp8.SCALE_MODES:
            candidates[f"fastgrad {mode}"] = lambda x=x, mode=mode: mxfp8.quantize(x, scale_mode=mode)
        if torchao is not None:
            for mode in mxfp8.SCALE_MODES:
                candidates[f"torchao {mode}"] = lambda x=x, mode=mode: torchao(x, mode)
        best = interleaved_best(candidates, repeats)
        for name, seconds in best.items():
            rows.append({
                "dtype": str(dtype),
                "quantizer": name,
                "seconds": seconds,
                "GB/s": input_gb / seconds,
                "ratio": best[baseline_name] / seconds,
            })
    if torchao is None:
        print("torchao is not installed: its rows are left out")
    return rows


def gpu_section(numel: int, repeats: int, device: str = "cuda") -> list[dict[str, Any]]:
    """``fastgrad.mxfp8.quantize`` (the Triton kernel on CUDA) against a copy of its input.

    ``device="cpu"`` rehearses the same code on the torch path (its figures mean nothing
    for the GPU goal); ``"cuda"`` returns no rows when CUDA or Triton is missing.
    """
    if device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: GPU section skipped")
        return []
    if device == "cuda" and not mxfp8.triton_usable(torch.empty(1, device="cuda"), 32):
        print("triton is not installed: GPU section skipped")
        return []
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(numel // 1024, 1024, generator=g, device=device).to(dtype)
        outputs = {}
        for mode in mxfp8.SCALE_MODES:
            torch_path = mxfp8.quantize_torch(x, scale_mode=mode)
            out = (torch.full_like(torch_path[0], 0xAB), torch.full_like(torch_path[1], 0xAB))
            fast = mxfp8.quantize(x, scale_mode=mode, out=out)  # the Triton kernel on CUDA
            if not (torch.equal(torch_path[0], fast[0]) and torch.equal(torch_path[1], fast[1])):
                raise AssertionError(f"quantize and the torch path disagree ({dtype}, {mode})")
            outputs[mode] = out
        destination = torch.empty_like(x)
        candidates: dict[str, Callable[[], Any]] = {"copy": lambda x=x, d=destination: d.copy_(x)}
        for mode in mxfp8.SCALE_MODES:
            candidates[f"quantize {mode}"] = (
                lambda x=x, mode=mode, out=outputs[mode]: mxfp8.quantize(x, scale_mode=mode, out=out))
            candidates[f"torch {mode}"] = (
                lambda x=x, mode=mode: mxfp8.quantize_torch(x, scale_mode=mode))
        times = interleaved_medians(candidates, repeats, device=device)
        copy_seconds = times["copy"]
        copy_bandwidth = 2 * x.numel() * x.element_size() / copy_seconds
        moved = x.numel() * x.element_size() + x.numel() + x.numel() // 32
        for mode in mxfp8.SCALE_MODES:
            seconds, torch_seconds = times[f"quantize {mode}"], times[f"torch {mode}"]
            rows.append({
                "device": device,
                "dtype": str(dtype),
                "numel": x.numel(),
                "mode": mode,
                "copy GB/s": copy_bandwidth / 1e9,
                "quantize GB/s": moved / seconds / 1e9,
                "fraction of copy bandwidth": moved / seconds / copy_bandwidth,
                "speed-up vs torch path": torch_seconds / seconds,
            })
    return rows


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print(f"\n{title}")
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tensors, few repeats")
    parser.add_argument("--numel", type=int, default=None, help="elements per tensor")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", type=str, default=None, help="write the rows to this file")
    args = parser.parse_args()
    numel = args.numel or (1 << 18 if args.quick else 1 << 22)
    repeats = args.repeats or (3 if args.quick else 7)
    if numel % 1024:
        parser.error("--numel must be a multiple of 1024")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, numel {numel}, repeats {repeats}")
    cpu_rows = cpu_section(numel, repeats)
    print_rows("CPU quantization throughput (ratio = baseline time / candidate time)", cpu_rows)
    gpu_rows = gpu_section(numel * 16, repeats * 3)
    print_rows("CUDA: Triton kernel vs device copy bandwidth", gpu_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_rows, "cuda": gpu_rows}, f, indent=2)


if __name__ == "__main__":
    main()

"""Benchmark the local reduction of the fp32-accumulating reduce-scatter, and its wire bytes.

Usage::

    .venv/bin/python bench/bench_reduce_scatter.py              # CPU (and CUDA if present)
    .venv/bin/python bench/bench_reduce_scatter.py --quick      # small shapes
    .venv/bin/python bench/bench_reduce_scatter.py --shard-numel 67108864 --json out.json

Every timing is a ratio against baselines measured in the same run, on the same
``[W, shard]`` bf16 all-to-all output (W = 8 and 64):

* ``fastgrad``: ``fastgrad.reduce_scatter.reduce_shards_fp32`` (Triton single pass on
  CUDA; sequential fp32 loop on CPU), bitwise equal to refgrad;
* ``production``: ``torch.sum(view(W, -1), dim=0, dtype=float32)`` then
  ``output.copy_()`` (Megatron-Core's wait());
* ``example loop``: the published description's ``out32 += gathered[i].to(float32)``
  per rank, then copy.

The goal is stated in bytes. Per output element production reads W bf16 inputs,
writes and re-reads its fp32 sum and writes the bf16 result: ``2W + 10`` bytes;
the fused kernel reads the W inputs and writes the result once: ``2W + 2``. A
memory-bound kernel can therefore beat production by at most
``(2W + 10) / (2W + 2)``: 1.44x at W = 8, 1.06x at W = 64. The table prints the
measured speedup against that ceiling. On CUDA it also reports the fraction of
the device's copy bandwidth (``dst.copy_(src)`` of the same bytes, measured in
the same run) that the fused kernel reaches, counting ``(2W + 2) * shard``
bytes moved. CPU runs skip that column. ``bench/bench_gpu_kernels.py`` runs this
measurement at W = 2, 8 and 64 on two shard sizes and judges the GPU goals.

Candidates are timed interleaved (``_timing.interleaved_medians``), on CUDA by
CUDA events. Finally the wire bytes per rank of this method, a bf16
reduce-scatter and an fp32 (FSDP2-style) reduce-scatter, from the message sizes
``(N-1)/N * S * b``.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from _timing import interleaved_medians  # bench/ is on sys.path when a script runs

from fastgrad.reduce_scatter import reduce_shards_fp32
from gradvocab import Averaging
from refgrad.formats import tensor_bit_patterns


def fastgrad_reduce(shards: torch.Tensor, output: torch.Tensor) -> None:
    """fastgrad's local reduction (Triton on CUDA, sequential fp32 loop elsewhere)."""
    reduce_shards_fp32(shards, output, op=Averaging.SUM)


def production_reduce(shards: torch.Tensor, output: torch.Tensor) -> None:
    """Megatron-Core's local reduction: torch.sum in fp32, then one downcast copy."""
    output.copy_(torch.sum(shards, dim=0, dtype=torch.float32))


def example_loop_reduce(shards: torch.Tensor, output: torch.Tensor) -> None:
    """The published description's snippet: an fp32 buffer, one converted add per rank, copy."""
    acc = torch.zeros(shards.shape[1], dtype=torch.float32, device=shards.device)
    for i in range(shards.shape[0]):
        acc += shards[i].to(torch.float32)
    output.copy_(acc.to(shards.dtype))


def wire_bytes_per_rank(world_size: int, numel: int) -> dict[str, float]:
    """Bytes each rank sends for S = numel elements: (N-1)/N * S * b per collective."""
    share = (world_size - 1) / world_size * numel
    return {
        "fp32-accumulate (bf16 all-to-all)": share * 2,
        "bf16 reduce-scatter": share * 2,
        "fp32 reduce-scatter (FSDP2 reduce_dtype=fp32)": share * 4,
    }


def bytes_per_output_element(world_size: int) -> dict[str, int]:
    """Bytes moved per output element: production ``2W + 10``, the fused kernel ``2W + 2``."""
    return {"production": 2 * world_size + 10, "fused": 2 * world_size + 2}


def speedup_ceiling(world_size: int) -> float:
    """The most a memory-bound fused kernel can gain over production: bytes ratio."""
    moved = bytes_per_output_element(world_size)
    return moved["production"] / moved["fused"]


def run(device: str, world_sizes: tuple[int, ...], shard_numel: int, repeats: int) -> list[dict]:
    """Time the three local reductions on ``[W, shard_numel]`` bf16 shards for each W."""
    rows = []
    for world_size in world_sizes:
        # Generated on the device in bf16: W=64 x 2^26 fp32 samples would need 17 GB of host RAM.
        g = torch.Generator(device=device).manual_seed(world_size)
        shards = torch.randn(world_size, shard_numel, generator=g, device=device,
                             dtype=torch.bfloat16)
        out = torch.empty(shard_numel, dtype=torch.bfloat16, device=device)
        # A faster wrong answer must not be reported: fastgrad must equal the example loop,
        # which adds in the same rank order in fp32 (randn has no -0, where 0 + -0 differs).
        loop_out = torch.empty_like(out)
        fastgrad_reduce(shards, out)
        example_loop_reduce(shards, loop_out)
        if not torch.equal(tensor_bit_patterns(out), tensor_bit_patterns(loop_out)):
            raise SystemExit(f"fastgrad and the example loop disagree ({device}, W={world_size})")
        candidates = {
            "fastgrad": partial(fastgrad_reduce, shards, out),
            "production": partial(production_reduce, shards, out),
            "example_loop": partial(example_loop_reduce, shards, out),
        }
        fused_bytes = bytes_per_output_element(world_size)["fused"] * shard_numel
        if device == "cuda":
            src = torch.empty(fused_bytes // 2 // 2, dtype=torch.bfloat16, device=device)
            dst = torch.empty_like(src)
            candidates["copy"] = partial(dst.copy_, src)
        times = interleaved_medians(candidates, repeats, device=device)
        t_fast, t_prod = times["fastgrad"], times["production"]
        row = {
            "device": device, "W": world_size, "shard_numel": shard_numel,
            "fastgrad_s": t_fast, "production_s": t_prod, "example_loop_s": times["example_loop"],
            "speedup_vs_production": t_prod / t_fast,
            "speedup_vs_example_loop": times["example_loop"] / t_fast,
            "bytes_per_element": bytes_per_output_element(world_size),
            "speedup_ceiling_by_bytes": speedup_ceiling(world_size),
            "share_of_ceiling": (t_prod / t_fast) / speedup_ceiling(world_size),
        }
        if device == "cuda":
            copy_bandwidth = 2 * src.numel() * 2 / times["copy"]  # read + write
            row["copy_bandwidth_GBps"] = copy_bandwidth / 1e9
            row["fastgrad_bandwidth_GBps"] = fused_bytes / t_fast / 1e9
            row["fraction_of_copy_bandwidth"] = (fused_bytes / t_fast) / copy_bandwidth
        rows.append(row)
    return rows


def main() -> None:
    """Parse the options, time every device, print the table and the wire bytes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--shard-numel", type=int, default=None,
                        help="elements per shard (default: 2^20 on CPU, 2^26 on CUDA)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    for name in ("shard_numel", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    results = {"torch": torch.__version__, "rows": [], "wire_bytes": {}}
    for device in devices:
        default_shard = (2**14 if args.quick else 2**20) if device == "cpu" else 2**26
        shard = args.shard_numel or default_shard
        repeats = args.repeats or (3 if args.quick else 7)
        results["rows"] += run(device, (8, 64), shard, repeats)
    if not torch.cuda.is_available():
        print("CUDA is not available: skipping the GPU timings and the copy-bandwidth fraction")
    else:
        results["gpu"] = torch.cuda.get_device_name()
    print(f"{'device':>6} {'W':>3} {'shard':>9} {'fastgrad ms':>12} {'production ms':>14} "
          f"{'loop ms':>9} {'x production':>13} {'ceiling':>8} {'of ceiling':>10} "
          f"{'x loop':>7} {'of copy BW':>10}")
    for r in results["rows"]:
        frac = f"{100 * r['fraction_of_copy_bandwidth']:.1f}%" if "fraction_of_copy_bandwidth" in r else "-"
        print(f"{r['device']:>6} {r['W']:>3} {r['shard_numel']:>9} {1e3 * r['fastgrad_s']:>12.3f} "
              f"{1e3 * r['production_s']:>14.3f} {1e3 * r['example_loop_s']:>9.3f} "
              f"{r['speedup_vs_production']:>12.2f}x {r['speedup_ceiling_by_bytes']:>7.2f}x "
              f"{100 * r['share_of_ceiling']:>9.0f}% "
              f"{r['speedup_vs_example_loop']:>6.2f}x {frac:>10}")
    print("ceiling: (2W+10)/(2W+2), production's bytes per output element over the fused "
          "kernel's; reaching it needs a memory-bound kernel (CPU runs are compute-bound)")
    numel = 40_000_000  # production's default bucket size in elements
    print(f"\nwire bytes per rank for one bucket of {numel} elements, (N-1)/N * S * b:")
    for world_size in (8, 64):
        sizes = wire_bytes_per_rank(world_size, numel)
        results["wire_bytes"][world_size] = sizes
        base = sizes["bf16 reduce-scatter"]
        for name, nbytes in sizes.items():
            print(f"  N={world_size:<3} {name:<46} {nbytes / 2**20:9.1f} MiB  "
                  f"({nbytes / base:.2f}x bf16 reduce-scatter)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

"""Time verify.oracle against refgrad.exact on 10^6 rank-elements, in the same run.

Usage: .venv/bin/python bench/bench_oracle.py [--ranks 16] [--elements 62500]
       [--threads 1] [--repeats 5] [--reference-fraction 1.0] [--sweep] [--device cpu|cuda]

1. Builds ``ranks x elements`` float32 gradients (normal values scaled by 2^k,
   k uniform in [-20, 20], so the sums mix exponents), checks that both oracles
   give bitwise-equal bfloat16 and float32 results, then prints the wall time of
   refgrad.exact (one run: it takes tens of seconds), the best of ``--repeats``
   runs of verify.oracle, and the ratio. With ``--reference-fraction f < 1``
   refgrad is timed on the first ``f`` of the columns and scaled linearly, and the
   output says so.
2. ``--sweep`` also times verify.oracle alone at the size of the DP error-growth
   sweep (1024 ranks x 10^5 elements = 10^8 rank-elements) against a plain
   (inexact) float32 ``sum(0)`` of the same tensor, as a throughput baseline.
``--device cuda`` times the oracle on the GPU (skipped cleanly without CUDA);
refgrad always runs on the CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _timing import interleaved_best  # bench/ is on sys.path when a script runs

from refgrad import exact
from verify import oracle


def device_best_time(fn: Callable[[], Any], repeats: int, device: str) -> float:
    """Best time of ``repeats`` calls after a warm-up, in seconds (CUDA events on CUDA)."""
    return interleaved_best({"fn": fn}, repeats, device=device)["fn"]


def gradients(ranks: int, elements: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 21, (ranks, elements), generator=g).float())
    return torch.randn(ranks, elements, generator=g) * scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--elements", type=int, default=62_500)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference-fraction", type=float, default=1.0)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.ranks < 1 or args.elements < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--ranks, --elements, --repeats and --threads must be >= 1")
    if not 0.0 < args.reference_fraction <= 1.0:
        parser.error("--reference-fraction must be in (0, 1]")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: --device cuda requested but CUDA is not available")
        return 0
    torch.set_num_threads(args.threads)

    stacked = gradients(args.ranks, args.elements, args.seed)
    on_device = stacked.to(args.device)
    rank_elements = args.ranks * args.elements
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, oracle on {args.device}")
    print(
        f"inputs: {args.ranks} ranks x {args.elements} elements = {rank_elements:,} rank-elements, float32"
    )

    for target in (torch.bfloat16, torch.float32):
        fast = oracle.correctly_rounded_sum(on_device, target)
        ref_columns = max(1, int(args.elements * args.reference_fraction))
        subset = stacked[:, :ref_columns]
        start = time.perf_counter()
        reference = exact.correctly_rounded_sum(list(subset), target)
        ref_seconds = (time.perf_counter() - start) * (args.elements / ref_columns)
        if not torch.equal(_bits(fast)[:ref_columns], _bits(reference)):
            print(f"FAIL: verify.oracle differs from refgrad.exact into {target}")
            return 1
        fast_seconds = device_best_time(
            lambda t=target: oracle.correctly_rounded_sum(on_device, t), args.repeats, args.device
        )
        how = (
            "measured"
            if ref_columns == args.elements
            else (f"extrapolated linearly from {ref_columns:,} of {args.elements:,} columns")
        )
        print(
            f"into {str(target).removeprefix('torch.'):9s}: refgrad.exact {ref_seconds:8.2f} s ({how}), "
            f"verify.oracle {fast_seconds * 1e3:8.1f} ms (best of {args.repeats}), "
            f"speed-up {ref_seconds / fast_seconds:7.0f}x (bitwise equal)"
        )

    if args.sweep:
        big = gradients(1024, 100_000, args.seed + 1).to(args.device)
        both = interleaved_best({
            "plain": lambda: big.sum(0),
            "exact": lambda: oracle.correctly_rounded_sum(big, torch.bfloat16),
        }, max(1, args.repeats // 2), device=args.device)
        plain, exact_time = both["plain"], both["exact"]
        print(
            f"sweep size 1024 x 100,000 = 1e8 rank-elements: verify.oracle {exact_time:.2f} s "
            f"({1e8 / exact_time / 1e6:.0f} M rank-elements/s), plain float32 sum(0) {plain:.3f} s, "
            f"oracle / plain = {exact_time / plain:.1f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

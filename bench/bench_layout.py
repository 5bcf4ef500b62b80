"""Time bucket-layout construction for 10^5 parameters: fastgrad against refgrad, same run.

Usage: .venv/bin/python bench/bench_layout.py [--params N] [--repeats R] [--seed S]

Prints the best-of-R wall time of each implementation, for a few configurations
(distributed optimizer with/without high-busbw padding, shared embeddings, and
no distributed optimizer), and the ratio refgrad / fastgrad. Both layouts are
checked equal before timing, so a faster wrong answer cannot be reported.
"""

from __future__ import annotations

import argparse
import random

from _timing import interleaved_best  # bench/ is on sys.path when a script runs

from fastgrad.layout import compute_layout as fast_layout
from refgrad.layout import compute_layout as reference_layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.params < 1 or args.repeats < 1:
        parser.error("--params and --repeats must be >= 1")

    rng = random.Random(args.seed)
    # Transformer-like mix: many small vectors (norms, biases) and large matrices.
    numels = [rng.choice((4096, 4096 * 3, 16 * 4096 * 4096 // 1024, rng.randint(1, 10**6)))
              for _ in range(args.params)]
    configs = {
        "dist-opt, dp 64, basic padding": {"dp_size": 64, "bucket_size": 64_000_000,
                                           "use_distributed_optimizer": True,
                                           "pad_buckets_for_high_nccl_busbw": False},
        "dist-opt, dp 512, high-busbw, 2 shared": {"dp_size": 512, "bucket_size": 512_000_000,
                                                   "use_distributed_optimizer": True,
                                                   "pad_buckets_for_high_nccl_busbw": True,
                                                   "shared_embedding": (0, args.params - 1)},
        "dist-opt, dp 24, bucket 1M": {"dp_size": 24, "bucket_size": 1_000_000,
                                       "use_distributed_optimizer": True,
                                       "pad_buckets_for_high_nccl_busbw": True},
        "no dist-opt, one bucket": {"dp_size": 8, "bucket_size": None,
                                    "use_distributed_optimizer": False,
                                    "pad_buckets_for_high_nccl_busbw": False},
    }
    print(f"layout construction, {args.params:,} params, best of {args.repeats}")
    print(f"{'configuration':<42} {'buckets':>8} {'refgrad s':>10} {'fastgrad s':>11} {'ratio':>7}")
    for name, kwargs in configs.items():
        ref = reference_layout(numels, **kwargs)
        fast = fast_layout(numels, **kwargs)
        if ref.to_dict() != fast.to_dict():
            raise SystemExit(f"{name}: fastgrad and refgrad layouts differ; not timing")
        best = interleaved_best({
            "refgrad": lambda kw=kwargs: reference_layout(numels, **kw),
            "fastgrad": lambda kw=kwargs: fast_layout(numels, **kw),
        }, args.repeats)
        t_ref, t_fast = best["refgrad"], best["fastgrad"]
        print(f"{name:<42} {len(ref.bucket_indices):>8} {t_ref:>10.4f} {t_fast:>11.4f} "
              f"{t_ref / t_fast:>6.1f}x")


if __name__ == "__main__":
    main()

"""Benchmark a whole training step: torch DDP + torch AdamW vs fastgrad DDP + DistributedOptimizer.

Usage::

    .venv/bin/python bench/bench_train_ddp.py                  # 150 steps, results in bench/results/
    .venv/bin/python bench/bench_train_ddp.py --steps 20 --out-dir /tmp/bench   # a quick look

Two gloo ranks (DP 2, one thread each) train the example GPT (``examples/gpt.py``) at the
README's settings (hidden 128, 4 layers, 4 heads, sequences of 64, 4 microbatches of 4 per
replica, AdamW lr 1e-3, betas (0.9, 0.95), weight decay 0.1 except biases and norms, clipping
to 1.0) from the same initial weights on the same data, twice in the same processes:

* ``torch``: ``torch.nn.parallel.DistributedDataParallel`` (``no_sync()`` on all but the last
  microbatch), ``clip_grad_norm_(1.0)`` and ``torch.optim.AdamW`` (its default foreach path);
* ``fastgrad``: ``fastgrad.DistributedDataParallel`` (distributed optimizer, overlapped grad
  reduce-scatter and param all-gather) and ``fastgrad.DistributedOptimizer`` (exact global
  norm, clipping, AdamW on fp32 master shards);
* ``fastgrad replicated`` (for the profile): the same DDP without the distributed optimizer
  (one all-reduce, as torch's) and ``fastgrad.ReplicatedOptimizer``.

The three are interleaved step by step (the one going first rotates), so load drift on a
shared machine hits them alike. Each collective of the run is also timed alone on the model's
0.8M fp32 elements (all-reduce, reduce-scatter, all-gather), interleaved. A step is timed from the zeroing of the grads to the end of
the optimizer step on each rank, and the step's time is the slower rank's; the forward and
backward and the optimizer phase are timed apart too. The first ``--warmup`` steps (first-call
allocations, the numba kernels' load) are left out of the statistics. Loss: the mean over the
replicas of each step's mean microbatch loss.

Writes ``train_ddp_cpu.json`` (every step's losses and times, the machine, its load),
``train_ddp_cpu.md`` (the summary) and ``train_ddp_cpu.png`` (loss curves side by side, step
times) under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file: `examples` lives in the repository root
    sys.path.insert(0, str(REPO))

from examples.data import CharCorpus  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from fastgrad import (  # noqa: E402
    AdamWConfig,
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    ReplicatedOptimizer,
    param_groups_without_decay_for,
)
from fastgrad.comm import all_gather_into, reduce_scatter_into  # noqa: E402
from verify.distributed import spawn  # noqa: E402

SEED, LR, BETAS, EPS, WD, CLIP = 1234, 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
MICRO, M, SEQ = 4, 4, 64
MODEL = {"seq_length": SEQ, "hidden_size": 128, "num_layers": 4, "num_attention_heads": 4}


def _model(vocab: int) -> GPT:
    torch.manual_seed(SEED)  # the same initial weights on every rank and for both sides
    return GPT(GPTConfig(vocab_size=vocab, **MODEL))


def _torch_side(vocab: int):
    model = _model(vocab)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim > 1 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()

    return ddp, opt.zero_grad, lambda: None, optimizer_step


def _fastgrad_side(vocab: int, distributed: bool = True):
    model = _model(vocab)
    ddp = DistributedDataParallel(model, config=DDPConfig(
        use_distributed_optimizer=distributed, overlap_grad_reduce=True,
        overlap_param_gather=distributed))
    kind = DistributedOptimizer if distributed else ReplicatedOptimizer
    opt = kind(ddp, AdamWConfig(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD),
               param_groups_without_decay_for(ddp), max_grad_norm=CLIP)
    return ddp, opt.zero_grad, ddp.finish_grad_sync, opt.step


def _collectives(numel: int, world: int, rounds: int = 30) -> dict[str, float]:
    """Median seconds of each collective the two sides use, on ``numel`` fp32 elements."""
    full, shard = torch.randn(numel - numel % world), torch.empty(numel // world)
    scratch = torch.empty_like(full)  # as a fastgrad bucket keeps one on gloo (fastgrad.comm)
    calls = {
        "all-reduce (torch DDP, fastgrad replicated)": lambda: dist.all_reduce(full),
        "reduce-scatter (fastgrad distributed)": lambda: reduce_scatter_into(shard, full,
                                                                             scratch=scratch),
        "all-gather (fastgrad distributed)": lambda: all_gather_into(full, shard),
        "all-reduce of the norm's 21 int64 (fastgrad distributed)":
            lambda: dist.all_reduce(torch.zeros(21, dtype=torch.int64)),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        names = list(calls)[r % len(calls):] + list(calls)[:r % len(calls)]
        for name in names:
            dist.barrier()
            start = time.perf_counter()
            calls[name]()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed))
    return {name: statistics.median(values[3:]) for name, values in times.items()}


def _worker(rank: int, world: int, steps: int) -> dict:
    torch.set_num_threads(1)
    corpus = CharCorpus.from_file()
    sides = {"torch": _torch_side(corpus.vocab_size), "fastgrad": _fastgrad_side(corpus.vocab_size),
             "fastgrad replicated": _fastgrad_side(corpus.vocab_size, distributed=False)}
    out = {name: {"loss": [], "step": [], "forward_backward": [], "optimizer": []} for name in sides}
    for step in range(1, steps + 1):
        inputs, targets = corpus.sample_microbatches(
            seed=SEED, step=step, dp_rank=rank, dp_size=world, num_microbatches=M,
            micro_batch_size=MICRO, seq_length=SEQ)
        names = list(sides)
        order = names[step % len(names):] + names[:step % len(names)]
        for name in order:
            ddp, zero, finish, optimizer_step = sides[name]
            dist.barrier()  # both ranks start the step together
            start = time.perf_counter()
            zero()
            total = torch.zeros(())
            for i, (x, y) in enumerate(zip(inputs, targets)):
                with ddp.no_sync() if i < M - 1 else nullcontext():
                    loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()) / M
                    loss.backward()
                total += loss.detach()
            finish()
            middle = time.perf_counter()
            optimizer_step()
            end = time.perf_counter()
            times = torch.tensor([end - start, middle - start, end - middle], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the job waits for its slower rank
            dist.all_reduce(total)
            record = out[name]
            record["loss"].append(float(total) / world)
            for key, value in zip(("step", "forward_backward", "optimizer"), times.tolist()):
                record[key].append(value)
    numel = sum(p.numel() for p in _model(corpus.vocab_size).parameters())
    return {"runs": out, "collectives": _collectives(numel, world)}


def _summary(results: dict, warmup: int) -> dict:
    stats: dict = {}
    for name, record in results.items():
        stats[name] = {key: statistics.median(record[key][warmup:])
                       for key in ("step", "forward_backward", "optimizer")}
    stats["ratio torch/fastgrad (step)"] = stats["torch"]["step"] / stats["fastgrad"]["step"]
    stats["ratio torch/fastgrad replicated (step)"] = (stats["torch"]["step"]
                                                       / stats["fastgrad replicated"]["step"])
    paired = [t / f for t, f in zip(results["torch"]["step"][warmup:], results["fastgrad"]["step"][warmup:])]
    stats["median of per-step ratios torch/fastgrad"] = statistics.median(paired)
    losses = zip(results["torch"]["loss"], results["fastgrad"]["loss"])
    stats["max relative loss difference"] = max(abs(a - b) / abs(a) for a, b in losses)
    return stats


def _plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, name in zip(axes[:2], ("torch", "fastgrad")):
        ax.plot(range(1, len(results[name]["loss"]) + 1), results[name]["loss"], lw=1)
        ax.set_title(f"{name}: loss (mean over replicas)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    low = min(min(results[n]["loss"]) for n in results)
    high = max(max(results[n]["loss"]) for n in results)
    for ax in axes[:2]:
        ax.set_ylim(low - 0.05, high + 0.05)
    for name in results:
        axes[2].plot(range(1, len(results[name]["step"]) + 1), [t * 1e3 for t in results[name]["step"]],
                     lw=1, label=name)
    axes[2].set_title("step time (slower rank)")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("ms")
    axes[2].legend()
    axes[2].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the statistics")
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    began = time.time()
    measured = spawn(_worker, 2, args.steps, timeout_s=3600)[0]
    results, collectives = measured["runs"], measured["collectives"]
    load_after = os.getloadavg()
    stats = _summary(results, args.warmup)
    machine = {
        "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
        "load average (1, 5, 15 min) before": load_before, "after": load_after,
        "wall seconds": round(time.time() - began, 1),
    }
    stem = args.out_dir / "train_ddp_cpu"
    stem.with_suffix(".json").write_text(json.dumps(
        {"machine": machine, "steps": args.steps, "warmup": args.warmup, "summary": stats,
         "collectives_seconds": collectives, "results": results}, indent=1))
    title = (f"example GPT, DP 2 (gloo, 1 thread per rank), {args.steps} steps, clipping 1.0; "
             f"{machine['when']}, load {load_before[0]:.1f}")
    _plot(results, stem.with_suffix(".png"), title)
    lines = [
        f"# torch DDP + AdamW vs fastgrad DDP + DistributedOptimizer ({machine['when']})",
        "",
        f"Example GPT at the README's settings, DP 2 on gloo (2 processes, 1 thread each), "
        f"{args.steps} steps interleaved, clipping to 1.0; medians over steps {args.warmup + 1}-"
        f"{args.steps}, each step timed on its slower rank. Machine: {machine['cpus']} CPUs, "
        f"load average {load_before[0]:.1f} before / {load_after[0]:.1f} after "
        f"(1 min), torch {torch.__version__}.",
        "",
        "| | torch DDP + AdamW | fastgrad + DistributedOptimizer | fastgrad + ReplicatedOptimizer |",
        "|---|---|---|---|",
    ]
    for key, label in (("step", "step"), ("forward_backward", "zero + forward + backward + grad sync"),
                       ("optimizer", "clip + optimizer step")):
        lines.append(f"| {label} (ms) | " + " | ".join(
            f"{stats[name][key] * 1e3:.1f}" for name in ("torch", "fastgrad", "fastgrad replicated")) + " |")
    lines += [
        "",
        f"torch / fastgrad step time: {stats['ratio torch/fastgrad (step)']:.3f} (ratio of medians), "
        f"{stats['median of per-step ratios torch/fastgrad']:.3f} (median of the paired per-step "
        "ratios); >= 1: fastgrad at least as fast. torch / fastgrad replicated: "
        f"{stats['ratio torch/fastgrad replicated (step)']:.3f}.",
        "",
        "The collectives alone, on the model's elements (median ms, slower rank): "
        + "; ".join(f"{name} {value * 1e3:.2f}" for name, value in collectives.items()) + ".",
        f"Loss curves: largest relative difference {stats['max relative loss difference']:.2e} "
        "(torch's AdamW and fp32 norm vs fastgrad's refgrad-order AdamW and exact norm).",
        "",
        f"![loss curves and step times]({stem.with_suffix('.png').name})",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

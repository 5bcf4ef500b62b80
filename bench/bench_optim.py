"""Benchmark ``fastgrad.optim.DistributedOptimizer``: its step vs torch's AdamW, and overlap.

Usage::

    .venv/bin/python bench/bench_optim.py                 # 10^7 params, 7 rounds; 41 of the clipped step
    .venv/bin/python bench/bench_optim.py --quick         # 10^6 params, 3 rounds
    .venv/bin/python bench/bench_optim.py --kernels-of b2d6e3e --out bench/results/optim_cpu.txt

1. The optimizer step (AdamW, weight decay, fp32 params and grads) on N params at
   DP=1 against torch's on the same elements, interleaved (the machine is shared:
   only paired ratios torch/fastgrad mean something; >= 1: fastgrad at least as
   fast), the same work on both sides: without clipping, ``AdamW(foreach=True)``
   vs ``check_nonfinite=False`` (no pass before the update, as Megatron-Core with
   ``--clip-grad 0``); fastgrad's default (an exact-norm pass for its NaN/inf skip)
   and its torch-op path; with clipping to 1.0 (Megatron-Core's default),
   ``clip_grad_norm_(foreach=True)`` + AdamW vs the exact norm + clipped update,
   also in many more rounds with the spread of the ratios and the other
   processes' CPU use, on torch's threads and on one thread each; where the
   clipped step's time goes; the kernels' JIT compile time (empty numba cache)
   vs a cached start.
2. With ``overlap_param_gather`` on 2 gloo ranks: the time the forward waits in the
   pre-hooks for the param all-gathers, as a share of the same all-gathers' own
   (synchronous) time; ``--backend nccl`` runs it on two GPUs, timing with CUDA
   events (the forward after the step minus the same forward with nothing in
   flight), since there a pre-hook's wait only orders streams.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch
from torch import nn

from fastgrad.ddp import DistributedDataParallel
from fastgrad.optim import AdamWConfig, DistributedOptimizer
from fastgrad.optim.norm import local_square_limbs
from fastgrad.optim.step_paths import FusedCpuPath, TorchOpsPath
from fastgrad.optim.update import adamw_update_
from gradvocab import DDPConfig
from verify.distributed import spawn

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.1
MAX_NORM = 1.0
QUIET_CORES = 0.25  # a round this little disturbed by other processes counts as quiet
SHAPES_OF = {10**7: [(2000, 2000), (2000, 2000), (1000, 2000)], 10**6: [(500, 1000), (500, 1000)]}


class Weights(nn.Module):
    """Plain 2-D weights; ``forward`` returns ``sum(w * c)`` so grads are the given tensors."""

    def __init__(self, shapes, g: torch.Generator) -> None:
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in shapes])

    def forward(self, coeffs):
        return sum((w * c).sum() for w, c in zip(self.ws, coeffs))


def interleaved(sides: dict, rounds: int, others: list | None = None) -> dict[str, list[float]]:
    """Per round, each side's step once, right after its untimed setup; all times per side.
    ``sides``: name -> (setup, step); ``others``: gets each round's other-process load (cores).

    The order rotates by one each round: a candidate that runs right after torch ops
    meets torch's OpenMP workers still spinning (about 10 ms) on the cores it needs, so a
    fixed order would charge that to whichever candidate follows one."""
    times = {name: [] for name in sides}
    for setup, step in sides.values():  # warm-up
        setup()
        step()
    names = list(sides)
    for round_index in range(rounds):
        shift = round_index % len(names)
        round_start = cpu_seconds()
        for name in names[shift:] + names[:shift]:
            setup, step = sides[name]
            setup()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
        if others is not None:
            others.append(others_cores(round_start))
    return times


def cpu_seconds() -> tuple[float, float, float]:
    """(wall clock, CPU seconds every process on the machine used, CPU seconds this one used),
    from /proc/stat (zeros where there is none)."""
    busy = 0.0
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # not idle, iowait
    except (OSError, ValueError, IndexError):
        pass
    return time.perf_counter(), busy, time.process_time()


def others_cores(start: tuple[float, float, float]) -> float:
    """Cores the other processes kept busy on average since ``start`` (nan without /proc/stat)."""
    wall, busy, own = (b - a for a, b in zip(start, cpu_seconds()))
    return max(0.0, busy - own) / wall if start[1] else float("nan")


def others_load(start: tuple[float, float, float]) -> str:
    """How busy the machine was with other processes since ``start`` (cores), and the load."""
    others = f"{others_cores(start):.2f} of {os.cpu_count()} cores"
    loads = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"other processes used {others} meanwhile; load average at the end {loads}"


def spread(ratios: list[float]) -> str:
    """Median, quartiles and 10-90 % range of ``ratios``."""
    q = statistics.quantiles(ratios, n=20, method="inclusive")  # 5 % steps
    quart = statistics.quantiles(ratios, n=4, method="inclusive")
    return (f"median {statistics.median(ratios):.2f}, quartiles {quart[0]:.2f}-{quart[2]:.2f}, "
            f"10-90 % {q[1]:.2f}-{q[17]:.2f}, min-max {min(ratios):.2f}-{max(ratios):.2f}")


class StepFixture:
    """The benchmark's model (its grads are the given tensors), DDP over it, and the setups."""

    def __init__(self, numel: int) -> None:
        self.generator = g = torch.Generator().manual_seed(0)
        self.numel = numel
        shapes = SHAPES_OF[numel]
        self.grads = [torch.randn(s, generator=g) * 1e-2 for s in shapes]  # norm ~ 0.01 sqrt(N)
        self.model = Weights(shapes, g)
        self.ddp = DistributedDataParallel(self.model, config=DDPConfig(
            use_distributed_optimizer=True, bucket_size=numel + 1))
        self.cfg = AdamWConfig(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)

    def fast_setup(self) -> None:
        """fastgrad's grads, as a training step leaves them: zero, backward, sync."""
        self.ddp.zero_grad_buffer()
        self.model(self.grads).backward()
        self.ddp.finish_grad_sync()

    def torch_side(self, clip: bool) -> tuple:
        """(setup, step) of torch's AdamW(foreach=True) over copies of the same params, after
        ``clip_grad_norm_(MAX_NORM, foreach=True)`` when ``clip``."""
        params = [nn.Parameter(w.detach().clone()) for w in self.model.ws]
        opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)

        def setup():
            for p, gr in zip(params, self.grads):
                p.grad = gr.clone()

        def step():
            if clip:
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
            opt.step()
        return setup, step


def step_benchmark(fx: StepFixture, rounds: int) -> list[str]:
    # Optimizers over the same buffers: the default (a NaN/inf check, i.e. the exact norm,
    # every step), as Megatron-Core without clipping (no pass before the update), clipping
    # at Megatron-Core's default --clip-grad 1.0, and the default on the torch-op path.
    opt = DistributedOptimizer(fx.ddp, fx.cfg)
    assert isinstance(opt.path, FusedCpuPath), opt.path.name
    unchecked = DistributedOptimizer(fx.ddp, fx.cfg, check_nonfinite=False)
    clipping = DistributedOptimizer(fx.ddp, fx.cfg, max_grad_norm=MAX_NORM)
    ops_opt = DistributedOptimizer(fx.ddp, fx.cfg)
    ops_opt.path = TorchOpsPath(ops_opt.shards)
    fast = fx.fast_setup
    times = interleaved({"torch": fx.torch_side(False), "torch clip": fx.torch_side(True),
                         "fused": (fast, opt.step), "fused unchecked": (fast, unchecked.step),
                         "fused clip": (fast, clipping.step), "torch ops": (fast, ops_opt.step)},
                        rounds)
    assert clipping.last_result.clip_coefficient < 1, "the benchmark's grads must be clipped"
    med = {name: statistics.median(ts) for name, ts in times.items()}

    def paired(name: str, baseline: str) -> float:
        return statistics.median(b / f for b, f in zip(times[baseline], times[name]))

    return [f"step, {fx.numel:.0e} fp32 params, AdamW wd={WD}, DP=1, {rounds} interleaved rounds "
            "(median ms; ratio: median of the per-round ratios torch/fastgrad, >= 1: fastgrad "
            "at least as fast):",
            "  no clipping:",
            f"    torch.optim.AdamW(foreach=True):                          {1e3 * med['torch']:8.1f}",
            f"    fastgrad, check_nonfinite=False (fused CPU):              {1e3 * med['fused unchecked']:8.1f}"
            f"   ratio {paired('fused unchecked', 'torch'):.2f} (goal >= 1; the same work)",
            f"    fastgrad, default: + exact norm for the NaN/inf skip:     {1e3 * med['fused']:8.1f}"
            f"   ratio {paired('fused', 'torch'):.2f}",
            f"    fastgrad, default, torch-op path:                         {1e3 * med['torch ops']:8.1f}"
            f"   ratio {paired('torch ops', 'torch'):.2f}",
            f"  clipping to global norm {MAX_NORM} (Megatron-Core's default --clip-grad):",
            f"    torch clip_grad_norm_(foreach=True) + AdamW(foreach=True): {1e3 * med['torch clip']:8.1f}",
            f"    fastgrad, max_grad_norm={MAX_NORM} (fused CPU):                 {1e3 * med['fused clip']:8.1f}"
            f"   ratio {paired('fused clip', 'torch clip'):.2f} (goal >= 1.2; see the rounds below)"]


def kernels_at(commit: str):
    """``fastgrad/optim/cpu_kernels.py`` as it was at ``commit``, imported from a temporary copy."""
    source = subprocess.run(["git", "show", f"{commit}:fastgrad/optim/cpu_kernels.py"], check=True,
                            capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="bench_optim_"), f"cpu_kernels_{commit}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"cpu_kernels_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clipped_benchmark(fx: StepFixture, rounds: int, clip_rounds: int, before: str | None) -> list[str]:
    """The clipped step against torch's in interleaved rounds, on torch's threads and on one
    thread each, then where its time goes; ``before``: also with the kernels of that commit."""
    fast = {"fastgrad": DistributedOptimizer(fx.ddp, fx.cfg, max_grad_norm=MAX_NORM)}
    if before:
        fast[f"fastgrad@{before}"] = old = DistributedOptimizer(
            fx.ddp, fx.cfg, max_grad_norm=MAX_NORM)
        old.path = FusedCpuPath(old.shards, kernels_at(before))
    sides = {"torch": fx.torch_side(True)} | {k: (fx.fast_setup, o.step) for k, o in fast.items()}
    lines = [f"  fastgrad@{before}: the same optimizer with fastgrad/optim/cpu_kernels.py as at "
             f"{before}"] if before else []
    # One thread each too: on a loaded machine a parallel step waits for preempted threads
    # (torch's OpenMP barriers many times a step), which one thread does not.
    threads = torch.get_num_threads()
    for label, count in ((f"{threads} threads", threads), ("1 thread each", 1)):
        torch.set_num_threads(count)  # the kernels split their rows over as many threads
        others: list[float] = []
        try:
            load_start = cpu_seconds()
            times = interleaved(sides, clip_rounds, others)
        finally:
            torch.set_num_threads(threads)
        quiet = [i for i, cores in enumerate(others) if cores < QUIET_CORES]
        lines.append(f"  clipping to {MAX_NORM}, {label}, {clip_rounds} interleaved rounds (the order "
                     "rotating), the same model, params and grads:")
        lines.append("    torch clip_grad_norm_(foreach=True) + AdamW(foreach=True): median "
                     f"{1e3 * statistics.median(times['torch']):6.1f} ms")
        for name in fast:
            ratios = [b / f for b, f in zip(times["torch"], times[name])]
            lines += [f"    {name}, max_grad_norm={MAX_NORM} (fused CPU, exact norm): median "
                      f"{1e3 * statistics.median(times[name]):6.1f} ms",
                      f"      ratio torch/it per round: {spread(ratios)} (goal >= 1.2)"]
            if len(quiet) >= 2:
                lines.append(f"      in the {len(quiet)} rounds with other processes on < {QUIET_CORES} "
                             f"cores: {spread([ratios[i] for i in quiet])}")
        lines.append(f"    {others_load(load_start)}; per round: median "
                     f"{statistics.median(others):.2f}, max {max(others):.2f} cores")
    # Where its time goes: the parts, right after the same backward as the step, and alone.
    def idle():
        time.sleep(0.05)  # torch's OpenMP workers stop spinning

    parts = {}
    for name, o in fast.items():
        work, raw = o.path.work[0], o.shards[0].bucket.group.grad_data.view(torch.int32).numpy()

        def norm(o=o, w=work, r=raw):
            o.path.k.square_bins(w, o.path.k.GRAD_FP32, r, 1.0)

        def update(o=o):
            o.path.update(o.groups, o.steps, None, 0.5)  # 0.5: a clip coefficient

        parts |= {f"{name}: clipped step": (fx.fast_setup, o.step),
                  f"{name}: exact norm, square_bins (the kernels)": (fx.fast_setup, norm),
                  f"{name}: exact norm, global_grad_norm (+ limbs, sqrt)": (fx.fast_setup,
                                                                           o.global_grad_norm),
                  f"{name}: clipped AdamW update + param copy": (fx.fast_setup, update),
                  f"{name}: square_bins, 50 ms idle before": (idle, norm),
                  f"{name}: update, 50 ms idle before": (idle, update)}
    bare = DistributedOptimizer(fx.ddp, fx.cfg, max_grad_norm=MAX_NORM)  # kernels doing nothing:
    bare.path = FusedCpuPath(bare.shards, types.SimpleNamespace(**{  # what the rest of a step costs
        **vars(bare.path.k), "square_bins": lambda *_: ([0] * 256, [0] * 256, 0),
        "adamw": lambda *_: None}))
    parts["fastgrad: the step with no-op kernels (Python, checks)"] = (fx.fast_setup, bare.step)
    flat = torch.cat([gr.reshape(-1) for gr in fx.grads])
    master, m, v = (torch.randn(fx.numel, generator=fx.generator), torch.zeros(fx.numel),
                    torch.zeros(fx.numel))
    parts |= {
        "torch ops: exact norm (local_square_limbs)": (idle, lambda: local_square_limbs([flat])),
        "torch ops: adamw_update_ (whole update)": (idle, lambda: adamw_update_(master, flat, m, v,
                                                                                fx.cfg, 1)),
    }
    load_start = cpu_seconds()
    part_times = interleaved(parts, rounds)
    med = {name: 1e3 * statistics.median(ts) for name, ts in part_times.items()}
    lines.append(f"  the clipped step's parts (median ms of {rounds} interleaved rounds, "
                 f"{threads} threads; 'clipped step' to 'update' right after the backward, as in a step; "
                 f"{others_load(load_start)}):")
    for name, value in med.items():
        lines.append(f"    {name:60s} {value:8.1f}")
    return lines


_FIRST_STEP = """
import time; t0 = time.perf_counter()
import torch
from torch import nn
from gradvocab import DDPConfig
from fastgrad.ddp import DistributedDataParallel
from fastgrad.optim import AdamWConfig, DistributedOptimizer
model = nn.Linear(8, 8)
ddp = DistributedDataParallel(model, config=DDPConfig(use_distributed_optimizer=True))
opt = DistributedOptimizer(ddp, AdamWConfig(lr=1e-3))
model(torch.ones(2, 8)).sum().backward(); ddp.finish_grad_sync(); opt.step()
print(time.perf_counter() - t0)
"""


def first_step_seconds(cache_dir: str) -> float:
    """Seconds from a fresh interpreter to the end of a first (tiny) step, numba cache in ``cache_dir``."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", _FIRST_STEP], env=env, check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def compile_benchmark() -> list[str]:
    with tempfile.TemporaryDirectory() as cache_dir:
        cold = first_step_seconds(cache_dir)  # compiles the kernels, fills the cache
        warm = first_step_seconds(cache_dir)  # loads them from the cache
    return [f"first step in a fresh process (import + build + step): {cold:.2f} s with an empty "
            f"numba cache (JIT compile), {warm:.2f} s with it filled"]


class Layer(nn.Module):
    def __init__(self, width: int, g: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width, generator=g) / width**0.5)

    def forward(self, x):
        return torch.tanh(x @ self.weight)


def _overlap_worker(rank: int, world: int, width: int, layers: int, rounds: int,
                    backend: str) -> dict:
    import torch.distributed as dist

    from fastgrad.comm import all_gather_into

    device = torch.device("cpu")
    if backend == "nccl":  # one GPU per rank
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(*[Layer(width, g) for _ in range(layers)]).to(device)
    ddp = DistributedDataParallel(model, config=DDPConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, bucket_size=width * width))
    opt = DistributedOptimizer(ddp, AdamWConfig(lr=LR))
    x = torch.randn(64, width, generator=g).to(device)

    def gather_all() -> None:  # the same all-gathers, synchronous
        for b in ddp.buffer.buckets:
            all_gather_into(b.param_data, b.local_param_shard, group=b.dp_group)

    def train_step() -> None:
        ddp.zero_grad_buffer()
        model(x).sum().backward()
        ddp.finish_grad_sync()
        opt.step()  # launches every bucket's param all-gather

    if device.type == "cuda":
        return _overlap_on_gpu(model, x, train_step, gather_all, rounds)
    waited = [0.0]
    starts = {}
    for layer in model:
        layer.register_forward_pre_hook(lambda m, a: starts.__setitem__(id(m), time.perf_counter()),
                                        prepend=True)
        layer.register_forward_pre_hook(
            lambda m, a: waited.__setitem__(0, waited[0] + time.perf_counter() - starts[id(m)]))
    waits, gathers = [], []
    for _ in range(rounds + 1):
        train_step()
        waited[0] = 0.0
        with torch.no_grad():
            model(x)  # each layer's pre-hook waits for its bucket
        waits.append(waited[0])
        dist.barrier()
        start = time.perf_counter()
        gather_all()
        gathers.append(time.perf_counter() - start)
    return {"wait": statistics.median(waits[1:]), "gather": statistics.median(gathers[1:])}


def _overlap_on_gpu(model, x, train_step, gather_all, rounds: int) -> dict:
    """On a GPU the pre-hooks' ``wait()`` only orders the streams, so the host cannot time
    it: the forward right after the step (gathers in flight) is timed with CUDA events
    against the same forward with nothing in flight; the difference is the exposed wait."""
    import torch.distributed as dist

    def timed(fn) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1e3

    def forward() -> None:
        with torch.no_grad():
            model(x)

    waits, gathers = [], []
    for _ in range(rounds + 1):
        train_step()
        overlapped = timed(forward)  # each layer's pre-hook makes the stream wait for its bucket
        alone = timed(forward)
        waits.append(max(0.0, overlapped - alone))
        dist.barrier()
        gathers.append(timed(gather_all))
    return {"wait": statistics.median(waits[1:]), "gather": statistics.median(gathers[1:])}


def overlap_benchmark(width: int, layers: int, rounds: int, backend: str) -> list[str]:
    per_rank = spawn(_overlap_worker, 2, width, layers, rounds, backend, backend=backend,
                     timeout_s=600)
    wait = statistics.mean(r["wait"] for r in per_rank)
    gather = statistics.mean(r["gather"] for r in per_rank)
    how = ("host time in the pre-hooks" if backend == "gloo" else
           "CUDA events: forward after the step minus the same forward with nothing in flight")
    return [f"overlap_param_gather, {backend}, DP=2, {layers} buckets of {width}x{width} fp32, "
            f"median of {rounds} rounds:",
            f"  forward waited ({how}): {1e3 * wait:.2f} ms; the all-gathers alone: "
            f"{1e3 * gather:.2f} ms; share {wait / gather:.1%}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10^6 params, 3 rounds")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                        help="collective backend of the overlap part: gloo (CPU tensors) or "
                             "nccl (one GPU per rank: needs 2 GPUs)")
    parser.add_argument("--clip-rounds", type=int, default=0,
                        help="interleaved rounds of clipped steps (default 41; --quick 5)")
    parser.add_argument("--kernels-of", metavar="COMMIT",
                        help="also run the clipped step with fastgrad/optim/cpu_kernels.py as it "
                             "was at COMMIT (a before/after comparison in one run)")
    parser.add_argument("--out", help="also write the output to this file")
    args = parser.parse_args()
    if args.backend == "nccl" and torch.cuda.device_count() < 2:
        parser.error(f"--backend nccl needs 2 GPUs (one per rank), found {torch.cuda.device_count()}")
    numel, rounds = (10**6, 3) if args.quick else (10**7, 7)
    clip_rounds = args.clip_rounds or (5 if args.quick else 41)
    lines = [f"bench_optim, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
    fixture = StepFixture(numel)
    lines += step_benchmark(fixture, rounds)
    lines += clipped_benchmark(fixture, rounds, clip_rounds, args.kernels_of)
    lines += compile_benchmark()
    lines += overlap_benchmark(256 if args.quick else 1024, 4, rounds, args.backend)
    lines.append(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())

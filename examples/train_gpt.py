"""Train a small character-level GPT with fastgrad's DDP and 1F1B pipeline.

Run from the repository root::

    torchrun --nproc-per-node 2 examples/train_gpt.py --train-iters 50
    torchrun --nproc-per-node 2 examples/train_gpt.py --pipeline-model-parallel-size 2
    python -m examples.train_gpt --train-iters 20          # one process

``world = PP x DP`` ranks (pipeline outermost, as Megatron-Core); NCCL when
CUDA is available, else gloo. Each replica of each stage wraps its part of the
model in ``fastgrad.ddp.DistributedDataParallel`` (gradients land, averaged
over the replicas, in ``param.main_grad``); PP = 1 accumulates gradients over
the microbatches with ``no_sync()``, PP > 1 runs
``fastgrad.pipeline.forward_backward_1f1b`` (grad sync in the cooldown bubble,
then the tied-embedding all-reduce). The optimizer is built by
:func:`build_optimizer`: ``fastgrad.optim.DistributedOptimizer`` with
``--use-distributed-optimizer`` (fp32 master shards, reduce-scattered grads,
param all-gather; fp16 with ``DynamicLossScaler``), else a torch AdamW on the
all-reduced ``main_grad``. At the end every rank's parameters are hashed and
compared: replicas of a stage, and the two copies of a tied embedding, must be
bitwise identical, else the exit status is 1.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

if __package__ in (None, ""):
    # Run as a file (torchrun examples/train_gpt.py): make `examples` and the
    # repository's own fastgrad importable, ahead of any installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from torch import nn  # noqa: E402

from examples.arguments import TrainArgs, parse_args  # noqa: E402
from examples.data import CharCorpus  # noqa: E402
from examples.gpt import GPT, GPTConfig, build_stage, shared_embedding_params  # noqa: E402
from fastgrad.config import DDPConfig  # noqa: E402
from fastgrad.ddp import DistributedDataParallel  # noqa: E402
from fastgrad.optim import (  # noqa: E402
    AdamWConfig,
    DistributedOptimizer,
    DynamicLossScaler,
    param_groups_without_decay_for,
)
from fastgrad.parallel_dims import ParallelDims  # noqa: E402
from fastgrad.pipeline import forward_backward_1f1b  # noqa: E402


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: backend, device and its place in the PP x DP grid."""

    backend: str
    device: torch.device
    dims: ParallelDims

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.dims.rank


class TrainOptimizer(Protocol):
    """What the training loop needs from :func:`build_optimizer`'s result."""

    skipped: int  # updates skipped so far (non-finite gradients)
    loss_scale: float  # multiply the loss by this before backward (1.0 without fp16 scaling)

    def step(self) -> float:
        """Update the params from the reduced ``main_grad``; return the global grad norm."""
        ...

    def finish_param_sync(self) -> None:
        """Wait for any param all-gather still in flight (before reading the params)."""
        ...


def mark_shared_copies(stage_module: nn.Module, dims: ParallelDims) -> None:
    """Mark a tied embedding's copy on a later stage ``shared`` (fastgrad.optim's marker).

    examples/gpt.py marks both copies ``shared_embedding``; the optimizer leaves
    params with ``shared = True`` out of the global norm, so only the first
    stage's copy counts (both hold the same all-reduced gradient).
    """
    if dims.pp_size > 1 and not dims.is_first_stage:
        for p in shared_embedding_params(stage_module):
            p.shared = True


class ShardedAdamW:
    """``fastgrad.optim.DistributedOptimizer`` (AdamW) over this rank's one DDP chunk.

    The global norm is summed over the pipeline group; the last stage's copy of
    a tied embedding is marked ``shared`` (the optimizer leaves it out of the
    norm: the first stage's copy holds the same all-reduced gradient). fp16
    grads get a ``DynamicLossScaler``; a skipped step is counted in ``skipped``.
    """

    def __init__(self, ddp: DistributedDataParallel, args: TrainArgs, dims: ParallelDims) -> None:
        mark_shared_copies(ddp.module, dims)
        fp16_grads = any(g.grad_dtype == torch.float16 for g in ddp.buffer.groups)
        self.optimizer = DistributedOptimizer(
            ddp,
            AdamWConfig(lr=args.lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=args.weight_decay),
            param_groups_without_decay_for(ddp),
            max_grad_norm=args.clip_grad if args.clip_grad > 0 else None,
            loss_scaler=DynamicLossScaler() if fp16_grads else None,
            model_parallel_group=dims.pp_group if dims.pp_size > 1 else None,
        )
        self.skipped = 0

    @property
    def loss_scale(self) -> float:
        scaler = self.optimizer.loss_scaler
        return 1.0 if scaler is None else scaler.scale

    def step(self) -> float:
        """One distributed-optimizer step; return the global grad norm (unscaled)."""
        result = self.optimizer.step()
        self.skipped += not result.stepped
        return result.grad_norm

    def finish_param_sync(self) -> None:
        self.optimizer.finish_param_sync()


class AdamWOnMainGrad:
    """Fallback optimizer: ``torch.optim.AdamW`` fed from the DP-averaged ``main_grad``.

    Valid only when every rank holds the whole reduced gradient (all-reduce,
    no distributed optimizer). 16-bit params are updated through fp32 master
    copies (as Megatron-Core's mixed-precision optimizer: AdamW's state and
    ``eps`` do not survive fp16). ``step`` clips by the global norm over all
    pipeline stages (the last stage's copy of a tied embedding is not counted
    twice) and skips the update when that norm is not finite; the norm is the
    same on every rank, so all ranks skip together.
    """

    def __init__(self, ddp_modules: Sequence[DistributedDataParallel], args: TrainArgs,
                 dims: ParallelDims) -> None:
        self.args = args
        self.dims = dims
        self.params = [p for d in ddp_modules for p in d.module.parameters() if p.requires_grad]
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().float().requires_grad_(True)
            for p in self.params
        ]
        decay = [m for p, m in zip(self.params, self.masters) if p.ndim >= 2]
        no_decay = [m for p, m in zip(self.params, self.masters) if p.ndim < 2]  # biases, norms
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": args.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
        )
        # The first stage owns the tied embedding for the norm; the last stage's copy
        # holds the same (all-reduced) gradient.
        self.norm_params = [
            p for p in self.params
            if not (getattr(p, "shared_embedding", False) and not dims.is_first_stage)
        ]
        self.skipped = 0
        self.loss_scale = 1.0  # fp16 runs unscaled with this fallback

    def finish_param_sync(self) -> None:
        """Nothing in flight: the update writes the params directly."""

    def global_grad_norm(self) -> float:
        """L2 norm of the reduced gradient of the whole model (all stages)."""
        squares = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        for p in self.norm_params:
            squares += p.main_grad.float().pow(2).sum()
        if self.dims.pp_size > 1:
            dist.all_reduce(squares, group=self.dims.pp_group)
        return float(squares.sqrt())

    def step(self) -> float:
        """Clip and update the parameters; return the gradient norm before clipping."""
        norm = self.global_grad_norm()
        if not math.isfinite(norm):
            self.skipped += 1
            return norm
        scale = 1.0
        if self.args.clip_grad > 0 and norm > self.args.clip_grad:
            scale = self.args.clip_grad / (norm + 1e-6)
        for master, p in zip(self.masters, self.params):
            master.grad = p.main_grad.to(master.dtype) * scale
        self.optimizer.step()
        with torch.no_grad():
            for master, p in zip(self.masters, self.params):
                master.grad = None  # a .grad left on p would be added to by the next backward
                if master is not p:
                    p.copy_(master)
        return norm


def build_optimizer(ddp_modules: Sequence[DistributedDataParallel], args: TrainArgs,
                    dims: ParallelDims) -> TrainOptimizer:
    """The optimizer of the wrapped modules (call ``step()`` after ``finish_grad_sync``).

    ``--use-distributed-optimizer``: :class:`ShardedAdamW` (one DDP chunk per
    stage, as this example builds); otherwise :class:`AdamWOnMainGrad`.
    """
    if not args.use_distributed_optimizer:
        return AdamWOnMainGrad(ddp_modules, args, dims)
    if len(ddp_modules) != 1:
        raise ValueError(
            f"--use-distributed-optimizer drives one DDP chunk per stage, got {len(ddp_modules)} "
            "(several chunks would each compute their own grad norm)"
        )
    return ShardedAdamW(ddp_modules[0], args, dims)


def build_ddp_config(args: TrainArgs) -> DDPConfig:
    """Map the Megatron-style flags onto fastgrad's DDPConfig (Megatron-Core field names)."""
    return DDPConfig(
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size,
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        reduce_scatter_with_fp32_accumulation=args.ddp_reduce_scatter_with_fp32_accumulation,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(args: TrainArgs) -> Runtime:
    """Join the launcher's process group (or make a one-process one) and build the grid."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1, timeout=timeout)
    dims = ParallelDims(pp_size=args.pipeline_model_parallel_size,
                          dp_size=args.data_parallel_size).build()
    return Runtime(backend=backend, device=device, dims=dims)


def build_model_stage(args: TrainArgs, vocab_size: int, runtime: Runtime) -> nn.Module:
    """This rank's pipeline stage, from a full model initialised identically on every rank."""
    torch.manual_seed(args.seed)
    config = GPTConfig(
        vocab_size=vocab_size, seq_length=args.seq_length, hidden_size=args.hidden_size,
        num_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
        tie_embeddings=args.tie_embeddings,
    )
    stage = build_stage(GPT(config), runtime.dims.stage, runtime.dims.pp_size)
    return stage.to(device=runtime.device, dtype=args.params_dtype)


def train_step(ddp: DistributedDataParallel, args: TrainArgs, runtime: Runtime,
               inputs: list[torch.Tensor], targets: list[torch.Tensor],
               loss_scale: float = 1.0) -> torch.Tensor | None:
    """Forward and backward of one global batch; on return ``main_grad`` is reduced.

    ``loss_scale`` (fp16 loss scaling, a power of two) multiplies the loss before
    backward. Returns this replica's mean (unscaled) loss over its microbatches
    on the last stage, else None.
    """
    dims, m = runtime.dims, args.num_microbatches

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Divided by M: the microbatch grads accumulate into the mean over the batch.
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten()) / m
        return loss * loss_scale if loss_scale != 1.0 else loss

    ddp.zero_grad_buffer()
    if dims.pp_size == 1:
        total = torch.zeros((), device=runtime.device)
        for i in range(m):
            with nullcontext() if i == m - 1 else ddp.no_sync():
                loss = loss_fn(ddp(inputs[i]), targets[i])
                loss.backward()
            total += loss.detach()
        ddp.finish_grad_sync()
        return total / loss_scale
    losses = forward_backward_1f1b(
        ddp,
        parallel_dims=dims,
        grad_sync=ddp,
        num_microbatches=m,
        activation_shape=(args.micro_batch_size, args.seq_length, args.hidden_size),
        loss_fn=loss_fn,
        inputs=inputs if dims.is_first_stage else None,
        targets=targets if dims.is_last_stage else None,
        dtype=args.params_dtype,
        embedding_params=shared_embedding_params(ddp.module),
    )
    return torch.stack(losses).sum() / loss_scale if dims.is_last_stage else None


def global_mean_loss(loss: torch.Tensor | None, runtime: Runtime) -> float:
    """The batch loss averaged over replicas, known on every rank (from the last stages)."""
    dims = runtime.dims
    value = loss.detach().float().reshape(1) if loss is not None else None
    if value is None:
        value = torch.zeros(1, device=runtime.device)
    if dims.pp_size > 1:  # only the last stage has a loss: a SUM moves it to every stage
        dist.all_reduce(value, group=dims.pp_group)
    if dims.dp_size > 1:
        dist.all_reduce(value, group=dims.dp_group)
    return float(value) / dims.dp_size


def _digest(tensors: list[torch.Tensor]) -> str:
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:16]


def verify_identical_parameters(module: nn.Module, runtime: Runtime, console: Console) -> bool:
    """Bitwise: replicas of a stage hold the same parameters; tied embedding copies agree.

    Every rank prints its digests; the verdict (gathered from all ranks) is the same everywhere.
    """
    dims = runtime.dims
    params = [p for _, p in sorted(module.named_parameters())]
    shared = shared_embedding_params(module)
    mine = (dims.stage, _digest(params), _digest(shared) if shared else None)
    line = f"rank {dims.rank} (stage {dims.stage}, dp rank {dims.dp_rank}): params {mine[1]}"
    line += f" tied-embedding {mine[2]}" if shared else ""
    # One write, newline included: print() writes the text and the newline separately,
    # and another rank's line on the shared stdout can land between the two.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    gathered: list[tuple[int, str, str | None]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine)
    problems = []
    for stage in range(dims.pp_size):
        digests = {d for s, d, _ in gathered if s == stage}
        if len(digests) > 1:
            problems.append(f"stage {stage}: replicas differ ({sorted(digests)})")
    embeddings = {e for _, _, e in gathered if e is not None}
    if len(embeddings) > 1:
        problems.append(f"tied embedding copies differ ({sorted(embeddings)})")
    if problems and dims.rank == 0:
        console.print("error: ranks disagree: " + "; ".join(problems), markup=False)
    return not problems


def train(args: TrainArgs, runtime: Runtime, console: Console) -> int:
    """The training loop; returns the exit status (0, or 1 when the ranks disagree)."""
    dims = runtime.dims
    corpus = CharCorpus.from_file()
    ddp = DistributedDataParallel(
        build_model_stage(args, corpus.vocab_size, runtime),
        config=build_ddp_config(args),
        parallel_dims=dims,
    )
    optimizer = build_optimizer([ddp], args, dims)
    rank0 = runtime.rank == 0
    if rank0:
        count = sum(p.numel() for p in ddp.module.parameters())
        console.print(
            f"world {dist.get_world_size()} ({runtime.backend}) = PP {dims.pp_size} x DP "
            f"{dims.dp_size}; {args.num_microbatches} microbatches of {args.micro_batch_size}"
            f" per replica; vocabulary {corpus.vocab_size}; stage 0 holds {count} parameters",
            markup=False, highlight=False,
        )
    losses: list[float] = []
    progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                        console=console, disable=not rank0)
    with progress:
        task = progress.add_task("train", total=args.train_iters, loss="-")
        for iteration in range(1, args.train_iters + 1):
            inputs, targets = corpus.sample_microbatches(
                seed=args.seed, step=iteration, dp_rank=dims.dp_rank, dp_size=dims.dp_size,
                num_microbatches=args.num_microbatches,
                micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
            )
            inputs = [t.to(runtime.device) for t in inputs]
            targets = [t.to(runtime.device) for t in targets]
            local = train_step(ddp, args, runtime, inputs, targets, optimizer.loss_scale)
            grad_norm = optimizer.step()
            losses.append(global_mean_loss(local, runtime))
            progress.update(task, advance=1, loss=f"{losses[-1]:.4f}")
            if rank0 and (iteration % args.log_interval == 0 or iteration == 1):
                progress.console.print(
                    f"iteration {iteration:>6}/{args.train_iters} | loss {losses[-1]:.6f} | "
                    f"grad norm {grad_norm:.4f} | lr {args.lr:.3e}"
                    + (f" | loss scale {optimizer.loss_scale:g}" if optimizer.loss_scale != 1.0 else ""),
                    markup=False, highlight=False,
                )
    optimizer.finish_param_sync()  # --overlap-param-gather: the last gather may be in flight
    agree = verify_identical_parameters(ddp.module, runtime, console)
    world = dist.get_world_size()
    if rank0:
        console.print(
            f"summary: first loss {losses[0]:.6f} last loss {losses[-1]:.6f} after "
            f"{args.train_iters} iterations ({optimizer.skipped} skipped for non-finite gradients); "
            "parameters "
            + ("identical on" if agree else "DIFFER across")
            + (f" all {world} ranks" if world > 1 else " the one rank"),
            markup=False, highlight=False,
        )
    return 0 if agree else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse flags (exit 2 on a bad combination), train, check, clean up."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    args = parse_args(argv, world_size, report=rank == 0)
    runtime = init_distributed(args)
    console = Console(highlight=False, soft_wrap=True)
    try:
        return train(args, runtime, console)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

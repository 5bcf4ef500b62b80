"""Train a small character-level GPT with fastgrad's DDP and 1F1B pipeline.

Run from the repository root::

    torchrun --nproc-per-node 2 examples/train_gpt.py --use-distributed-optimizer \
        --overlap-grad-reduce --overlap-param-gather        # the README's loop
    torchrun --nproc-per-node 2 examples/train_gpt.py --global-batch-size 48 --save ckpt \
        --save-interval 50 --lr-decay-style cosine --lr-warmup-iters 10
    torchrun --nproc-per-node 3 examples/train_gpt.py --global-batch-size 48 --load ckpt \
        --lr-decay-style cosine --lr-warmup-iters 10      # resumes at DP 3
    torchrun --nproc-per-node 2 examples/train_gpt.py --pipeline-model-parallel-size 2
    python -m examples.train_gpt --train-iters 20          # one process

``world = PP x DP`` ranks (pipeline outermost, as Megatron-Core); NCCL when
CUDA is available, else gloo. Each replica of each stage wraps its part of the
model in ``fastgrad.ddp.DistributedDataParallel`` (gradients land, averaged
over the replicas, in ``param.main_grad``); PP = 1 accumulates gradients over
the microbatches with ``no_sync()``, PP > 1 runs
``fastgrad.pipeline.forward_backward_1f1b`` (grad sync in the cooldown bubble,
then the tied-embedding all-reduce). The optimizer is built by
:func:`build_optimizer`: ``fastgrad.DistributedOptimizer`` with
``--use-distributed-optimizer`` (fp32 master shards, reduce-scattered grads,
param all-gather), else ``fastgrad.ReplicatedOptimizer`` (the same AdamW step
over the all-reduced grads); fp16 with a ``DynamicLossScaler``. The learning
rate follows Megatron's schedule (``--lr-decay-style``, ``--lr-warmup-iters``;
``examples/lr_schedule.py``) through a torch LR scheduler. ``--save`` and
``--load`` write and resume checkpoints in Megatron-LM's layout, at any
data-parallel size (``examples/checkpoint.py``). At the end every rank's
parameters are hashed and compared: replicas of a stage, and the two copies of
a tied embedding, must be bitwise identical, else the exit status is 1.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

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
from examples.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from examples.data import CharCorpus  # noqa: E402
from examples.gpt import GPT, GPTConfig, build_stage, shared_embedding_params  # noqa: E402
from examples.lr_schedule import LRSchedule, MegatronLR  # noqa: E402
from fastgrad import (  # noqa: E402
    AdamWConfig,
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    DynamicLossScaler,
    ParallelGroups,
    ReplicatedOptimizer,
    build_parallel_groups,
    forward_backward_1f1b,
    param_groups_without_decay_for,
)


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: backend, device and its place in the PP x DP grid."""

    backend: str
    device: torch.device
    groups: ParallelGroups

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.groups.rank


def mark_shared_copies(stage_module: nn.Module, groups: ParallelGroups) -> None:
    """Mark a tied embedding's copy on a later stage ``shared`` (fastgrad.optim's marker).

    examples/gpt.py marks both copies ``shared_embedding``; the optimizer leaves
    params with ``shared = True`` out of the global norm, so only the first
    stage's copy counts (both hold the same all-reduced gradient).
    """
    if groups.pp_size > 1 and not groups.is_first_stage:
        for p in shared_embedding_params(stage_module):
            p.shared = True


def build_optimizer(ddp: DistributedDataParallel, args: TrainArgs,
                    groups: ParallelGroups) -> DistributedOptimizer:
    """fastgrad's AdamW over this rank's DDP chunk (call ``step()`` after ``finish_grad_sync``).

    ``--use-distributed-optimizer``: :class:`fastgrad.DistributedOptimizer` (fp32 master
    shards of the reduce-scattered grads, params all-gathered); otherwise
    :class:`fastgrad.ReplicatedOptimizer` (the same step on every rank over the all-reduced
    grads, as Megatron-Core without the distributed optimizer). Both clip by the exact global
    norm over all pipeline stages (the last stage's copy of a tied embedding is marked
    ``shared`` and not counted twice) and skip a step whose gradients hold a NaN/inf; fp16
    grads get a ``DynamicLossScaler``.
    """
    mark_shared_copies(ddp.module, groups)
    fp16_grads = any(g.grad_dtype == torch.float16 for g in ddp.buffer.groups)
    kind = DistributedOptimizer if args.use_distributed_optimizer else ReplicatedOptimizer
    return kind(
        ddp,
        AdamWConfig(lr=args.lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=args.weight_decay),
        param_groups_without_decay_for(ddp),
        max_grad_norm=args.clip_grad if args.clip_grad > 0 else None,
        loss_scaler=DynamicLossScaler() if fp16_grads else None,
        model_parallel_group=groups.pp_group if groups.pp_size > 1 else None,
    )


def build_scheduler(optimizer: DistributedOptimizer, args: TrainArgs) -> MegatronLR:
    """Megatron's LR schedule from the flags (``examples.lr_schedule``)."""
    return MegatronLR(optimizer, LRSchedule(
        max_lr=args.lr, min_lr=args.min_lr, warmup_init=args.lr_warmup_init,
        warmup_iters=args.lr_warmup_iters, decay_iters=args.resolved_lr_decay_iters,
        decay_style=args.lr_decay_style,
    ))


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
    groups = build_parallel_groups(args.pipeline_model_parallel_size, args.data_parallel_size)
    return Runtime(backend=backend, device=device, groups=groups)


def build_model_stage(args: TrainArgs, vocab_size: int, runtime: Runtime) -> nn.Module:
    """This rank's pipeline stage, from a full model initialised identically on every rank."""
    torch.manual_seed(args.seed)
    config = GPTConfig(
        vocab_size=vocab_size, seq_length=args.seq_length, hidden_size=args.hidden_size,
        num_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
        tie_embeddings=args.tie_embeddings,
    )
    stage = build_stage(GPT(config), runtime.groups.stage, runtime.groups.pp_size)
    return stage.to(device=runtime.device, dtype=args.params_dtype)


def train_step(ddp: DistributedDataParallel, args: TrainArgs, runtime: Runtime,
               inputs: list[torch.Tensor], targets: list[torch.Tensor],
               loss_scale: float = 1.0) -> torch.Tensor | None:
    """Forward and backward of one global batch; on return ``main_grad`` is reduced.

    ``loss_scale`` (fp16 loss scaling, a power of two) multiplies the loss before
    backward. Returns this replica's mean (unscaled) loss over its microbatches
    on the last stage, else None.
    """
    groups, m = runtime.groups, args.num_microbatches

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Divided by M: the microbatch grads accumulate into the mean over the batch.
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten()) / m
        return loss * loss_scale if loss_scale != 1.0 else loss

    ddp.zero_grad_buffer()
    if groups.pp_size == 1:
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
        groups=groups,
        grad_sync=ddp,
        num_microbatches=m,
        activation_shape=(args.micro_batch_size, args.seq_length, args.hidden_size),
        loss_fn=loss_fn,
        inputs=inputs if groups.is_first_stage else None,
        targets=targets if groups.is_last_stage else None,
        dtype=args.params_dtype,
        embedding_params=shared_embedding_params(ddp.module),
    )
    return torch.stack(losses).sum() / loss_scale if groups.is_last_stage else None


def global_mean_loss(loss: torch.Tensor | None, runtime: Runtime) -> float:
    """The batch loss averaged over replicas, known on every rank (from the last stages)."""
    groups = runtime.groups
    value = loss.detach().float().reshape(1) if loss is not None else None
    if value is None:
        value = torch.zeros(1, device=runtime.device)
    if groups.pp_size > 1:  # only the last stage has a loss: a SUM moves it to every stage
        dist.all_reduce(value, group=groups.pp_group)
    if groups.dp_size > 1:
        dist.all_reduce(value, group=groups.dp_group)
    return float(value) / groups.dp_size


def _digest(tensors: list[torch.Tensor]) -> str:
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:16]


def verify_identical_parameters(module: nn.Module, runtime: Runtime, console: Console) -> bool:
    """Bitwise: replicas of a stage hold the same parameters; tied embedding copies agree.

    Every rank prints its digests; the verdict (gathered from all ranks) is the same everywhere.
    """
    groups = runtime.groups
    params = _sorted_params(module)
    shared = shared_embedding_params(module)
    mine = (groups.stage, _digest(params), _digest(shared) if shared else None)
    line = f"rank {groups.rank} (stage {groups.stage}, dp rank {groups.dp_rank}): params {mine[1]}"
    line += f" tied-embedding {mine[2]}" if shared else ""
    # One write, newline included: print() writes the text and the newline separately,
    # and another rank's line on the shared stdout can land between the two.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    gathered: list[tuple[int, str, str | None]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine)
    problems = []
    for stage in range(groups.pp_size):
        digests = {d for s, d, _ in gathered if s == stage}
        if len(digests) > 1:
            problems.append(f"stage {stage}: replicas differ ({sorted(digests)})")
    embeddings = {e for _, _, e in gathered if e is not None}
    if len(embeddings) > 1:
        problems.append(f"tied embedding copies differ ({sorted(embeddings)})")
    if problems and groups.rank == 0:
        console.print("error: ranks disagree: " + "; ".join(problems), markup=False)
    return not problems


def train(args: TrainArgs, runtime: Runtime, console: Console) -> int:
    """The training loop; returns the exit status (0, or 1 when the ranks disagree)."""
    groups = runtime.groups
    corpus = CharCorpus.from_file()
    ddp = DistributedDataParallel(
        build_model_stage(args, corpus.vocab_size, runtime),
        config=build_ddp_config(args),
        dp_group=groups.dp_group,
    )
    optimizer = build_optimizer(ddp, args, groups)
    scheduler = build_scheduler(optimizer, args)
    rank0 = runtime.rank == 0
    start = 0
    if args.load is not None:
        loaded = load_checkpoint(Path(args.load), args, groups, ddp, optimizer, scheduler)
        start = loaded or 0
        if rank0:
            console.print(f"loaded iteration {loaded} from {args.load} (data-parallel size now "
                          f"{groups.dp_size}); parameters {_digest(_sorted_params(ddp.module))}"
                          if loaded is not None else
                          f"WARNING: no checkpoint in {args.load}; training from scratch",
                          markup=False, highlight=False)
    if rank0:
        count = sum(p.numel() for p in ddp.module.parameters())
        console.print(
            f"world {dist.get_world_size()} ({runtime.backend}) = PP {groups.pp_size} x DP "
            f"{groups.dp_size}; {args.num_microbatches} microbatches of {args.micro_batch_size}"
            f" per replica; vocabulary {corpus.vocab_size}; stage 0 holds {count} parameters; "
            f"{type(optimizer).__name__}",
            markup=False, highlight=False,
        )
    losses: list[float] = []
    skipped = 0  # updates skipped for NaN/inf gradients in this run
    progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                        console=console, disable=not rank0)
    with progress:
        task = progress.add_task("train", total=args.train_iters, completed=start, loss="-")
        for iteration in range(start + 1, args.train_iters + 1):
            inputs, targets = corpus.sample_microbatches(
                seed=args.seed, step=iteration, dp_rank=groups.dp_rank, dp_size=groups.dp_size,
                num_microbatches=args.num_microbatches,
                micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
            )
            inputs = [t.to(runtime.device) for t in inputs]
            targets = [t.to(runtime.device) for t in targets]
            loss_scale = 1.0 if optimizer.loss_scaler is None else optimizer.loss_scaler.scale
            local = train_step(ddp, args, runtime, inputs, targets, loss_scale)
            lr = optimizer.param_groups[0]["lr"]
            result = optimizer.step()
            skipped += not result.stepped
            if result.stepped:  # Megatron: the schedule advances on successful updates only
                scheduler.step()
            losses.append(global_mean_loss(local, runtime))
            progress.update(task, advance=1, loss=f"{losses[-1]:.4f}")
            if rank0 and (iteration % args.log_interval == 0 or iteration == start + 1):
                progress.console.print(
                    f"iteration {iteration:>6}/{args.train_iters} | loss {losses[-1]:.6f} | "
                    f"grad norm {result.grad_norm:.4f} | lr {lr:.6e}"
                    + (f" | loss scale {loss_scale:g}" if loss_scale != 1.0 else "")
                    + ("" if result.stepped else " | skipped"),
                    markup=False, highlight=False,
                )
            if args.save is not None and (
                    iteration == args.train_iters
                    or (args.save_interval is not None and iteration % args.save_interval == 0)):
                path = save_checkpoint(Path(args.save), iteration, args, groups, ddp, optimizer,
                                       scheduler)
                if rank0:
                    progress.console.print(
                        f"saved iteration {iteration} to {path.parent.parent}; parameters "
                        f"{_digest(_sorted_params(ddp.module))}", markup=False, highlight=False)
    optimizer.finish_param_sync()  # --overlap-param-gather: the last gather may be in flight
    agree = verify_identical_parameters(ddp.module, runtime, console)
    world = dist.get_world_size()
    if rank0 and losses:
        console.print(
            f"summary: first loss {losses[0]:.6f} last loss {losses[-1]:.6f} after "
            f"iterations {start + 1}-{args.train_iters} ({skipped} skipped for "
            "non-finite gradients); parameters "
            + ("identical on" if agree else "DIFFER across")
            + (f" all {world} ranks" if world > 1 else " the one rank"),
            markup=False, highlight=False,
        )
    return 0 if agree else 1


def _sorted_params(module: nn.Module) -> list[torch.Tensor]:
    return [p for _, p in sorted(module.named_parameters())]


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

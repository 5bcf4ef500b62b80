"""Megatron-style command-line flags of ``examples/train_gpt.py``, validated into a dataclass.

:func:`parse_args` turns ``argv`` into a frozen :class:`TrainArgs`; every rule
that involves more than one flag is checked in ``TrainArgs.__post_init__`` and
reported with the flag names (``ValueError``), which :func:`parse_args` turns
into argparse's usage error (exit status 2).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from examples.lr_schedule import DECAY_STYLES


@dataclass(frozen=True)
class TrainArgs:
    """Validated training settings; ``world_size`` comes from the launcher, not a flag."""

    world_size: int
    pipeline_model_parallel_size: int = 1
    micro_batch_size: int = 4
    global_batch_size: int = 32
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    seq_length: int = 64
    train_iters: int = 100
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_decay_style: str = "constant"
    lr_decay_iters: int | None = None
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: int | None = None
    ddp_reduce_scatter_with_fp32_accumulation: bool = False
    accumulate_allreduce_grads_in_fp32: bool = False
    untie_embeddings_and_output_weights: bool = False
    seed: int = 1234
    log_interval: int = 10
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    ckpt_step: int | None = None
    distributed_timeout_minutes: float = 10.0

    def __post_init__(self) -> None:
        for name in (
            "world_size", "pipeline_model_parallel_size", "micro_batch_size", "global_batch_size",
            "num_layers", "hidden_size", "num_attention_heads", "seq_length", "train_iters",
            "log_interval",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_flag(name)} must be an integer >= 1, got {value!r}")
        for name in ("save_interval", "lr_decay_iters", "ckpt_step"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{_flag(name)} must be an integer >= 1, got {value!r}")
        if self.ckpt_step is not None and self.load is None:
            raise ValueError("--ckpt-step needs --load (the directory to load it from)")
        if self.save_interval is not None and self.save is None:
            raise ValueError("--save-interval needs --save (the directory to write checkpoints to)")
        if isinstance(self.lr_warmup_iters, bool) or not isinstance(self.lr_warmup_iters, int) \
                or self.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be an integer >= 0, got {self.lr_warmup_iters!r}")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be >= 1, got {self.ddp_bucket_size}")
        for name in ("lr", "min_lr", "lr_warmup_init", "weight_decay", "clip_grad",
                     "distributed_timeout_minutes"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{_flag(name)} must be a finite number >= 0, got {value!r}")
        if self.lr == 0 or self.distributed_timeout_minutes == 0:
            name = "--lr" if self.lr == 0 else "--distributed-timeout-minutes"
            raise ValueError(f"{name} must be > 0")
        if self.min_lr > self.lr or self.lr_warmup_init > self.lr:
            name = "--min-lr" if self.min_lr > self.lr else "--lr-warmup-init"
            raise ValueError(f"{name} must be <= --lr ({self.lr})")
        if self.lr_decay_style != "constant" and self.resolved_lr_decay_iters <= self.lr_warmup_iters:
            raise ValueError(
                f"--lr-decay-iters ({self.resolved_lr_decay_iters}, default --train-iters) must "
                f"exceed --lr-warmup-iters ({self.lr_warmup_iters}) for --lr-decay-style "
                f"{self.lr_decay_style}"
            )
        pp = self.pipeline_model_parallel_size
        if self.world_size % pp:
            raise ValueError(
                f"--pipeline-model-parallel-size={pp} must divide the number of processes "
                f"(world size {self.world_size})"
            )
        if self.num_layers % pp:
            raise ValueError(
                f"--num-layers={self.num_layers} must be divisible by "
                f"--pipeline-model-parallel-size={pp}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--num-attention-heads={self.num_attention_heads} must divide "
                f"--hidden-size={self.hidden_size}"
            )
        per_step = self.micro_batch_size * self.data_parallel_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size={self.global_batch_size} must be divisible by "
                f"--micro-batch-size={self.micro_batch_size} x data-parallel size "
                f"{self.data_parallel_size} (world size / --pipeline-model-parallel-size) "
                f"= {per_step}"
            )
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are mutually exclusive")
        if self.overlap_param_gather and not (
            self.use_distributed_optimizer and self.overlap_grad_reduce
        ):
            raise ValueError(
                "--overlap-param-gather requires --use-distributed-optimizer and "
                "--overlap-grad-reduce (params are all-gathered from optimizer shards)"
            )
        if self.ddp_reduce_scatter_with_fp32_accumulation and not self.use_distributed_optimizer:
            raise ValueError(
                "--ddp-reduce-scatter-with-fp32-accumulation requires "
                "--use-distributed-optimizer (without it gradients are all-reduced)"
            )

    @property
    def resolved_lr_decay_iters(self) -> int:
        """``--lr-decay-iters``, or ``--train-iters`` when not given (Megatron's default)."""
        return self.train_iters if self.lr_decay_iters is None else self.lr_decay_iters

    @property
    def data_parallel_size(self) -> int:
        """DP = world size / PP."""
        return self.world_size // self.pipeline_model_parallel_size

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on each replica: global / (micro x DP)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def params_dtype(self) -> torch.dtype:
        """bf16, fp16 or (default) fp32."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @property
    def tie_embeddings(self) -> bool:
        """The output layer reuses the embedding weight (unless untied by flag)."""
        return not self.untie_embeddings_and_output_weights


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (flag names as Megatron-LM's ``pretrain_gpt.py``)."""
    parser = argparse.ArgumentParser(
        prog="train_gpt.py",
        description="Train a small character-level GPT on the source of Python's argparse "
        "with fastgrad's DDP and 1F1B pipeline. Launch with "
        "`torchrun --nproc-per-node N examples/train_gpt.py [flags]`; DP = N / PP.",
    )
    defaults = TrainArgs(world_size=1)
    par = parser.add_argument_group("parallelism")
    par.add_argument("--pipeline-model-parallel-size", type=int,
                     default=defaults.pipeline_model_parallel_size,
                     help="pipeline stages PP (1F1B schedule when > 1)")
    par.add_argument("--distributed-timeout-minutes", type=float,
                     default=defaults.distributed_timeout_minutes,
                     help="deadline of every collective and point-to-point wait")
    model = parser.add_argument_group("model")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        model.add_argument(_flag(name), type=int, default=getattr(defaults, name))
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="give the output layer its own weight (default: tied to the embedding)")
    train = parser.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=defaults.micro_batch_size)
    train.add_argument("--global-batch-size", type=int, default=defaults.global_batch_size,
                       help="sequences per optimizer step over all replicas")
    train.add_argument("--train-iters", type=int, default=defaults.train_iters)
    train.add_argument("--lr", type=float, default=defaults.lr,
                       help="AdamW's (peak) learning rate")
    train.add_argument("--min-lr", type=float, default=defaults.min_lr,
                       help="the learning rate after --lr-decay-iters")
    train.add_argument("--lr-decay-style", choices=DECAY_STYLES, default=defaults.lr_decay_style,
                       help="after the warmup: constant (default here; Megatron's is linear), "
                       "linear or cosine decay to --min-lr")
    train.add_argument("--lr-decay-iters", type=int, default=None,
                       help="iterations over which the learning rate decays (default: --train-iters)")
    train.add_argument("--lr-warmup-iters", type=int, default=defaults.lr_warmup_iters,
                       help="linear warmup from --lr-warmup-init to --lr over this many iterations")
    train.add_argument("--lr-warmup-init", type=float, default=defaults.lr_warmup_init,
                       help="the learning rate of the first iteration of the warmup")
    train.add_argument("--weight-decay", type=float, default=defaults.weight_decay,
                       help="decoupled weight decay (not on biases and norms)")
    train.add_argument("--clip-grad", type=float, default=defaults.clip_grad,
                       help="clip the global gradient norm to this value; 0 turns clipping off")
    train.add_argument("--seed", type=int, default=defaults.seed,
                       help="initial weights and data order")
    train.add_argument("--log-interval", type=int, default=defaults.log_interval,
                       help="print the loss every this many iterations")
    ckpt = parser.add_argument_group("checkpointing (Megatron-LM's layout)")
    ckpt.add_argument("--save", default=None,
                      help="directory to write checkpoints to (at the end, and every --save-interval)")
    ckpt.add_argument("--save-interval", type=int, default=None,
                      help="write a checkpoint every this many iterations")
    ckpt.add_argument("--load", default=None,
                      help="resume from the latest checkpoint in this directory (none there: start "
                      "from scratch, so --save X --load X resumes automatically); any DP size")
    ckpt.add_argument("--ckpt-step", type=int, default=None,
                      help="load this iteration's checkpoint instead of the latest")
    precision = parser.add_argument_group("precision")
    precision.add_argument("--bf16", action="store_true", help="bf16 params and activations")
    precision.add_argument("--fp16", action="store_true",
                           help="fp16 params and activations (dynamic loss scaling with "
                           "either optimizer)")
    precision.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                           help="main_grad buffers in fp32 whatever the param dtype")
    ddp = parser.add_argument_group("data parallelism (fastgrad.ddp)")
    ddp.add_argument("--use-distributed-optimizer", action="store_true",
                     help="shard optimizer state; buckets are reduce-scattered")
    ddp.add_argument("--overlap-grad-reduce", action="store_true",
                     help="launch each bucket's reduction as soon as its grads are ready")
    ddp.add_argument("--overlap-param-gather", action="store_true",
                     help="overlap the param all-gather with the next forward")
    ddp.add_argument("--ddp-bucket-size", type=int, default=None,
                     help="elements per bucket (with --overlap-grad-reduce)")
    ddp.add_argument("--ddp-reduce-scatter-with-fp32-accumulation", action="store_true",
                     help="reduce-scatter 16-bit grads with fp32 accumulation")
    return parser


def parse_args(argv: Sequence[str] | None, world_size: int, *, report: bool = True) -> TrainArgs:
    """Parse and validate; a bad value or combination exits with status 2 and the rule.

    ``report=False`` exits silently (the other ranks of a launch, so that the
    message is printed once, by rank 0).
    """
    parser = build_parser()
    with contextlib.redirect_stderr(sys.stderr if report else io.StringIO()):
        namespace = parser.parse_args(argv)
        try:
            return TrainArgs(world_size=world_size, **vars(namespace))
        except ValueError as error:
            parser.error(str(error))
            raise  # unreachable: parser.error exits

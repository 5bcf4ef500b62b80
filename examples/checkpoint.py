"""``--save`` / ``--load`` of ``examples/train_gpt.py``, in Megatron-LM's directory layout.

Megatron-LM (megatron/training/checkpointing.py) writes
``<save>/iter_<7 digits>/mp_rank_<tp 2 digits>[_<pp 3 digits>]/model_optim_rng.pt`` and
records the last complete one in ``<save>/latest_checkpointed_iteration.txt``; ``--load``
reads that file (or takes ``--ckpt-step``) and resumes after that iteration (no file: a
warning, and training starts from scratch, so ``--save X --load X`` resumes automatically).

One file per pipeline stage, written by the stage's first data-parallel rank: the model's
state dict (full, unpadded) and the optimizer's (``DistributedOptimizer.state_dict()``:
full fp32 masters and moments gathered over DP, torch's shape), so a checkpoint written
at one data-parallel size loads at any other. The learning-rate scheduler's state and the
flags that fix the model's shape go with them; the data need no state (every iteration's
global batch is drawn from ``--seed`` and the iteration number).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from examples.arguments import TrainArgs
from fastgrad.pipeline import ParallelGroups

TRACKER = "latest_checkpointed_iteration.txt"
# Flags a checkpoint fixes: loading it under other values is refused, naming the flag.
# The data-parallel size, the optimizer kind (its state_dict is the same full, torch-shaped
# one either way) and the precision may change.
SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
               "pipeline_model_parallel_size", "untie_embeddings_and_output_weights")


def checkpoint_file(root: Path, iteration: int, groups: ParallelGroups) -> Path:
    """Megatron's path of this stage's file (TP is 1 here)."""
    rank_dir = "mp_rank_00" if groups.pp_size == 1 else f"mp_rank_00_{groups.stage:03d}"
    return root / f"iter_{iteration:07d}" / rank_dir / "model_optim_rng.pt"


def save_checkpoint(root: Path, iteration: int, args: TrainArgs, groups: ParallelGroups,
                    model: nn.Module, optimizer: Any, scheduler: Any) -> Path:
    """Every rank calls it (the optimizer's state dict is a collective over DP)."""
    state = {
        "iteration": iteration,
        "args": asdict(args),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "opt_param_scheduler": scheduler.state_dict(),
    }
    path = checkpoint_file(root, iteration, groups)
    if groups.dp_rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, path)  # never a half-written checkpoint under the final name
    dist.barrier()
    if dist.get_rank() == 0:
        tracker = root / TRACKER
        tracker.with_suffix(".partial").write_text(f"{iteration}\n")
        os.replace(tracker.with_suffix(".partial"), tracker)
    dist.barrier()
    return path


def latest_iteration(root: Path) -> int | None:
    """The iteration in ``root``'s tracker file, or None when there is none."""
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration number")
    return int(text)


def load_checkpoint(root: Path, args: TrainArgs, groups: ParallelGroups, model: nn.Module,
                    optimizer: Any, scheduler: Any) -> int | None:
    """Load the latest checkpoint under ``root`` (or ``--ckpt-step``'s) into the model,
    optimizer and scheduler; return its iteration (None: no checkpoint there)."""
    iteration = args.ckpt_step if args.ckpt_step is not None else latest_iteration(root)
    if iteration is None:
        return None
    path = checkpoint_file(root, iteration, groups)
    if not path.is_file():
        source = "--ckpt-step" if args.ckpt_step is not None else TRACKER
        raise ValueError(f"--load {root}: {source} names iteration {iteration} but {path} is missing")
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved = state["args"]
    for name in SHAPE_FLAGS:
        if saved[name] != getattr(args, name):
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"--load {root}: the checkpoint was written with {flag}={saved[name]!r}, this run "
                f"has {getattr(args, name)!r} (the model or optimizer would not match)"
            )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])  # re-publishes the params from the masters
    scheduler.load_state_dict(state["opt_param_scheduler"])
    return int(state["iteration"])

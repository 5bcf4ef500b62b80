"""fastgrad's toy MXFP8 training: the ``mxfp8`` technique's param all-gather run
(:meth:`verify.candidates.fastgrad.mxfp8.FastgradMXFP8.train_with_param_gather`), and what
``verify.fixtures.mxfp8`` gives fastgrad's tests and the bench.

* :func:`train_toy_rank` — a small MXFP8 MLP (weights of the given ``shapes``) trained with
  fastgrad's distributed optimizer on one gloo rank, sharing on or off, returning
  per-iteration bits.
* :func:`toy_config` — the ``gradvocab.DDPConfig`` of that run.
"""

from __future__ import annotations

from typing import Any

import torch

from fastgrad.mxfp8_sharing import MXFP8Parameter, MXFP8ParamGradBuffer
from fastgrad.optim import DistributedOptimizer
from gradvocab import AdamWConfig, DDPConfig, SGDConfig


def toy_config(*, sharing: bool, grad_fp32: bool, bucket_size: int) -> DDPConfig:
    """The production configuration for MXFP8 params, sharing on or off."""
    return DDPConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        fp8_param_gather=True,
        reuse_grad_buf_for_mxfp8_param_ag=sharing,
        grad_reduce_in_fp32=grad_fp32,
        bucket_size=bucket_size,
    )


def toy_optimizer_config(kind: str) -> AdamWConfig | SGDConfig:
    """The toy run's optimizer: ``"adam"`` (AdamW, no weight decay) or ``"sgd"``, lr 1e-2."""
    if kind == "adam":
        return AdamWConfig(lr=1e-2)
    if kind == "sgd":
        return SGDConfig(lr=1e-2)
    raise ValueError(f"optimizer_kind must be 'adam' or 'sgd', got {kind!r}")


def train_toy_rank(
    rank: int,
    world_size: int,
    sharing: bool,
    grad_fp32: bool,
    iterations: int,
    optimizer_kind: str = "adam",
    scale_mode: str = "floor",
    seed: int = 0,
    microbatches: int = 2,
    *,
    shapes: tuple[tuple[int, int], ...],
    bucket_size: int,
    dp_group: Any = None,
) -> dict[str, Any]:
    """Train the toy MLP (weights ``shapes``) on this rank of ``dp_group`` (None: the default
    group); return per-iteration bits and the buffer's bytes.

    Weights are initialised identically on every rank; the data are rank-specific.
    """
    init = torch.Generator().manual_seed(seed)
    weights = [
        MXFP8Parameter(torch.randn(shape, generator=init) * 0.25, scale_mode=scale_mode)
        for shape in shapes
    ]
    config = toy_config(sharing=sharing, grad_fp32=grad_fp32, bucket_size=bucket_size)
    buffer = MXFP8ParamGradBuffer(weights, config=config, dp_group=dp_group)
    optimizer = DistributedOptimizer(buffer, toy_optimizer_config(optimizer_kind))
    optimizer.publish_params()  # the first forward uses the masters' rounding, as every later one
    snapshots = []
    for iteration in range(iterations):
        buffer.zero_grad()
        losses = []
        for micro in range(microbatches):
            data = torch.Generator().manual_seed(
                1_000_003 * seed + 10_007 * iteration + 101 * rank + micro
            )
            x = torch.randn(4, shapes[0][1], generator=data)
            target = torch.randn(4, shapes[-1][0], generator=data)
            leaves = [w.dequantize(torch.float32).requires_grad_(True) for w in weights]
            h = x
            for i, leaf in enumerate(leaves):
                h = h @ leaf.T
                if i < len(leaves) - 1:
                    h = torch.relu(h)
            loss = ((h - target) ** 2).mean()
            loss.backward()
            losses.append(loss.detach())
            for weight, leaf in reversed(list(zip(weights, leaves))):
                buffer.accumulate_grad(weight, leaf.grad)
        buffer.reduce_grads()
        snapshot = {
            "scale_bits": [w.scale_bits.clone() for w in weights],
            "element_bits": [w.element_bits.clone() for w in weights],
            "grads": buffer.grad_data.clone(),
            "local_grad_shards": [b.local_grad_shard.clone() for b in buffer.buckets],
            "masters_before": optimizer.master_shards(),
            "loss": torch.stack(losses),
        }
        result = optimizer.step()  # update, then stage -> gather -> quantize -> zero per bucket
        if not result.stepped:
            raise RuntimeError(f"toy training step skipped: {result.reason}")
        snapshot["masters_after"] = optimizer.master_shards()
        snapshots.append(snapshot)
    return {
        "snapshots": snapshots,
        "allocated_bytes": buffer.allocated_bytes(),
        "numel": buffer.numel,
        "sharing": buffer.sharing,
        "shard_ranges": [b.local_shard_range for b in buffer.buckets],
        "param_ranges": [buffer.param_range(w) for w in weights],
    }

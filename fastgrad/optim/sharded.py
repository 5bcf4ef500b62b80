"""Optimizers that work on a gradient buffer's reduced shards.

``ShardedOptimizer``: a distributed optimizer for the MXFP8 param-gather front
(``fastgrad.mxfp8_sharing.MXFP8ParamGradBuffer``): fp32 master shards per
bucket, SGD or Adam on this rank's reduced grad shard, staged back into the
buffer's param shards for the next all-gather.
"""

from __future__ import annotations

import math

import torch

from fastgrad.errors import LifecycleError
from fastgrad.mxfp8 import MXFP8Parameter
from fastgrad.mxfp8_sharing import MXFP8ParamGradBuffer


class ShardedOptimizer:
    """A distributed optimizer: fp32 master shards per bucket, SGD or Adam on the local shard."""

    KINDS = ("sgd", "adam")

    def __init__(
        self,
        buffer: MXFP8ParamGradBuffer,
        *,
        kind: str = "sgd",
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        if not (isinstance(lr, float) and 0 < lr < math.inf):
            raise ValueError(f"lr must be a positive finite float, got {lr!r}")
        if len(betas) != 2 or not all(isinstance(b, float) and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
        if not (isinstance(eps, float) and 0 < eps < math.inf):
            raise ValueError(f"eps must be a positive finite float, got {eps!r}")
        self.buffer = buffer
        self.kind = kind
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.step_count = 0
        self.master_shards: list[torch.Tensor] = []
        for bucket in buffer.buckets:
            lo, hi = bucket.local_shard_range
            master = torch.zeros(hi - lo, dtype=torch.float32, device=buffer.grad_data.device)
            for p in bucket.params:
                start, end = buffer.param_range(p)
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    values = p.dequantize(torch.float32) if isinstance(p, MXFP8Parameter) else p.float()
                    master[a - lo : b - lo] = values.reshape(-1)[a - start : b - start]
            self.master_shards.append(master)
        self.exp_avg = [torch.zeros_like(m) for m in self.master_shards]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master_shards]

    def step(self) -> None:
        """Update every master shard from the reduced local grad shard."""
        if not self.buffer.grads_reduced:
            raise LifecycleError(
                "optimizer step before reduce_grads: the grad shards are unreduced"
            )
        self.step_count += 1
        beta1, beta2 = self.betas
        for i, bucket in enumerate(self.buffer.buckets):
            grad = bucket.local_grad_shard.float()
            master = self.master_shards[i]
            if self.kind == "sgd":
                master.sub_(grad * self.lr)
                continue
            self.exp_avg[i].mul_(beta1).add_(grad * (1 - beta1))
            self.exp_avg_sq[i].mul_(beta2).add_(grad * grad * (1 - beta2))
            m_hat = self.exp_avg[i] / (1 - beta1**self.step_count)
            v_hat = self.exp_avg_sq[i] / (1 - beta2**self.step_count)
            master.sub_(self.lr * m_hat / (v_hat.sqrt() + self.eps))
        self.buffer.consume_grads()

    def stage(self) -> None:
        """Copy the master shards into the buffer's param shards."""
        self.buffer.stage_master_params(self.master_shards)

"""The pipeline model's forward: one stage's layers, and the output head whose weight gradient
is recorded rather than accumulated by autograd (production computes it as a GEMM of its own,
immediate or deferred to the pipeline flush, so the reference adds it where production does).
"""

from __future__ import annotations

import torch
from torch import nn

from refgrad.pipeline.embedding import VocabParallelFirstLayer
from refgrad.pipeline.spec import LinearStackSpec, layer_init


class StageModule(nn.Module):
    """One pipeline stage: ``spec.layers_on(stage)`` Linear layers, tanh between them (and after
    the last one except on the last stage); tied at TP > 1 the first stage's first layer is the
    vocab-parallel embedding (``refgrad.pipeline.embedding``)."""

    def __init__(self, spec: LinearStackSpec, stage: int) -> None:
        super().__init__()
        if not 0 <= stage < spec.num_stages:
            raise ValueError(f"stage must be in [0, {spec.num_stages}), got {stage}")
        self.final_activation = stage != spec.num_stages - 1
        self.layers = nn.ModuleList()
        for layer in range(spec.layers_on(stage)):
            weight, bias = layer_init(spec, stage, layer)
            if stage == 0 and layer == 0 and spec.vocab_parallel_embedding:
                self.layers.append(VocabParallelFirstLayer(spec, weight, bias))
                continue
            linear = nn.Linear(spec.hidden, spec.hidden)
            with torch.no_grad():
                linear.weight.copy_(weight)
                linear.bias.copy_(bias)
            self.layers.append(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._after_first_layer(self.layers[0](x))

    def after_embedding(self, embedded: torch.Tensor) -> torch.Tensor:
        """The stage given its vocab-parallel first layer's TP-summed product (the rows this
        sequence shard keeps): the first bias, then the rest of the stage."""
        return self._after_first_layer(embedded + self.layers[0].bias)

    def _after_first_layer(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, linear in enumerate(self.layers):
            if i > 0:
                x = linear(x)
            if i < last or self.final_activation:
                x = torch.tanh(x)
        return x


class HeadRecordingWgrad(torch.autograd.Function):
    """``x · Wᵀ``; backward returns the input gradient ``G · W`` and records ``(G, X)``."""

    @staticmethod
    def forward(ctx, x, weight, record):
        ctx.save_for_backward(x, weight)
        ctx.record = record
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        ctx.record.append((grad_output.detach(), x.detach()))
        return grad_output.matmul(weight), None, None

"""Reference for the tied, vocab-parallel first layer of the pipeline model at TP > 1.

With ``LinearStackSpec.tied_embedding`` and ``tensor_parallel = T > 1`` the
first stage's first layer is a vocab-parallel embedding, as Megatron-Core's
``VocabParallelEmbedding``: its weight ``W`` is ``[V, H]`` (the twin's
vocabulary ``V`` is its hidden size, as for the vocab-parallel output head)
and TP rank ``k`` holds rows ``k*V/T .. (k+1)*V/T`` (``W_k``, the same shape as
its output-head shard, to which it is tied). A microbatch ``x`` ``[R, V]``
plays the one-hot tokens: rank ``k`` computes its partial ``x_k · W_k`` with
``x_k`` the columns of its vocabulary block (all ``R`` rows), and production
sums the partials over TP (an all-reduce; under sequence parallelism a
reduce-scatter along the rows, each rank keeping its sequence shard). The
layer's bias, replicated, is added after that sum. Backward: rank ``k``'s wgrad
is ``x_kᵀ · G`` with ``G`` the whole ``[R, H]`` output grad (under SP the
all-gather of the shards' grads); the raw input needs no grad.

This module computes each partial as its own GEMM of the rank's shapes, sums
them in TP-rank order (one fp32 add at ``T = 2``, correctly rounded in either
order: production must match bitwise), and forms each rank's wgrad as its own
GEMM; the ``[V, H]`` grad is the row blocks of every TP rank.
"""

from __future__ import annotations

import torch
from torch import nn

from refgrad.pipeline.spec import LinearStackSpec


def vocab_block(spec: LinearStackSpec, x: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s vocabulary columns of a raw microbatch ``[R, V]`` (all rows)."""
    block = spec.hidden // spec.tensor_parallel
    return x[:, tp_rank * block:(tp_rank + 1) * block].contiguous()


class _VocabParallelEmbed(torch.autograd.Function):
    """``sum_k x_k · W_k`` in TP-rank order; backward: the row blocks ``x_kᵀ · G``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, tp: int) -> torch.Tensor:
        block = weight.shape[0] // tp
        blocks = [x[:, k * block:(k + 1) * block].contiguous() for k in range(tp)]
        ctx.blocks = blocks
        # Each rank's shard is its own tensor there: a contiguous copy of the same shape here.
        shards = [weight.detach()[k * block:(k + 1) * block].clone() for k in range(tp)]
        total = torch.mm(blocks[0], shards[0])
        for k in range(1, tp):
            total = total + torch.mm(blocks[k], shards[k])  # the TP all-reduce
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad = grad_output.contiguous()
        wgrad = torch.cat([xk.t().mm(grad) for xk in ctx.blocks])
        return None, wgrad, None


class VocabParallelFirstLayer(nn.Module):
    """The first stage's first layer when tied at TP > 1: ``embed(x) + bias`` (see the module
    doc), ``weight`` ``[V, H]`` initialised as the first Linear's weight (the head's, tied)."""

    def __init__(self, spec: LinearStackSpec, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.tp = spec.tensor_parallel
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(bias.clone())

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The TP-summed partial products (without the bias), every row."""
        return _VocabParallelEmbed.apply(x, self.weight, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x) + self.bias

"""Vocab-parallel embedding: the first stage's word embedding split over TP by vocabulary rows.

As Megatron-Core's ``VocabParallelEmbedding``: TP rank ``k`` holds rows
``k*V/T .. (k+1)*V/T`` of the ``[V, H]`` weight, the same shard shape as its
vocab-parallel output layer (``fastgrad.deferred_wgrad.ColumnParallelOutputLayer``),
so with tied embeddings the embedding group pairs the first and last stage of
the same TP rank and each sums two tensors of one shape.

The input is dense: ``x_k`` ``[R, V/T]``, the columns of this rank's vocabulary
block for every row (one-hot tokens masked to the rank's range, as production's
lookup, are one such input). Forward: the partial ``x_k · W_k``, summed over
the TP group (all-reduce), or with ``sequence_parallel`` reduce-scattered along
the rows, each rank keeping its sequence shard (Megatron's
``reduce_scatter_embeddings``). Backward: the output grad all-gathered along
the rows under SP, then ``x_kᵀ · G`` as the weight gradient; the input gets no
gradient (token ids have none).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fastgrad.comm import all_gather_into, reduce_scatter_into
from gradvocab import ParallelDims


class _VocabParallelEmbed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_block: torch.Tensor, weight: torch.Tensor, layer: VocabParallelEmbedding):
        ctx.layer = layer
        ctx.save_for_backward(x_block)
        partial = torch.mm(x_block, weight)
        if layer.tp_size == 1:
            return partial
        if layer.sequence_parallel:
            rows = partial.shape[0]
            if rows % layer.tp_size:
                raise ValueError(f"VocabParallelEmbedding: {rows} rows do not split over the TP "
                                 f"size {layer.tp_size} (sequence_parallel)")
            out = torch.empty((rows // layer.tp_size, partial.shape[1]), dtype=partial.dtype,
                              device=partial.device)
            reduce_scatter_into(out, partial, group=layer.tp_group)
            return out
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=layer.tp_group)
        return partial

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        layer: VocabParallelEmbedding = ctx.layer
        (x_block,) = ctx.saved_tensors
        grad = grad_output.contiguous()
        if layer.tp_size > 1 and layer.sequence_parallel:
            full = torch.empty((grad.shape[0] * layer.tp_size, grad.shape[1]), dtype=grad.dtype,
                               device=grad.device)
            all_gather_into(full, grad, group=layer.tp_group)
            grad = full
        return None, x_block.t().mm(grad), None


class VocabParallelEmbedding(nn.Module):
    """This TP rank's rows of a ``[V, H]`` embedding (``weight``: its ``[V/T, H]`` shard).

    ``forward(x_block)`` takes ``[R, V/T]`` (this rank's vocabulary columns, every row) and
    returns the TP-summed ``[R, H]`` embedding, or this rank's ``[R/T, H]`` rows of it with
    sequence parallelism. ``parallel_dims``: the TP size and sequence parallelism, with this
    rank's TP group at TP > 1 (default: one rank)."""

    def __init__(self, weight: torch.Tensor, *, parallel_dims: ParallelDims | None = None) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"VocabParallelEmbedding weight must be 2-D [V/TP, H], got shape "
                             f"{tuple(weight.shape)}")
        parallel_dims = ParallelDims() if parallel_dims is None else parallel_dims
        if not isinstance(parallel_dims, ParallelDims):
            raise TypeError(f"parallel_dims must be a ParallelDims, got {type(parallel_dims).__name__}")
        self.weight = nn.Parameter(weight.detach().clone())
        self.tp_size = parallel_dims.tp_size
        self.tp_group = parallel_dims.tp_group if self.tp_size > 1 else None
        self.sequence_parallel = parallel_dims.sequence_parallel

    def forward(self, x_block: torch.Tensor) -> torch.Tensor:
        if x_block.dim() != 2 or x_block.shape[1] != self.weight.shape[0]:
            raise ValueError(f"VocabParallelEmbedding input must be [rows, {self.weight.shape[0]}] "
                             f"(this rank's vocabulary columns), got {tuple(x_block.shape)}")
        return _VocabParallelEmbed.apply(x_block, self.weight, self)

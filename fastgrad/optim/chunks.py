"""Several DDP-wrapped model chunks as one target of the distributed optimizer.

With interleaved pipeline parallelism (VPP > 1) a rank holds several model
chunks, each with its own DDP engine and buffer. Megatron-Core builds one
optimizer over all of them (``get_megatron_optimizer(model_chunks=...)``): one
global grad norm, one clip coefficient, one found-inf flag, one step count.
:class:`ModelChunks` presents the chunks the way ``DistributedOptimizer``
reads a single ``DistributedDataParallel``: their buckets in chunk order,
their modules (for the overlapped param all-gather's forward pre-hooks), and
names prefixed ``chunk<i>.``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastgrad.ddp import DistributedDataParallel


class _ChunkBuffers:
    """The chunks' buffers read as one: buckets and groups in chunk order, one DP mesh."""

    def __init__(self, buffers: Sequence[Any]) -> None:
        self._buffers = list(buffers)
        self.buckets = [b for buf in self._buffers for b in buf.buckets]
        self.groups = [g for buf in self._buffers for g in buf.groups]

    @property
    def distributed(self) -> bool:
        return self._buffers[0].distributed

    @property
    def dp_group(self) -> Any:
        return self._buffers[0].dp_group

    @property
    def sharing(self) -> bool:
        """Whether any chunk's params share memory with its grads (the MXFP8 front)."""
        return any(b.sharing for b in self._buffers)

    def group_of(self, param: torch.Tensor) -> Any:
        """The buffer group holding ``param`` in whichever chunk owns it."""
        for buffer in self._buffers:
            try:
                return buffer.group_of(param)
            except ValueError:
                continue
        raise ValueError("param is not in any chunk's buffer")


def _dp_ranks(buffer: Any) -> tuple[int, ...]:
    """The data-parallel group's global ranks, in group order (without torch.distributed:
    the buffer's size and this rank, all there is to compare)."""
    if not buffer.distributed:
        return (buffer.dp_size, buffer.dp_rank)
    group = buffer.dp_group if buffer.dp_group is not None else dist.group.WORLD
    return tuple(dist.get_process_group_ranks(group))


class ModelChunks:
    """``chunks``: the DDP engines of this rank's model chunks, in chunk order.

    They must agree on the optimizer-relevant DDP settings
    (``use_distributed_optimizer``, ``overlap_param_gather``) and on the
    data-parallel group (the same ranks in the same order).
    """

    def __init__(self, chunks: Sequence[DistributedDataParallel]) -> None:
        chunks = list(chunks)
        if not chunks:
            raise ValueError("chunks must hold at least one DistributedDataParallel")
        for i, chunk in enumerate(chunks):
            if not isinstance(chunk, DistributedDataParallel):
                raise TypeError(f"chunks[{i}] must be a fastgrad DistributedDataParallel, "
                                f"got {type(chunk).__name__}")
        seen: dict[int, int] = {}
        for i, chunk in enumerate(chunks):
            if id(chunk) in seen:
                raise ValueError(f"chunks[{i}] is chunks[{seen[id(chunk)]}] again: each model "
                                 "chunk's DistributedDataParallel must be given once")
            seen[id(chunk)] = i
        first = chunks[0]
        for i, chunk in enumerate(chunks[1:], start=1):
            for setting in ("use_distributed_optimizer", "overlap_param_gather"):
                if getattr(chunk.config, setting) != getattr(first.config, setting):
                    raise ValueError(f"chunks[{i}].config.{setting} differs from chunks[0]'s: "
                                     "one optimizer needs one setting")
            if _dp_ranks(chunk.buffer) != _dp_ranks(first.buffer):
                raise ValueError(f"chunks[{i}] has another data-parallel group than chunks[0] "
                                 f"(ranks {_dp_ranks(chunk.buffer)} vs {_dp_ranks(first.buffer)})")
        self.chunks = chunks
        self.config = first.config
        self.buffer = _ChunkBuffers([c.buffer for c in chunks])
        self.module = nn.ModuleList([c.module for c in chunks])

    def name_of(self, param: nn.Parameter) -> str:
        """``chunk<i>.<name in that chunk>``."""
        for i, chunk in enumerate(self.chunks):
            name = chunk.name_of(param)
            if name != "<unnamed>":
                return f"chunk{i}.{name}"
        return "<unnamed>"

    def finish_grad_sync(self) -> None:
        """Wait for every chunk's grad reductions."""
        for chunk in self.chunks:
            chunk.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        """Zero every chunk's grad buffer (the optimizer's ``zero_grad()``)."""
        for chunk in self.chunks:
            chunk.zero_grad_buffer()

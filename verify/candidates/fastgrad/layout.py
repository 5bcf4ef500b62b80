"""fastgrad's bucket layout and padded grad buffer behind :mod:`verify.candidates.interfaces`.

``fastgrad.layout.compute_layout`` lays out each case; ``fastgrad.buffer.ParamAndGradBuffer``
is the buffer, its groups' ``fastgrad.layout.BufferLayout`` read back as refgrad's
``Layout`` record. fastgrad's buckets already have the :class:`GradBucket` shape, so
they are handed over as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from fastgrad.buffer import ParamAndGradBuffer
from fastgrad.buffer_group import BufferGroup
from fastgrad.layout import BufferLayout, compute_layout
from gradvocab import Averaging, DDPConfig
from verify.candidates.interfaces import (
    BucketLayout,
    GradBucket,
    GradBuffer,
    GradBufferGroup,
    GradPiece,
    Layout,
    LayoutCase,
)


def as_refgrad_layout(layout: BufferLayout) -> Layout:
    """fastgrad's array-backed layout as refgrad's record (the same numbers, as tuples)."""
    return Layout(
        param_index_map=layout.param_index_map,
        bucket_indices=layout.bucket_indices,
        per_bucket_numel_unpadded=layout.per_bucket_numel_unpadded,
        numel=layout.numel,
        numel_unpadded=layout.numel_unpadded,
        dp_size=layout.dp_size,
    )


@dataclass(frozen=True)
class FastgradBufferGroup(GradBufferGroup):
    """One ``fastgrad.buffer_group.BufferGroup`` seen through the interface."""

    group: BufferGroup

    @property
    def param_dtype(self) -> torch.dtype:
        return self.group.param_dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.group.grad_dtype

    @property
    def params(self) -> Sequence[torch.nn.Parameter]:
        return self.group.params

    @property
    def grad_data(self) -> torch.Tensor:
        return self.group.grad_data

    @property
    def param_data(self) -> torch.Tensor | None:
        return self.group.param_data

    @property
    def buckets(self) -> Sequence[GradBucket]:
        return self.group.buckets

    def layout(self) -> Layout:
        return as_refgrad_layout(self.group.layout)


@dataclass(frozen=True)
class FastgradGradBuffer(GradBuffer):
    """A ``fastgrad.buffer.ParamAndGradBuffer`` seen through the interface."""

    buffer: ParamAndGradBuffer

    @property
    def groups(self) -> Sequence[GradBufferGroup]:
        return [FastgradBufferGroup(g) for g in self.buffer.groups]

    @property
    def buckets(self) -> Sequence[GradBucket]:
        return self.buffer.buckets

    def zero_grad(self) -> None:
        self.buffer.zero_grad()

    def padding_is_zero(self) -> bool:
        return self.buffer.padding_is_zero()

    def grad_norm_sq(self) -> torch.Tensor:
        return self.buffer.grad_norm_sq()

    def local_shard_grad_norm_sq(self, rank: int) -> torch.Tensor:
        return self.buffer.local_shard_grad_norm_sq(rank)

    def checkpoint_grads(self) -> dict[int, torch.Tensor]:
        return {i: state["main_grad"] for i, state in self.buffer.checkpoint_state().items()}

    def shard_checkpoint_grads(self, rank: int) -> dict[int, list[GradPiece]]:
        return {
            i: [GradPiece(tuple(piece["param_offset"]), piece["main_grad"]) for piece in pieces]
            for i, pieces in self.buffer.shard_checkpoint_state(rank).items()
        }


@dataclass(frozen=True)
class FastgradLayout(BucketLayout):
    """fastgrad's layout function and buffer class (a test's broken variant overrides
    :meth:`layouts` or ``buffer_cls`` in a subclass)."""

    buffer_cls: ClassVar[type[ParamAndGradBuffer]] = ParamAndGradBuffer

    def layouts(self, cases: Sequence[LayoutCase]) -> list[Layout]:
        return [as_refgrad_layout(compute_layout(list(c.numels), **c.refgrad_kwargs()))
                for c in cases]

    def build_buffer(self, params: Sequence[torch.nn.Parameter], config: DDPConfig, *,
                     dp_size: int, dp_group: dist.ProcessGroup | None = None,
                     averaging: Averaging = Averaging.SUM) -> GradBuffer:
        # fastgrad's buffer holds averaging to config (DDPConfig.resolve_averaging) and
        # decides where a 1/dp pre-scale is applied (fastgrad.averaging)
        buffer = self.buffer_cls(
            list(params), config=config, dp_group=dp_group,
            dp_size=dp_size, averaging=averaging)
        return FastgradGradBuffer(buffer)

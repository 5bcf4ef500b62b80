"""A part of the optimizer interface (:mod:`verify.candidates.api.optimizer`) in a module of its
own: a training run over MXFP8 params (:class:`MXFP8Training`, built by
``MXFP8ParamOptimizer``), what the ``optim`` check asks a candidate for beside the training
loop; a candidate without it raises :class:`~verify.candidates.api.core.Unsupported` from the
accessor.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class MXFP8Training(Protocol):
    """MXFP8 params in a buffer with their fp32 master shards under the distributed optimizer,
    on one rank. The caller feeds grads (MXFP8 params are not autograd leaves)."""

    @property
    def sharing(self) -> bool:
        """Whether the param all-gather and the grad buffer share bytes."""
        ...

    @property
    def param_ranges(self) -> list[tuple[int, int]]:
        """Each param's ``(start, end)`` in the flat buffer (buffer order)."""
        ...

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Each bucket's ``(start, end)`` in the flat buffer."""
        ...

    def initial(self) -> list[torch.Tensor]:
        """The params as built, dequantized to fp32 (what the masters start from)."""
        ...

    def bits(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each param's MXFP8 scale bits and element bits (uint8), as the forward reads them."""
        ...

    def zero_grad(self) -> None: ...

    def accumulate_grad(self, index: int, grad: torch.Tensor) -> None:
        """Add ``grad`` (the param's shape) into param ``index``'s grad."""
        ...

    def reduce_grads(self) -> None:
        """Reduce-scatter every bucket's grads over the DP group."""
        ...

    def local_grad_shards(self) -> list[torch.Tensor]:
        """This rank's reduced grad shard of each bucket (copies)."""
        ...

    def step(self) -> bool:
        """One optimizer step (stage, all-gather and quantize the masters); whether it stepped."""
        ...

    def master_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 master shard of each bucket."""
        ...

    def named_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each param's state by ``params[<index>]``: ``exp_avg``/``exp_avg_sq`` or
        ``momentum_buffer`` (whole)."""
        ...


__all__ = ["MXFP8Training"]

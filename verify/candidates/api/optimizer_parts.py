"""Two parts of the optimizer interface (:mod:`verify.candidates.api.optimizer`) in a module of
their own: the misuses a candidate's optimizer refuses (:class:`OptimizerGuards`) and a training
run over MXFP8 params (:class:`MXFP8Training`, built by ``MXFP8ParamOptimizer``). Both are what
the ``optim`` check asks a candidate for beside the training loop; a candidate without them
raises :class:`~verify.candidates.api.core.Unsupported` from the accessor.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist


@runtime_checkable
class OptimizerGuards(Protocol):
    """Misuses the candidate's optimizer refuses with an error naming the rule. Each method
    makes one on objects of its own (DP 1 unless a group is given) and returns what was raised,
    as ``"<ExceptionType>: <message>"`` (None: the misuse was accepted). The phrases the
    ``optim`` check looks for are part of the contract (each method says which)."""

    def mixed_buffer_param_group(self) -> str | None:
        """A param group holding params of two grad buffers (bf16 and fp32 params):
        ``ValueError`` naming ``mixes buffers``."""
        ...

    def non_positive_max_grad_norm(self, value: float) -> str | None:
        """An optimizer built with ``max_grad_norm=value`` (0 or less): ``ValueError`` naming
        ``max_grad_norm must be finite and > 0``."""
        ...

    def step_before_grad_sync(self) -> str | None:
        """A step before any grad sync finished: ``LifecycleError`` naming ``before the grad sync``."""
        ...

    def checkpoint_with_renamed_param(self) -> str | None:
        """A checkpoint whose param names do not match the model's: ``ValueError`` naming
        ``names do not match``."""
        ...

    def checkpoint_with_reshaped_param(self) -> str | None:
        """A checkpoint holding a param of another shape: ``ValueError`` naming ``has shape``."""
        ...

    def param_modified_during_gather(self, dp_group: dist.ProcessGroup | None) -> str | None:
        """With ``overlap_param_gather``: a param written between its all-gather's launch and
        the wait (the next forward): ``LifecycleError`` naming ``modified between the launch``.
        Collective over ``dp_group``; leaves nothing in flight."""
        ...


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


__all__ = ["MXFP8Training", "OptimizerGuards"]

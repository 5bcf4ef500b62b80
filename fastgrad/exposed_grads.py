"""What ``param.grad`` holds after ``DistributedDataParallel.finish_grad_sync()``.

fastgrad reduces gradients in ``param.main_grad`` (a view of the bucket's
buffer) and the grad hook leaves ``param.grad`` None, so a plain
``torch.optim`` optimizer on the wrapped parameters would skip every parameter
and silently do nothing. After a successful ``finish_grad_sync``:

* all-reduce (no distributed optimizer): every rank holds the whole reduced
  gradient, so ``param.grad`` is set to it -- ``param.main_grad`` itself (a
  view, no copy) when the dtypes match, else ``main_grad.to(param.dtype)``, a
  copy taken at that moment (later in-place edits of ``main_grad``, e.g. a
  tied-embedding all-reduce, do not reach it);
* distributed optimizer (reduce-scatter): only this rank's shard is reduced,
  so a full-tensor gradient would be silently wrong. ``param.grad`` is set to
  a :class:`ShardedGradPlaceholder`, a zero-memory tensor on which every
  operation raises a :class:`fastgrad.errors.LifecycleError` that says why:
  a plain optimizer fails at its first step instead of doing nothing.

``drop_exposed_grads`` (called by ``zero_grad_buffer``) resets them to None.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fastgrad.errors import LifecycleError

SHARDED_GRAD_MESSAGE = (
    "this parameter's gradient is reduced only in this rank's shard of the grad "
    "buffer (use_distributed_optimizer=True): a plain torch.optim optimizer would apply "
    "unreduced values. Step with a distributed optimizer that reads the reduced shards "
    "(Bucket.local_grad_shard / fastgrad.optim), or build DDP with "
    "use_distributed_optimizer=False to get reduced full gradients in param.grad"
)


class ShardedGradPlaceholder(torch.Tensor):
    """Stands in ``param.grad`` under the distributed optimizer; any use raises LifecycleError."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__repr__:
            return "ShardedGradPlaceholder()"
        raise LifecycleError(SHARDED_GRAD_MESSAGE)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Reached from C++ (e.g. autograd accumulating a new grad into this one).
        raise LifecycleError(
            "backward accumulated into the gradient placeholder left by finish_grad_sync; "
            "call zero_grad_buffer() (or optimizer.zero_grad()) before the next backward. "
            + SHARDED_GRAD_MESSAGE
        )


def sharded_grad_placeholder(param: torch.Tensor) -> ShardedGradPlaceholder:
    """A placeholder with ``param``'s shape, dtype and device and no memory of its own."""
    zero = torch.zeros((), dtype=param.dtype, device=param.device)
    return torch.Tensor._make_subclass(ShardedGradPlaceholder, zero.expand(param.shape))


def expose_reduced_grads(
    params: Iterable[torch.Tensor], *, sharded: bool
) -> dict[torch.Tensor, torch.Tensor]:
    """Set ``param.grad`` for every trainable param (see the module docstring); return them."""
    exposed: dict[torch.Tensor, torch.Tensor] = {}
    for p in params:
        if not p.requires_grad:
            continue
        if sharded:
            grad = sharded_grad_placeholder(p)
        elif p.main_grad.dtype == p.dtype:
            grad = p.main_grad
        else:
            grad = p.main_grad.to(p.dtype)
        p.grad = grad
        exposed[p] = grad
    return exposed


def drop_exposed_grads(exposed: dict[torch.Tensor, torch.Tensor]) -> None:
    """Reset ``param.grad`` to None where it still holds what was exposed; empty ``exposed``."""
    for p, grad in exposed.items():
        if p.grad is grad:
            p.grad = None
    exposed.clear()

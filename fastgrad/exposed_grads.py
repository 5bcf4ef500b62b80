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
  operation raises a :class:`gradvocab.LifecycleError` that says why:
  a plain optimizer fails at its first step instead of doing nothing.

Before ``finish_grad_sync`` (from the last microbatch's backward on) the grad
hook leaves an :class:`UnreducedGradPlaceholder` in ``param.grad``: a torch
optimizer stepping (or ``clip_grad_norm_`` reading) before the reduction fails
naming ``finish_grad_sync()`` instead of silently skipping every parameter.

``drop_exposed_grads`` (called by ``zero_grad_buffer``) resets them to None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from gradvocab import LifecycleError

ZERO_ADVICE = (
    "zero the grads before the next backward: ddp.zero_grad_buffer(), ddp.zero_grad(), "
    "or the fastgrad optimizer's zero_grad()"
)
SHARDED_GRAD_MESSAGE = (
    "this parameter's gradient is reduced only in this rank's shard of the grad "
    "buffer (use_distributed_optimizer=True): a plain torch.optim optimizer would apply "
    "unreduced values. Step with fastgrad.optim.DistributedOptimizer, which reads the reduced "
    "shards, or build DDP with use_distributed_optimizer=False to get reduced full gradients "
    "in param.grad"
)
UNREDUCED_GRAD_MESSAGE = (
    "this parameter's gradient is not reduced over the data-parallel ranks yet: call "
    "ddp.finish_grad_sync() after the last microbatch's backward and before reading "
    "param.grad (optimizer.step(), clip_grad_norm_)"
)


class _GradPlaceholder(torch.Tensor):
    """A zero-memory stand-in for ``param.grad``; any use raises LifecycleError (see subclasses)."""

    use_message = ""  # reading it (an optimizer's step, a norm)
    accumulate_message = ""  # autograd adding the next backward's grad into it

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__repr__:
            return f"{cls.__name__}()"
        raise LifecycleError(cls.use_message)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Reached from C++ (e.g. autograd accumulating a new grad into this one).
        raise LifecycleError(cls.accumulate_message)


class ShardedGradPlaceholder(_GradPlaceholder):
    """Stands in ``param.grad`` under the distributed optimizer after ``finish_grad_sync``."""

    use_message = SHARDED_GRAD_MESSAGE
    accumulate_message = (
        "backward accumulated into the gradient placeholder left by finish_grad_sync: the grad "
        f"buffer still holds the last step's reduced gradients; {ZERO_ADVICE}. " + SHARDED_GRAD_MESSAGE
    )


class UnreducedGradPlaceholder(_GradPlaceholder):
    """Stands in ``param.grad`` from the last microbatch's backward until ``finish_grad_sync``."""

    use_message = UNREDUCED_GRAD_MESSAGE
    accumulate_message = (
        "a second backward with grad sync enabled before finish_grad_sync: grad sync must be "
        "enabled only for the last microbatch's backward (run the others inside ddp.no_sync()), "
        "and ddp.finish_grad_sync() must end the step. " + UNREDUCED_GRAD_MESSAGE
    )


def grad_placeholder(kind: type[_GradPlaceholder], param: torch.Tensor) -> _GradPlaceholder:
    """A ``kind`` placeholder with ``param``'s shape, dtype and device and no memory of its own."""
    zero = torch.zeros((), dtype=param.dtype, device=param.device)
    return torch.Tensor._make_subclass(kind, zero.expand(param.shape))


def sharded_grad_placeholder(param: torch.Tensor) -> ShardedGradPlaceholder:
    """A placeholder with ``param``'s shape, dtype and device and no memory of its own."""
    return grad_placeholder(ShardedGradPlaceholder, param)


def expose_reduced_grads(
    params: Iterable[torch.Tensor], *, sharded: bool,
    placeholders: dict[torch.Tensor, ShardedGradPlaceholder] | None = None,
) -> dict[torch.Tensor, torch.Tensor]:
    """Set ``param.grad`` for every trainable param (see the module docstring); return them.

    ``placeholders``: a cache of each param's placeholder, reused step after step.
    """
    exposed: dict[torch.Tensor, torch.Tensor] = {}
    cache = {} if placeholders is None else placeholders
    for p in params:
        if not p.requires_grad:
            continue
        if sharded:
            grad = cache.get(p)
            if grad is None:
                grad = cache[p] = sharded_grad_placeholder(p)
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


def settle_unzeroed_grads(
    exposed: dict[torch.Tensor, torch.Tensor], first: torch.Tensor, buffer: Any,
    name_of: Callable[[torch.Tensor], str],
) -> None:
    """The first grad of a step arrived (``first``'s, already accumulated by autograd) and
    ``zero_grad_buffer()`` was not called since ``finish_grad_sync``: honour torch's habits or
    refuse, before anything is added to ``main_grad``.

    * every exposed ``param.grad`` was set to None (``torch.optim.Optimizer.zero_grad()``,
      ``module.zero_grad()``): zero the whole buffer now, as ``zero_grad_buffer`` would;
    * every exposed grad is ``main_grad`` itself and every other param's ``main_grad`` reads
      zero (``zero_grad(set_to_none=False)`` zeroed them in place): nothing to do (one read of
      the grad buffer, only on this path);
    * otherwise the new grads would be added to the last step's reduced ones: LifecycleError.
    """
    first_reset = first.grad is not exposed.get(first)
    others = [(p, g) for p, g in exposed.items() if p is not first]
    if first_reset and all(p.grad is None for p, _ in others):
        exposed.clear()
        buffer.zero_grad()
        return
    copies = [p for p, g in exposed.items() if p.grad is g and g is not p.main_grad]
    if copies:
        raise LifecycleError(
            f"backward accumulated into {name_of(copies[0])!r}'s param.grad, a cast copy of the "
            f"reduced main_grad left by finish_grad_sync; {ZERO_ADVICE}"
        )
    in_place = not first_reset and others and all(p.grad is g for p, g in others)
    if in_place and _zero_except(buffer, first):
        return
    raise LifecycleError(
        "backward after finish_grad_sync without zeroing the grads: the grad buffer still holds "
        f"the last step's reduced gradients (first seen at {name_of(first)!r}) and the new ones "
        f"would be added to them; {ZERO_ADVICE}"
    )


def _zero_except(buffer: Any, param: torch.Tensor) -> bool:
    """Whether every grad buffer element outside ``param``'s range is zero."""
    for group in buffer.groups:
        data = group.grad_data
        if group is buffer.group_of(param):
            lo, hi = group.param_range(param)
            if bool(data[:lo].any()) or bool(data[hi:].any()):
                return False
        elif bool(data.any()):
            return False
    return True


class ParamGrads:
    """What ``param.grad`` holds for one DDP wrapper, from its grad hooks to the next zeroing.

    ``expose`` (at ``finish_grad_sync``): the reduced grads (:func:`expose_reduced_grads`);
    ``unreduced(param)`` (the hook, last microbatch): the param's cached
    :class:`UnreducedGradPlaceholder`; ``drop`` (``zero_grad_buffer``): back to None;
    ``out``: grads were exposed and nothing zeroed the buffer since (``settle`` decides,
    at the next step's first grad, what the user's zeroing did).
    """

    def __init__(self) -> None:
        self._exposed: dict[torch.Tensor, torch.Tensor] = {}
        self._unreduced: dict[torch.Tensor, UnreducedGradPlaceholder] = {}
        self._sharded: dict[torch.Tensor, ShardedGradPlaceholder] = {}
        self.out = False

    def expose(self, params: Iterable[torch.Tensor], *, sharded: bool) -> None:
        self._exposed = expose_reduced_grads(params, sharded=sharded, placeholders=self._sharded)
        self.out = True

    def drop(self) -> None:
        drop_exposed_grads(self._exposed)
        self.out = False
        for param, placeholder in self._unreduced.items():
            if param.grad is placeholder:
                param.grad = None

    def settle(self, first: torch.Tensor, buffer: Any, name_of: Callable[[torch.Tensor], str]) -> None:
        settle_unzeroed_grads(self._exposed, first, buffer, name_of)
        self.out = False

    def take_exposed(self, param: torch.Tensor) -> torch.Tensor | None:
        """What ``finish_grad_sync`` exposed for ``param`` (forgotten from now on), or None."""
        if not self._exposed:  # the usual case (zeroed since): no per-grad hashing
            return None
        return self._exposed.pop(param, None)

    def unreduced(self, param: torch.Tensor) -> UnreducedGradPlaceholder:
        placeholder = self._unreduced.get(param)
        if placeholder is None:
            placeholder = grad_placeholder(UnreducedGradPlaceholder, param)
            self._unreduced[param] = placeholder
        return placeholder

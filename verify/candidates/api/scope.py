"""The lifetime of a technique's interface: checks use it inside ``with``.

A check enters the interface an accessor returned (``with candidate.layout() as layout:``)
and does everything with it inside the block: building objects, and the autograd backward
of what they returned, which runs outside any of the interface's methods. A candidate that
needs per-process setup for that (Megatron-Core on a CPU machine: its CUDA redirects, a
``TorchFunctionMode``) enters it in ``__enter__`` and undoes it in ``__exit__``; fastgrad
needs none (the defaults here).
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol, Self, runtime_checkable


@runtime_checkable
class TechniqueScope(Protocol):
    """``with`` this interface: the candidate's setup for it holds inside the block."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        return None

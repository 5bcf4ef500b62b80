"""The implementation the reduce_scatter check holds to refgrad."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastgrad.reduce_scatter import (
    reduce_scatter_with_fp32_accumulation,
    reduce_shards_fp32,
)


@dataclass(frozen=True)
class ReduceScatterCandidate:
    """The reduce-scatter under test: the collective and the local fp32 reduction it uses.

    ``reduce_scatter(output, input, *, group, op, async_op=False, scratch=None)`` is
    called on every rank (it must be a module-level function: it is pickled into the
    spawned ranks); ``local_reduction(shards [W, n], out, *, average)`` is called directly.
    """

    reduce_scatter: Callable = reduce_scatter_with_fp32_accumulation
    local_reduction: Callable = reduce_shards_fp32

    def __post_init__(self) -> None:
        for name in ("reduce_scatter", "local_reduction"):
            if not callable(getattr(self, name)):
                raise TypeError(f"ReduceScatterCandidate.{name} must be callable")

    @classmethod
    def default(cls) -> ReduceScatterCandidate:
        """fastgrad's ``reduce_scatter_with_fp32_accumulation`` and ``reduce_shards_fp32``."""
        return cls()

"""The implementation the deferred_wgrad check holds to its references."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastgrad.deferred_wgrad import (
    ColumnParallelOutputLayer,
    accumulate_wgrad_,
)


@dataclass(frozen=True)
class DeferredWgradCandidate:
    """The deferred-wgrad implementation under test: the layer class and the wgrad GEMM."""

    layer_cls: type = ColumnParallelOutputLayer
    accumulate: Callable = accumulate_wgrad_

    def __post_init__(self) -> None:
        if not isinstance(self.layer_cls, type):
            raise TypeError("DeferredWgradCandidate.layer_cls must be a class")
        if not callable(self.accumulate):
            raise TypeError("DeferredWgradCandidate.accumulate must be callable")

    @classmethod
    def default(cls) -> DeferredWgradCandidate:
        """fastgrad's ``ColumnParallelOutputLayer`` and ``accumulate_wgrad_``."""
        return cls()

"""Deliberately broken copies of the fastgrad candidate, to prove the checks can fail.

Test-only: the seam and the production candidate know nothing of them. Each :class:`Fault`
names the check that must catch it; :class:`FaultyFastgrad` applies it to the candidate's own
objects (a subclass on one instance, a wrong group on one rank) through the extension points
fastgrad's adapters already have (``FastgradPipeline.output_layer_class``, ``rank_grid``,
``microbatches``; ``FastgradDeferredWgrad.layer_cls``), never by changing a library class or
module. Module-level, so the spawned ranks can unpickle them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from fastgrad.deferred_wgrad import ColumnParallelOutputLayer
from gradvocab import ParallelDims
from verify.candidates.fastgrad import FastgradCandidate
from verify.candidates.fastgrad.deferred_wgrad import FastgradDeferredWgrad
from verify.candidates.fastgrad.pipeline import FastgradPipeline
from verify.candidates.interfaces import DeferredWgrad, PipelineCase, PipelineTraining


class Fault(str, enum.Enum):
    """A deliberate bug a broken candidate carries, to prove a check can fail.

    Each names the technique whose check must catch it; the candidate applies it to its own
    objects (a subclass on one instance, a wrong group on one rank), never by changing a
    library class or module.
    """

    # pipeline: each replica's microbatches fed in reverse
    REVERSED_MICROBATCHES = "reversed_microbatches"
    # deferred wgrad: the drain runs the deferred GEMMs newest first (another fp32 sum order)
    LIFO_DRAIN = "lifo_drain"
    # tied embedding at TP 2: all-reduced with the other TP rank's output-layer shard
    CROSSED_EMBEDDING_GROUP = "crossed_embedding_group"
    # tied at PP 1 (one weight): the first layer's grad added before the head's wgrad
    EMBEDDING_GRAD_FIRST = "embedding_grad_first"
    # tied at PP 1 (one weight): the head's wgrad never added
    DROPPED_HEAD_WGRAD = "dropped_head_wgrad"


class LifoDrainOutputLayer(ColumnParallelOutputLayer):
    """:attr:`Fault.LIFO_DRAIN`: the drain runs the deferred GEMMs newest first. Right pairs,
    another order of the fp32 adds."""

    def drain_deferred_wgrad(self, reduce_in_flight: Any = None) -> int:
        self.activation_buffer.reverse()
        self.grad_output_buffer.reverse()
        return super().drain_deferred_wgrad(reduce_in_flight)


class DroppedWgradOutputLayer(ColumnParallelOutputLayer):
    """:attr:`Fault.DROPPED_HEAD_WGRAD`: its wgrad never reaches ``main_grad``."""

    def _accumulate(self, grad_output: Any, total_input: Any, guard: Any) -> None:
        del grad_output, total_input, guard


class EmbeddingFirstOutputLayer(ColumnParallelOutputLayer):
    """:attr:`Fault.EMBEDDING_GRAD_FIRST`: each microbatch's wgrad is held back and added by a
    post-accumulate hook registered at the first forward, i.e. after DDP's, so after the first
    layer's grad."""

    def forward(self, local_input: Any) -> Any:
        if not hasattr(self, "_late_hook"):
            self._pending: list[tuple[Any, Any, Any]] = []
            self._late_hook = self.weight.register_post_accumulate_grad_hook(self._add_pending)
        return super().forward(local_input)

    def _accumulate(self, grad_output: Any, total_input: Any, guard: Any) -> None:
        self._pending.append((grad_output, total_input, guard))

    def _add_pending(self, param: Any) -> None:
        del param
        while self._pending:
            super()._accumulate(*self._pending.pop(0))


def output_layer_class(fault: Fault | None) -> type[ColumnParallelOutputLayer]:
    """fastgrad's output layer, or the subclass that carries ``fault``; the fault lives on
    the rank's instance only, never on the library class."""
    return {Fault.LIFO_DRAIN: LifoDrainOutputLayer,
            Fault.DROPPED_HEAD_WGRAD: DroppedWgradOutputLayer,
            Fault.EMBEDDING_GRAD_FIRST: EmbeddingFirstOutputLayer}.get(fault, ColumnParallelOutputLayer)


@dataclass(frozen=True)
class FaultyPipeline(FastgradPipeline):
    """fastgrad's pipeline training with ``fault``'s grid or microbatches (its output layer is
    the inherited ``output_layer_class`` field)."""

    fault: Fault | None = None

    def rank_grid(self, case: PipelineCase, grid: ParallelDims) -> ParallelDims:
        """With :attr:`Fault.CROSSED_EMBEDDING_GROUP` (TP 2, tied) the embedding group of the
        first stage's TP rank ``t`` is the last stage's TP rank ``1 - t`` (only the pair's two
        ranks create it): same shard shape, wrong rows. Every other case: ``grid`` unchanged."""
        if (self.fault is not Fault.CROSSED_EMBEDDING_GROUP or grid.pp_size == 1
                or grid.tp_size != 2 or not (grid.is_first_stage or grid.is_last_stage)):
            return super().rank_grid(case, grid)
        peer_stage = grid.pp_size - 1 if grid.is_first_stage else 0
        peer = grid.global_rank(peer_stage, grid.dp_rank, 1 - grid.tp_rank)
        ranks = tuple(sorted((grid.rank, peer)))
        group = dist.new_group(list(ranks), use_local_synchronization=True)
        return replace(grid, place=replace(grid.place, embedding_group=group, embedding_ranks=ranks))

    def microbatches(self, case: PipelineCase, grid: ParallelDims, step: int, m: int
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
        """The seam's data, fed in reverse under :attr:`Fault.REVERSED_MICROBATCHES`."""
        inputs, targets, loss_fn = super().microbatches(case, grid, step, m)
        if self.fault is Fault.REVERSED_MICROBATCHES:
            inputs, targets = inputs[::-1], targets[::-1]
        return inputs, targets, loss_fn


@dataclass(frozen=True)
class FaultyFastgrad(FastgradCandidate):
    """fastgrad with one deliberate :class:`Fault`; reports name it ``fastgrad (fault: <f>)``."""

    fault: Fault

    def __post_init__(self) -> None:
        if not isinstance(self.fault, Fault):
            raise TypeError(f"FaultyFastgrad.fault must be a Fault, got {self.fault!r}")

    @property
    def label(self) -> str:
        return f"{self.name} (fault: {self.fault.value})"

    def deferred_wgrad(self) -> DeferredWgrad:
        """fastgrad's, with :attr:`Fault.LIFO_DRAIN`'s layer (the other faults: as published)."""
        if self.fault is Fault.LIFO_DRAIN:
            return FastgradDeferredWgrad(layer_cls=LifoDrainOutputLayer)
        return FastgradDeferredWgrad()

    def pipeline(self) -> PipelineTraining:
        """fastgrad's, with the fault's output layer, grid or microbatches."""
        return FaultyPipeline(output_layer_class=output_layer_class(self.fault), fault=self.fault)

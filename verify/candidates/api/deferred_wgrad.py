"""The output layer with deferred embedding wgrad, its drain and the wgrad GEMM, as typed interfaces.

The ``deferred_wgrad`` check builds the last pipeline stage's column-parallel output layer
(:meth:`DeferredWgrad.output_layer`, this rank's ``[V / tp, H]`` weight shard, TP over the
given group, sequence parallelism on or off), drives it microbatch by microbatch
(``layer(x).backward(grad_logits)``: dgrad and its TP collective at once, the wgrad either
accumulated into ``main_grad`` at once or deferred), drains it at the flush and compares
``main_grad`` with the immediate path and with refgrad. Tied embeddings sum the two stages'
``main_grad`` over the embedding group (:meth:`DeferredWgrad.allreduce_tied_embedding_grad`);
the wgrad GEMM variants are held to refgrad alone (:class:`WgradGemm`).

How Megatron-Core implements it: the layer is ``tensor_parallel.ColumnParallelLinear``
(``gather_output=False``, ``gradient_accumulation_fusion``) given the
``embedding_activation_buffer`` and ``grad_output_buffer`` lists, with
``defer_embedding_wgrad_compute`` and ``wgrad_deferral_limit`` in its
``TransformerConfig``; :meth:`OutputLayer.start_step` is
``pipeline_parallel.schedules.clear_embedding_activation_buffer`` and :meth:`OutputLayer.drain`
``utils.drain_embedding_wgrad_compute`` (via ``finish_embedding_wgrad_compute``); the tied
sum is ``distributed.finalize_model_grads._allreduce_word_embedding_grads``'s all-reduce; the
wgrad GEMM is apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`` /
``wgrad_gemm_accum_fp16``. What a candidate lacks (Megatron's drain has no in-flight guard)
raises :class:`verify.candidates.api.Unsupported`.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gradvocab import ParallelDims  # the neutral sizes-and-groups type
from verify.candidates.api.scope import TechniqueScope

ReduceInFlight = Callable[[torch.nn.Parameter], bool]
"""True when the DP grad bucket holding the parameter has its reduction in flight."""


class DrainRefused(RuntimeError):
    """The drain refused to write ``main_grad``: the weight's bucket has its reduction in
    flight, or the deferred inputs and grad_outputs do not pair up (a backward missing)."""


@dataclass(frozen=True)
class OutputLayerConfig:
    """The output layer's settings (Megatron-Core's ``TransformerConfig`` field names) and its
    grid.

    ``wgrad_deferral_limit``: defer only the first N microbatches of a step (0 = all).
    ``dims``: the layer's parallel sizes as one :class:`ParallelDims` (its TP size, PP size
    and sequence parallelism); with TP > 1 it carries the TP group the layer is built with
    (``dims.with_groups(tp_group=...)``). Deferral needs pipeline parallelism: the drain runs
    in the pipeline flush.
    """

    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    dims: ParallelDims = ParallelDims()

    def __post_init__(self) -> None:
        if not isinstance(self.defer_embedding_wgrad_compute, bool):
            raise TypeError(f"OutputLayerConfig.defer_embedding_wgrad_compute must be a bool, "
                            f"got {type(self.defer_embedding_wgrad_compute).__name__}")
        value = self.wgrad_deferral_limit
        if isinstance(value, bool):
            raise TypeError("OutputLayerConfig.wgrad_deferral_limit must be an int, got bool")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"OutputLayerConfig.wgrad_deferral_limit must be an int, "
                            f"got {type(value).__name__}") from None
        if value < 0:
            raise ValueError(f"OutputLayerConfig.wgrad_deferral_limit must be >= 0, got {value}")
        if not isinstance(self.dims, ParallelDims):
            raise TypeError(f"OutputLayerConfig.dims must be a ParallelDims, "
                            f"got {type(self.dims).__name__}")
        if self.defer_embedding_wgrad_compute and self.dims.pp_size == 1:
            raise ValueError("OutputLayerConfig.defer_embedding_wgrad_compute needs "
                             "dims.pp_size > 1 (the drain runs in the pipeline flush)")
        if self.dims.tp_size > 1 and (self.dims.place is None or self.dims.place.tp_group is None):
            raise ValueError("OutputLayerConfig.dims with tp_size > 1 must carry the layer's TP "
                             "group: dims.with_groups(tp_group=...)")

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The layer's TP group (None at TP 1)."""
        return None if self.dims.tp_size == 1 else self.dims.tp_group


@runtime_checkable
class OutputLayer(Protocol):
    """The last stage's column-parallel output layer: ``logits = total_input · Wᵀ``."""

    @property
    def weight(self) -> torch.nn.Parameter:
        """This rank's ``[V / tp, H]`` weight shard."""
        ...

    @property
    def main_grad(self) -> torch.Tensor:
        """The weight's grad accumulator (fp32 or 16-bit), added into by every wgrad."""
        ...

    def __call__(self, local_input: torch.Tensor) -> torch.Tensor:
        """Logits ``[S, B, V / tp]`` of an input ``[S (/ tp under SP), B, H]``; their backward
        runs the dgrad (and its TP collective) and the wgrad, at once or deferred."""
        ...

    def start_step(self) -> None:
        """What the schedule does at the start of a step: clear the deferral buffers."""
        ...

    def drain(self, reduce_in_flight: ReduceInFlight | None = None) -> int:
        """Run every deferred wgrad GEMM into ``main_grad``; return how many ran.

        With ``reduce_in_flight`` the drain must refuse (:class:`DrainRefused`, writing
        nothing) while it says the weight's bucket is being reduced.
        """
        ...

    @property
    def num_deferred(self) -> int:
        """Deferred (input, grad_output) pairs waiting for the drain."""
        ...


class WgradGemm(ABC):
    """One variant of the wgrad GEMM ``main_grad += grad_outputᵀ · total_input`` (fp32
    accumulation), named for the report."""

    name: str

    @abstractmethod
    def __call__(self, main_grad: torch.Tensor, grad_output: torch.Tensor,
                 total_input: torch.Tensor) -> None:
        """Accumulate one microbatch's wgrad into ``main_grad`` in place (``grad_output``
        ``[..., V]``, ``total_input`` ``[..., H]``, ``main_grad`` ``[V, H]``)."""


@runtime_checkable
class DeferredWgrad(TechniqueScope, Protocol):
    """The candidate's output layer with deferred wgrad, its tied-embedding sum and wgrad GEMMs."""

    def output_layer(self, weight: torch.Tensor, config: OutputLayerConfig, *,
                     main_grad_dtype: torch.dtype = torch.float32) -> OutputLayer:
        """A layer holding a copy of ``weight`` (this rank's shard) and a zero ``main_grad`` of
        ``main_grad_dtype``; TP over ``config.tp_group`` (None: TP 1)."""
        ...

    def allreduce_tied_embedding_grad(self, main_grad: torch.Tensor,
                                      embedding_group: dist.ProcessGroup) -> None:
        """Sum the tied word embedding's ``main_grad`` over the embedding group (first and
        last pipeline stage), in place."""
        ...

    def wgrad_gemms(self, device: str) -> tuple[WgradGemm, ...]:
        """The wgrad GEMM variants the candidate has on ``device`` ("cpu" or "cuda")."""
        ...

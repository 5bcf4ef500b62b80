"""fastgrad's output layer with deferred wgrad behind :mod:`verify.candidates.interfaces`.

``fastgrad.deferred_wgrad.ColumnParallelOutputLayer`` is the layer (``start_step`` clears
both deferral buffers, the drain has an in-flight guard), ``accumulate_wgrad_`` the GEMM
in its three CUDA variants, ``allreduce_tied_embedding_grad`` the tied sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastgrad.deferred_wgrad import (
    CUDA_WGRAD_METHODS,
    ColumnParallelOutputLayer,
    EmbeddingWgradConfig,
    ReduceInFlight,
    accumulate_wgrad_,
    allreduce_tied_embedding_grad,
)
from gradvocab import LifecycleError
from verify.candidates.interfaces import (
    DeferredWgrad,
    DrainRefused,
    OutputLayer,
    OutputLayerConfig,
    WgradGemm,
)

CPU_WGRAD_METHOD = "fp32_upcast"  # on the CPU accumulate_wgrad_ always upcasts to an fp32 GEMM


class FastgradOutputLayer(OutputLayer):
    """A ``ColumnParallelOutputLayer`` seen through the interface."""

    def __init__(self, layer: ColumnParallelOutputLayer) -> None:
        self.layer = layer

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.layer.weight

    @property
    def main_grad(self) -> torch.Tensor:
        return self.layer.weight.main_grad

    def __call__(self, local_input: torch.Tensor) -> torch.Tensor:
        return self.layer(local_input)

    def start_step(self) -> None:
        self.layer.start_step()

    def drain(self, reduce_in_flight: ReduceInFlight | None = None) -> int:
        try:
            return self.layer.drain_deferred_wgrad(reduce_in_flight)
        except LifecycleError as refusal:
            raise DrainRefused(f"LifecycleError: {refusal}") from refusal

    @property
    def num_deferred(self) -> int:
        return self.layer.num_deferred


@dataclass(frozen=True)
class FastgradWgradGemm(WgradGemm):
    """``accumulate_wgrad_`` with one of its CUDA methods (on the CPU: an fp32 GEMM on
    upcast copies, whatever the method)."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in CUDA_WGRAD_METHODS:
            raise ValueError(f"FastgradWgradGemm.name must be one of {CUDA_WGRAD_METHODS}, "
                             f"got {self.name!r}")

    def __call__(self, main_grad: torch.Tensor, grad_output: torch.Tensor,
                 total_input: torch.Tensor) -> None:
        accumulate_wgrad_(main_grad, grad_output, total_input, cuda_method=self.name)


@dataclass(frozen=True)
class FastgradDeferredWgrad(DeferredWgrad):
    """fastgrad's layer class ``layer_cls`` (a test's broken candidate names a subclass), its
    wgrad GEMMs and the tied-embedding all-reduce."""

    layer_cls: type[ColumnParallelOutputLayer] = ColumnParallelOutputLayer

    def output_layer(self, weight: torch.Tensor, config: OutputLayerConfig, *,
                     main_grad_dtype: torch.dtype = torch.float32) -> OutputLayer:
        # fastgrad's layer takes the config's ParallelDims as they are, its own settings as
        # an EmbeddingWgradConfig
        dims = config.dims
        fastgrad_config = EmbeddingWgradConfig(
            defer_embedding_wgrad_compute=config.defer_embedding_wgrad_compute,
            wgrad_deferral_limit=config.wgrad_deferral_limit,
        )
        return FastgradOutputLayer(self.layer_cls(weight, fastgrad_config, parallel_dims=dims,
                                                  main_grad_dtype=main_grad_dtype))

    def allreduce_tied_embedding_grad(self, main_grad: torch.Tensor,
                                      embedding_group: dist.ProcessGroup) -> None:
        allreduce_tied_embedding_grad(main_grad, embedding_group)

    def wgrad_gemms(self, device: str) -> tuple[WgradGemm, ...]:
        if device == "cuda":
            return tuple(FastgradWgradGemm(method) for method in CUDA_WGRAD_METHODS)
        return (FastgradWgradGemm(CPU_WGRAD_METHOD),)

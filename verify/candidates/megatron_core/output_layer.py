"""Megatron-Core's deferred embedding wgrad behind :mod:`verify.candidates.interfaces`.

The layer is ``megatron.core.tensor_parallel.layers.ColumnParallelLinear`` (``gather_output=
False``, ``gradient_accumulation_fusion``, given the ``embedding_activation_buffer`` and
``grad_output_buffer`` lists; ``defer_embedding_wgrad_compute`` and ``wgrad_deferral_limit``
in its ``ModelParallelConfig``) inside a module shaped as the schedules expect the last
pipeline stage (:class:`OutputStage`: ``post_process``, the two buffers, the output weight).
:meth:`MegatronOutputLayer.start_step` is the schedules' own
``pipeline_parallel.schedules.clear_embedding_activation_buffer`` and
:meth:`MegatronOutputLayer.drain` their ``finish_embedding_wgrad_compute`` (which calls
``utils.drain_embedding_wgrad_compute``), as ``forward_backward_pipelining_*`` call them at
the start of a step and after the cooldown. The tied-embedding sum is
``distributed.finalize_model_grads._allreduce_word_embedding_grads`` on a module that shares
its embedding and output weights.

Megatron-Core requires gradient-accumulation fusion for the deferral: apex's CUDA extension
``fused_weight_gradient_mlp_cuda``; on a CPU machine the redirect's documented stand-in
(``redirect.REDIRECTS``). What Megatron-Core does not have is :class:`Unsupported`: its drain
has no in-flight guard (it cannot refuse), and on a CPU no wgrad GEMM of its own.

Two contract notes, both from the schedules: Megatron never drains without a deferred entry
(``drain_embedding_wgrad_compute`` pops before its loop, so an empty buffer would raise
``IndexError``; the schedule drains once per step after at least one microbatch), so a drain
with nothing deferred returns 0 here without calling it; and without
``defer_embedding_wgrad_compute`` ``finish_embedding_wgrad_compute`` does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verify.candidates.interfaces import (
    DeferredWgrad,
    OutputLayer,
    OutputLayerConfig,
    ReduceInFlight,
    Technique,
    Unsupported,
    WgradGemm,
)
from verify.candidates.megatron_core.process_groups import fake_group
from verify.candidates.megatron_core.redirect import FUSED_WGRAD_MODULE
from verify.candidates.megatron_core.scope import MegatronScope

CANDIDATE = "megatron-core"


def unsupported(reason: str) -> Unsupported:
    """:class:`Unsupported` for the deferred-wgrad technique, naming this candidate."""
    return Unsupported(Technique.DEFERRED_WGRAD, f"{CANDIDATE} {reason}")


class OutputStage(torch.nn.Module):
    """The last pipeline stage as Megatron's schedules see it (what ``GPTModel`` has): the
    output layer, its two deferral buffers, ``post_process``; its output weight not shared."""

    def __init__(self, layer: Any, activations: list, grad_outputs: list) -> None:
        super().__init__()
        self.output_layer = layer
        self.embedding_activation_buffer = activations
        self.grad_output_buffer = grad_outputs
        self.pre_process, self.post_process = False, True
        self.share_embeddings_and_output_weights = False

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        return self.output_layer.weight


class TiedEmbeddingStage(torch.nn.Module):
    """A DDP-wrapped stage holding the tied word embedding whose ``main_grad`` is ``main_grad``,
    as ``_allreduce_word_embedding_grads`` looks it up (``ddp_config``, ``pre_process``,
    ``share_embeddings_and_output_weights``, ``shared_embedding_or_output_weight()``)."""

    def __init__(self, main_grad: torch.Tensor) -> None:
        from megatron.core.distributed import DistributedDataParallelConfig

        super().__init__()
        self.ddp_config = DistributedDataParallelConfig()
        self.pre_process = True
        self.share_embeddings_and_output_weights = True
        self.weight = torch.nn.Parameter(torch.empty(main_grad.shape, dtype=main_grad.dtype))
        self.weight.main_grad = main_grad

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        return self.weight


class MegatronOutputLayer(OutputLayer):
    """Megatron's ``ColumnParallelLinear`` as the last stage's deferred output layer."""

    def __init__(self, stage: OutputStage, config: Any, tp_group: Any) -> None:
        self.stage, self.config, self.tp_group = stage, config, tp_group

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.stage.output_layer.weight

    @property
    def main_grad(self) -> torch.Tensor:
        return self.weight.main_grad

    def __call__(self, local_input: torch.Tensor) -> torch.Tensor:
        output, _ = self.stage.output_layer(local_input)
        return output

    def start_step(self) -> None:
        from megatron.core.pipeline_parallel.schedules import clear_embedding_activation_buffer

        clear_embedding_activation_buffer(self.config, self.stage, is_last_stage=True)

    def drain(self, reduce_in_flight: ReduceInFlight | None = None) -> int:
        from megatron.core.pipeline_parallel.schedules import finish_embedding_wgrad_compute

        if reduce_in_flight is not None:
            raise unsupported("has no in-flight guard on its drain "
                              "(megatron.core.utils.drain_embedding_wgrad_compute cannot refuse)")
        deferred = len(self.stage.grad_output_buffer)
        if not self.config.defer_embedding_wgrad_compute or (
                deferred == 0 and not self.stage.embedding_activation_buffer):
            return 0  # the schedule never drains an empty buffer (see the module docstring)
        finish_embedding_wgrad_compute(self.config, self.stage, True, self.tp_group)
        return deferred

    @property
    def num_deferred(self) -> int:
        return min(len(self.stage.grad_output_buffer), len(self.stage.embedding_activation_buffer))


@dataclass(frozen=True)
class ApexWgradGemm(WgradGemm):
    """apex's ``fused_weight_gradient_mlp_cuda``, picked by ``main_grad``'s dtype as Megatron's
    ``drain_embedding_wgrad_compute`` picks it (fp32: ``wgrad_gemm_accum_fp32``, 16-bit:
    ``wgrad_gemm_accum_fp16``)."""

    name: str = "apex fused_weight_gradient_mlp_cuda (by main_grad dtype)"

    def __call__(self, main_grad: torch.Tensor, grad_output: torch.Tensor,
                 total_input: torch.Tensor) -> None:
        import importlib

        extension = importlib.import_module(FUSED_WGRAD_MODULE)
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])
        total_input = total_input.reshape(-1, total_input.shape[-1])
        if main_grad.dtype == torch.float32:
            extension.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
        else:
            extension.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)


@dataclass(frozen=True)
class MegatronDeferredWgrad(MegatronScope, DeferredWgrad):
    """Megatron-Core's output layer, drain and tied-embedding all-reduce."""

    needs_memory_buffer = True  # the sequence-parallel wgrad all-gathers into it
    # Megatron's layers drop a given TP group when torch.distributed is not initialised
    # (utils.get_tensor_model_parallel_group_if_none returns None).
    needs_default_group = True

    def output_layer(self, weight: torch.Tensor, config: OutputLayerConfig, *,
                     main_grad_dtype: torch.dtype = torch.float32) -> OutputLayer:
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        tp, group = config.dims.tp_size, config.tp_group
        group = fake_group(0, 1) if group is None else group
        megatron_config = ModelParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=config.dims.pp_size,
            pipeline_dtype=weight.dtype, params_dtype=weight.dtype,
            sequence_parallel=config.dims.sequence_parallel, gradient_accumulation_fusion=True,
            defer_embedding_wgrad_compute=config.defer_embedding_wgrad_compute,
            wgrad_deferral_limit=config.wgrad_deferral_limit, use_cpu_initialization=True)
        activations: list = []
        grad_outputs: list = []
        rows, hidden = weight.shape
        layer = ColumnParallelLinear(
            hidden, rows * tp, config=megatron_config, init_method=torch.nn.init.zeros_,
            bias=False, gather_output=False, embedding_activation_buffer=activations,
            grad_output_buffer=grad_outputs, tp_group=group)
        with torch.no_grad():
            layer.weight.copy_(weight)
        # What DDP gives the weight: a zero main_grad in its grad buffer.
        layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=main_grad_dtype)
        return MegatronOutputLayer(OutputStage(layer, activations, grad_outputs),
                                   megatron_config, group)

    def allreduce_tied_embedding_grad(self, main_grad: torch.Tensor,
                                      embedding_group: dist.ProcessGroup) -> None:
        from megatron.core.distributed.finalize_model_grads import _allreduce_word_embedding_grads
        from megatron.core.model_parallel_config import ModelParallelConfig

        # The embedding group is the first and the last stage: as a pipeline group, its rank
        # 0 is the first stage (the module is found as model[0]) and its last rank the last.
        _allreduce_word_embedding_grads([TiedEmbeddingStage(main_grad)], ModelParallelConfig(),
                                        embedding_group, embedding_group)

    def wgrad_gemms(self, device: str) -> tuple[WgradGemm, ...]:
        from verify.candidates.megatron_core.version import installed

        if device != "cuda":
            raise unsupported("has no wgrad GEMM on the CPU (apex's fused_weight_gradient_mlp_cuda "
                              "is CUDA-only; the CPU stand-in is gradverify's redirect)")
        reason = installed().skip_reason("fused_wgrad_gemm")
        if reason is not None:
            raise unsupported(reason)
        return (ApexWgradGemm(),)

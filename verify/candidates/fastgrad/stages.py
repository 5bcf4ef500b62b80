"""fastgrad's :class:`~verify.candidates.interfaces.PipelineModel`: a case's stages trained step
by step under the caller's optimizer (the preflight twin).

Each rank builds its model chunks (``pipeline_model.build_stage_model``; the output layer
class and the microbatches are ``verify.candidates.fastgrad.pipeline.FastgradPipeline``'s),
casts them to the param dtype (production casts its model before wrapping it), wraps each chunk in
``fastgrad.ddp.DistributedDataParallel`` (production's bucket rule, the grad dtype, both
overlaps) and runs ``fastgrad.pipeline``'s 1F1B, or at VPP > 1 the interleaved 1F1B; the
optimizer is built over ``optimizer_target`` (the DDP, or ``fastgrad.optim.ModelChunks`` of
the chunks: one norm and one step over all of them) by ``verify.candidates.fastgrad.optimizer``.

With MXFP8 params (:class:`~verify.candidates.interfaces.MXFP8Params`) every weight is a
``fastgrad.mxfp8.MXFP8Parameter`` held in one ``fastgrad.mxfp8_sharing.MXFP8ParamGradBuffer``
per rank (the optimizer is built on it, as the ``optim`` check drives it): the stage modules
compute in fp32 on the dequantized values (refreshed after every step), each microbatch's
grad goes into the buffer through ``accumulate_grad`` (its lifecycle guard refuses a write
over live params), the output layer's wgrad straight into the same ``main_grad`` view, and
the buffer reduce-scatters once the backward and the drain are done (:class:`FrontGradSync`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import torch
import torch.distributed as dist

from fastgrad.comm import all_gather_into
from fastgrad.ddp import DistributedDataParallel
from fastgrad.deferred_wgrad import ColumnParallelOutputLayer
from fastgrad.mxfp8 import MXFP8Parameter
from fastgrad.mxfp8_sharing import MXFP8ParamGradBuffer
from fastgrad.optim import ModelChunks
from fastgrad.pipeline import forward_backward_1f1b
from fastgrad.pipeline_interleaved import forward_backward_interleaved
from gradvocab import DDPConfig, ParallelDims
from verify.candidates.fastgrad.pipeline_model import (
    build_stage_model,
    case_ddp_config,
    case_microbatches,
    drained_head,
    external_grad_params,
    total_losses,
)
from verify.candidates.interfaces import MXFP8_BLOCK, PipelineCase, StageSettings, cast_params_

# This rank's (inputs, targets, loss_fn) of one step: (case, grid, step, microbatches) ->
# :func:`~verify.candidates.fastgrad.pipeline_model.case_microbatches`'s result.
Microbatches = Callable[[PipelineCase, ParallelDims, int, int],
                        tuple[list[torch.Tensor], list[torch.Tensor],
                              Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]]

MXFP8_SCALE_MODE = "floor"  # fastgrad.mxfp8.MXFP8Parameter's default, the OCP spec's rule


class FrontGradSync:
    """The pipeline schedule's grad sync (``fastgrad.pipeline.GradSync``) over one MXFP8 buffer:
    it reduce-scatters synchronously, bucket by bucket, once per step, at the first
    ``finish_grad_sync`` (every chunk's backward and the output layer's drain are done)."""

    def __init__(self, front: MXFP8ParamGradBuffer) -> None:
        self.front = front

    def disable_grad_sync(self) -> None:
        return None

    def enable_grad_sync(self) -> None:
        return None

    def start_grad_sync(self) -> None:
        return None

    def mark_grad_ready(self, param: torch.nn.Parameter) -> None:
        return None

    def reduce_in_flight(self, param: torch.nn.Parameter) -> bool:
        return False  # nothing is reduced before finish_grad_sync

    def finish_grad_sync(self) -> None:
        if not self.front.grads_reduced:
            self.front.reduce_grads()


def norm_group(case: PipelineCase, grid: ParallelDims) -> dist.ProcessGroup | None:
    """The group the grad norm is summed over besides DP: every stage and TP rank of this
    replica (TP duplicates are marked ``shared``), as Megatron-Core's model-parallel group."""
    if case.tp_size > 1:
        return grid.model_parallel_group
    return grid.pp_group if case.pp_size > 1 else None


class FastgradStages:
    """This rank's chunks of ``case`` under fastgrad's DDP (or its MXFP8 buffer) and schedules."""

    # The classes built (a test's deliberately broken candidate swaps in a subclass).
    ddp_class: type[DistributedDataParallel] = DistributedDataParallel
    mxfp8_param_class: type[MXFP8Parameter] = MXFP8Parameter
    mxfp8_buffer_class: type[MXFP8ParamGradBuffer] = MXFP8ParamGradBuffer

    def __init__(self, case: PipelineCase, grid: ParallelDims, settings: StageSettings, *,
                 output_layer_class: type[ColumnParallelOutputLayer] = ColumnParallelOutputLayer,
                 microbatches: Microbatches = case_microbatches) -> None:
        self.case, self._grid, self.settings = case, grid, settings
        self._microbatches = microbatches
        built = [build_stage_model(case, grid, c, output_layer_class)
                 for c in range(case.virtual_stages)]
        self.modules = [module for module, *_ in built]
        self.named = {n: p for _, per_chunk, _, _ in built for n, p in per_chunk.items()}
        heads = [head for _, _, head, _ in built]
        self.head: ColumnParallelOutputLayer | None = next((h for h in heads if h is not None), None)
        self.tied = [p for *_, per_chunk in built for p in per_chunk]
        self.ddps: list[DistributedDataParallel] = []
        self.front: MXFP8ParamGradBuffer | None = None
        self.front_params: list[MXFP8Parameter] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        if settings.mxfp8 is None:
            self._build_ddp(heads)
        else:
            self._build_mxfp8()
        self._last_launch_sites: tuple[str, ...] = ()

    # --------------------------------------------------------------------------- building
    def _build_ddp(self, heads: list[ColumnParallelOutputLayer | None]) -> None:
        case, settings, spec = self.case, self.settings, self.case.spec
        if settings.param_dtype != torch.float32:
            cast_params_(list(self.named.values()), settings.param_dtype)
        if self.head is not None and spec.tied_embedding and not spec.shares_one_weight:
            self.head.weight.shared = True  # the second copy: out of the grad norm
        self.ddps = [
            self.ddp_class(
                module, config=replace(case_ddp_config(case, settings.overlap_grad_reduce,
                                                       self._grid.stage, c),
                                       overlap_param_gather=settings.overlap_param_gather,
                                       grad_reduce_in_fp32=settings.grad_dtype == torch.float32),
                dp_group=self._grid.dp_group, averaging=case.reduction,
                external_grad_params=external_grad_params(spec, heads[c]))
            for c, module in enumerate(self.modules)]

    def _build_mxfp8(self) -> None:
        case, settings, spec = self.case, self.settings, self.case.spec
        if self.head is not None and spec.tied_embedding:
            self.head.weight.shared = True  # the second copy: out of the grad norm
        for param in self.named.values():
            quantized = self.mxfp8_param_class(param.detach(), scale_mode=MXFP8_SCALE_MODE,
                                               block_size=MXFP8_BLOCK)
            for mark in ("shared", "shared_embedding"):  # grad norm, own bucket (tied embedding)
                if getattr(param, mark, False):
                    setattr(quantized, mark, True)
            self.front_params.append(quantized)
        config = DDPConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                           overlap_grad_reduce=settings.overlap_grad_reduce,
                           overlap_param_gather=settings.overlap_param_gather,
                           bucket_size=case.bucket_size_for(self._grid.stage, 0),
                           fp8_param_gather=True,
                           reuse_grad_buf_for_mxfp8_param_ag=settings.mxfp8.reuse_grad_buffer)
        self.front = self.mxfp8_buffer_class(self.front_params, config=config,
                                             dp_group=self._grid.dp_group,
                                             averaging=None)  # Megatron-Core's default: 1/dp first
        for param, mx in zip(self.named.values(), self.front_params):
            param.main_grad = mx.main_grad
            if self.head is not None and param is self.head.weight:
                continue  # the output layer writes main_grad itself (deferred or fused wgrad)
            self._hooks.append(param.register_post_accumulate_grad_hook(self._accumulator(mx)))

    def _accumulator(self, mx: MXFP8Parameter):
        front = self.front

        def add(p: torch.Tensor) -> None:
            front.accumulate_grad(mx, p.grad)
            p.grad = None

        return add

    # --------------------------------------------------------------------------- the seam
    @property
    def grid(self) -> ParallelDims:
        return self._grid

    def named_parameters(self) -> Mapping[str, torch.nn.Parameter]:
        return dict(self.named)

    @property
    def optimizer_target(self) -> DistributedDataParallel | ModelChunks | MXFP8ParamGradBuffer:
        """What fastgrad's optimizer steps: the DDP, every chunk's, or the MXFP8 buffer."""
        if self.front is not None:
            return self.front
        return self.ddps[0] if len(self.ddps) == 1 else ModelChunks(self.ddps)

    def refresh_from_mxfp8(self) -> None:
        """The forward's weights: each MXFP8 param dequantized (exact in fp32)."""
        with torch.no_grad():
            for param, mx in zip(self.named.values(), self.front_params):
                param.copy_(mx.dequantize(torch.float32))

    def train_step(self, step: int, *, loss_scale: float = 1.0) -> list[float]:
        case, grid, settings, spec = self.case, self._grid, self.settings, self.case.spec
        for ddp in self.ddps:
            ddp.zero_grad_buffer()
        if self.front is not None:
            self.front.zero_grad()
        if self.head is not None:
            self.head.start_step()
        m = case.plans[step].num_microbatches
        inputs, targets, loss_fn = self._microbatches(case, grid, step, m)
        dtype = settings.param_dtype

        def scaled_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # computed in fp32 on the (16-bit) output, times the loss scale
            return loss_fn(out.float(), target) * loss_scale

        common = dict(parallel_dims=grid, num_microbatches=m,
                      activation_shape=spec.stage_activation_shape, dtype=dtype,
                      loss_fn=scaled_loss,
                      inputs=[x.to(dtype) for x in inputs] if grid.is_first_stage else None,
                      targets=targets if grid.is_last_stage else None,
                      deferred_wgrad=drained_head(spec, self.head), embedding_params=self.tied)
        if self.front is not None:
            syncs = [FrontGradSync(self.front)] * len(self.modules)
        else:
            syncs = self.ddps
        if len(self.modules) == 1:
            losses = forward_backward_1f1b(self.modules[0], grad_sync=syncs[0], **common)
        else:
            losses = forward_backward_interleaved(self.modules, grad_syncs=syncs, **common)
        self._last_launch_sites = tuple(s for ddp in self.ddps for s in ddp.last_launch_sites)
        return [v / loss_scale for v in total_losses(case, grid, losses)]  # exact: S = 2^k

    def reduced_grads(self) -> dict[str, torch.Tensor]:
        names: dict[int, list[str]] = {}
        if self.front is not None:
            for name, mx in zip(self.named, self.front_params):
                names[id(mx)] = [name]
            buckets = self.front.buckets
        else:
            for name, p in self.named.items():  # the shared weight (tied at PP 1): both names
                names.setdefault(id(p), []).append(name)
            buckets = [b for ddp in self.ddps for b in ddp.buffer.buckets]
        grads = {}
        for bucket in buckets:
            full = bucket.grad_data.clone()  # all-reduced: whole on every rank
            if self.case.dp_size > 1 and self.case.use_distributed_optimizer:
                all_gather_into(full, bucket.local_grad_shard.clone(), group=self._grid.dp_group)
            for p in bucket.params:
                start, end = bucket.param_to_index[p]
                for name in names[id(p)]:
                    grads[name] = full[start:end].reshape(p.shape).clone()
        return grads

    def launch_sites(self) -> tuple[str, ...]:
        return self._last_launch_sites

    def mxfp8_bits(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {n: (mx.scale_bits.clone(), mx.element_bits.clone())
                for n, mx in zip(self.named, self.front_params)}

    @property
    def mxfp8_grad_buffer_shared(self) -> bool:
        return self.front is not None and self.front.sharing

    def close(self) -> None:
        for ddp in self.ddps:
            ddp.remove_hooks()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

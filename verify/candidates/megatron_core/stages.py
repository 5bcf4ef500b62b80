"""Megatron-Core's :class:`~verify.candidates.interfaces.PipelineModel`: a case's stages under its
own DDP and 1F1B schedules, trained step by step under its own optimizer (the preflight twin).

Each rank builds its model chunks of the case's ``refgrad.pipeline`` model (global stage
``chunk * P + stage``, Megatron's interleaving; on the last stage the output head as
Megatron's ``ColumnParallelLinear`` with ``defer_embedding_wgrad_compute``; tied, the first
layer's weight and the head's as Megatron's ``LanguageModule`` marks its word embedding and
output layer: ``shared_embedding`` on both, ``shared`` on the head's copy), and wires them as
Megatron-LM's ``megatron/training/training.py`` does (``get_model``, ``setup_model_and_optimizer``,
``train``):

* 16-bit params: each chunk wrapped in ``Float16Module`` (the params cast in place, the first
  stage's input cast to the param dtype, the last stage's output to fp32 for the loss);
* ``DistributedDataParallel`` over each chunk (``disable_bucketing`` for the chunks after the
  first, as ``get_model``; Megatron itself leaves pipeline ranks after the first one bucket),
  ``grad_reduce_in_fp32`` from the grad dtype, both overlaps as given;
* ``config.no_sync_func`` / ``grad_sync_func`` (``align_grad_reduce``, Megatron-LM's default)
  from the chunks with ``overlap_grad_reduce``; ``param_sync_func`` with
  ``overlap_param_gather`` (``align_param_gather``, its default);
  ``config.finalize_model_grads_func = finalize_model_grads`` (which finishes the grad sync and
  all-reduces the tied embedding's grad over the embedding group);
  ``config.grad_scale_func`` is the optimizer's ``scale_loss``
  (:mod:`verify.candidates.megatron_core.optimizer`);
* with VPP, ``overlap_p2p_comm`` and ``batch_p2p_comm=False`` (Megatron-LM's defaults: at
  PP 2 ``batch_p2p_comm`` swaps transfers, a known Megatron-Core bug);
* each step: the chunks' ``zero_grad_buffer`` and the optimizer's ``zero_grad``, then
  ``get_forward_backward_func`` (``forward_backward_pipelining_without_interleaving`` /
  ``_with_interleaving``) with a ``P2PCommunicator`` over the grid's pipeline group.

Megatron is given the grid's process groups (``ParallelDims.build``) as a
``ProcessGroupCollection`` (DDP, the schedules, ``finalize_model_grads`` and
``get_megatron_optimizer`` take one in 0.16), so several grids side by side in one world run
as they do for any candidate; size-1 groups are torch's ``FakeProcessGroup``. Megatron's
global ``parallel_state`` is not used.

Losses: Megatron divides each microbatch's loss by the microbatch count itself
(``forward_step_calc_loss``), so the loss function returns refgrad's ``stage_loss(..., 1)``
(a mean, then ``/ 1``): the same operations as refgrad's ``stage_loss(..., M)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradvocab import ParallelDims
from verify.candidates.interfaces import (
    HEAD_PARAM,
    PipelineCase,
    StageModule,
    StageSettings,
    head_weight_init,
    rank_microbatches,
    stage_loss,
    stage_param_name,
)
from verify.candidates.megatron_core.process_groups import fake_group, megatron_process_groups

if TYPE_CHECKING:  # megatron-core is optional: imported where a technique runs
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer import TransformerConfig


class StageChunk(torch.nn.Module):
    """One global stage of refgrad's stack as a Megatron model chunk: ``set_input_tensor``,
    ``pre_process`` / ``post_process``, and on the last stage the output head (Megatron's
    ``ColumnParallelLinear``, its wgrad deferred as the config says), tied to the first
    layer when the spec ties them (``shared_embedding_or_output_weight``)."""

    def __init__(self, case: PipelineCase, config: TransformerConfig, stage: int,
                 vp_stage: int | None, activation_buffer: list | None = None) -> None:
        from megatron.core.enums import ModelType
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        super().__init__()
        spec = case.spec
        self.stage, self.vp_stage = stage, vp_stage
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process, self.post_process = stage == 0, stage == spec.num_stages - 1
        self.share_embeddings_and_output_weights = spec.tied_embedding
        self.body = StageModule(spec, stage)
        self.input_tensor: torch.Tensor | None = None
        # The head's deferred inputs (Megatron's embedding_activation_buffer); a caller may
        # pass a list of its own to observe the drain.
        self.embedding_activation_buffer = [] if activation_buffer is None else activation_buffer
        self.grad_output_buffer: list = []
        self.output_layer = None
        if self.post_process and spec.output_head:
            self.output_layer = ColumnParallelLinear(
                spec.hidden, spec.hidden, config=config, init_method=torch.nn.init.zeros_,
                bias=False, gather_output=False, tp_group=fake_group(0, 1),
                embedding_activation_buffer=self.embedding_activation_buffer,
                grad_output_buffer=self.grad_output_buffer)
            with torch.no_grad():
                self.output_layer.weight.copy_(head_weight_init(spec))
        if spec.tied_embedding and (self.pre_process or self.output_layer is not None):
            # What Megatron's LanguageModule sets: both copies in a bucket of their own, and
            # the output layer's copy out of the grad norm (counted once).
            self.shared_embedding_or_output_weight().shared_embedding = True
            if not self.pre_process:
                self.output_layer.weight.shared = True

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        if self.pre_process:
            return self.body.layers[0].weight
        return self.output_layer.weight

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.pre_process else self.input_tensor
        rows, batch, hidden = h.shape
        out = self.body(h.reshape(rows * batch, hidden)).view(rows, batch, hidden)
        if self.output_layer is not None:
            out, _ = self.output_layer(out)
        return out

    def named_for_refgrad(self) -> dict[str, torch.nn.Parameter]:
        named = {stage_param_name(self.stage, n): p for n, p in self.body.named_parameters()}
        if self.output_layer is not None:
            named[stage_param_name(self.stage, HEAD_PARAM)] = self.output_layer.weight
        return named


def transformer_config(case: PipelineCase, dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """The ``TransformerConfig`` Megatron-LM would build for ``case``'s model with ``dtype``
    params (the pipeline check's fp32, the twin's precision). The ``"sum"`` reduction is
    Megatron's per-token-loss mode (:func:`forward_step_func`)."""
    from megatron.core.transformer import TransformerConfig

    spec = case.spec
    interleaved = case.virtual_stages > 1
    return TransformerConfig(
        num_layers=spec.num_stages, hidden_size=spec.hidden, num_attention_heads=1,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16,
        pipeline_model_parallel_size=case.pp_size,
        virtual_pipeline_model_parallel_size=case.virtual_stages if interleaved else None,
        gradient_accumulation_fusion=spec.output_head,
        defer_embedding_wgrad_compute=spec.output_head and spec.defer_output_wgrad,
        wgrad_deferral_limit=spec.wgrad_deferral_limit,
        calculate_per_token_loss=case.reduction.megatron_flags().calculate_per_token_loss,
        # Megatron-LM: overlap_p2p_comm with VPP, and batch_p2p_comm = not overlap_p2p_comm.
        overlap_p2p_comm=interleaved, batch_p2p_comm=not interleaved)


def forward_step_func(case: PipelineCase, num_microbatches: int) -> Callable[..., Any]:
    """Megatron's ``forward_step_func``: the chunk's output and refgrad's loss of it.

    Without per-token loss Megatron divides each microbatch's loss by M itself
    (``forward_step_calc_loss``), so the loss is refgrad's ``stage_loss(..., 1)``: the same
    operations, the same bits. The ``"sum"`` reduction is its per-token-loss mode: the loss
    as refgrad has it and 0 tokens, so nothing divides it."""
    spec = case.spec
    per_token = case.reduction.megatron_flags().calculate_per_token_loss

    def forward_step(data_iterator: Iterator, model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        x, target = next(data_iterator)
        output = model(x)

        def loss_func(output_tensor: torch.Tensor) -> tuple:
            out = output_tensor.view(target.shape)
            reported = stage_loss(spec, out.detach(), target, num_microbatches)
            if per_token:
                return (stage_loss(spec, out, target, num_microbatches),
                        torch.zeros((), dtype=torch.int), reported)
            return stage_loss(spec, out, target, 1), reported

        return output, loss_func

    return forward_step


class MegatronStages:
    """This rank's chunks of ``case`` under Megatron-Core's DDP and schedules."""

    def __init__(self, case: PipelineCase, grid: ParallelDims, settings: StageSettings,
                 ddp_class: type | None = None) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module

        self.case, self._grid, self.settings = case, grid, settings
        self.config = transformer_config(case, settings.param_dtype)
        self.groups = megatron_process_groups(grid)
        ddp_class = ddp_class or DistributedDataParallel
        self.chunks: list[StageChunk] = []
        self.ddps: list[DistributedDataParallel] = []
        for v in range(case.virtual_stages):
            vp_stage = v if case.virtual_stages > 1 else None
            chunk = StageChunk(case, self.config, v * case.pp_size + grid.stage, vp_stage)
            chunk.pg_collection = self.groups  # where Float16Module finds the pipeline group
            module: torch.nn.Module = chunk
            if settings.param_dtype != torch.float32:
                module = Float16Module(self.config, chunk)  # casts the chunk's params in place
            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=case.use_distributed_optimizer,
                overlap_grad_reduce=settings.overlap_grad_reduce,
                overlap_param_gather=settings.overlap_param_gather,
                grad_reduce_in_fp32=settings.grad_dtype == torch.float32,
                bucket_size=case.bucket_size,
                reduce_scatter_with_fp32_accumulation=case.reduce_scatter_with_fp32_accumulation,
                average_in_collective=case.reduction.megatron_flags().average_in_collective)
            self.ddps.append(ddp_class(self.config, ddp_config, module, disable_bucketing=v > 0,
                                       pg_collection=self.groups))
            self.chunks.append(chunk)
        self.named = {n: p for chunk in self.chunks for n, p in chunk.named_for_refgrad().items()}
        # Called at the start of each step, after the buffers are zeroed: the optimizer's
        # zero_grad (Megatron-LM's train_step), registered by the optimizer adapter.
        self.on_zero_grad: list[Callable[[], None]] = []
        self._wire()

    def _wire(self) -> None:
        """Megatron-LM training.py's ``train()`` setup of the schedule's hooks."""
        from megatron.core.distributed import finalize_model_grads

        config, ddps, single = self.config, self.ddps, len(self.ddps) == 1
        if self.settings.overlap_grad_reduce:
            config.no_sync_func = [ddp.no_sync for ddp in ddps]
            config.grad_sync_func = [ddp.start_grad_sync for ddp in ddps]
            if single:
                config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
        if self.settings.overlap_param_gather:
            config.param_sync_func = [ddp.start_param_sync for ddp in ddps]
            if single:
                config.param_sync_func = config.param_sync_func[0]
        config.finalize_model_grads_func = finalize_model_grads

    # --------------------------------------------------------------------------- the seam
    @property
    def grid(self) -> ParallelDims:
        return self._grid

    def named_parameters(self) -> Mapping[str, torch.nn.Parameter]:
        return dict(self.named)

    def train_step(self, step: int, *, loss_scale: float = 1.0) -> list[float]:
        """One step; the loss is scaled by the optimizer's ``scale_loss`` (``grad_scale_func``,
        as Megatron-LM wires it) or, without an optimizer, by ``loss_scale``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        case, grid, spec = self.case, self._grid, self.case.spec
        if not self.on_zero_grad and loss_scale != 1.0:
            self.config.grad_scale_func = lambda loss: loss * loss_scale
        for ddp in self.ddps:
            ddp.zero_grad_buffer()
        for zero_grad in self.on_zero_grad:
            zero_grad()
        m = case.plans[step].num_microbatches
        inputs, targets, _ = rank_microbatches(case.spec, grid.dp_rank, grid.tp_rank, step, m)
        data = [(x.view(spec.microbatch_size, 1, spec.hidden), t) for x, t in zip(inputs, targets)]
        interleaved = case.virtual_stages > 1
        iterators = [iter(data) for _ in self.ddps]
        forward_backward = get_forward_backward_func(case.pp_size,
                                                     case.virtual_stages if interleaved else None)
        store = forward_backward(
            forward_step_func=forward_step_func(case, m),
            data_iterator=iterators if interleaved else iterators[0],
            model=self.ddps if interleaved else self.ddps[0], num_microbatches=m,
            seq_length=spec.microbatch_size, micro_batch_size=1, forward_only=False,
            p2p_communicator=P2PCommunicator(pp_group=self.groups.pp, config=self.config),
            pg_collection=self.groups)
        return [float(loss) for loss in store] if grid.is_last_stage else []

    def reduced_grads(self) -> dict[str, torch.Tensor]:
        """Each param's reduced ``main_grad``; with the distributed optimizer each rank
        reduced only its shard, so the others are all-gathered into a copy of each buffer
        (Megatron's own buffers are left as they are)."""
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        gather = self.case.use_distributed_optimizer and self.case.dp_size > 1
        dp_group, dp = self.groups.dp, self.case.dp_size
        grads = {}
        for ddp in self.ddps:
            for buffer in ddp.buffers:
                full = buffer.grad_data.clone()
                if gather:
                    for bucket in buffer.buckets:
                        own = shard_buffer(bucket.grad_data, dp)[dist.get_rank(dp_group)]
                        region = full[bucket.offset:bucket.offset + bucket.grad_data.numel()]
                        dist.all_gather_into_tensor(region, own.clone(), group=dp_group)
                for name, param in self.named.items():
                    if param in buffer.param_index_map:
                        start, end, _ = buffer.param_index_map[param]
                        grads[name] = full[start:end].view(param.shape).clone()
        return grads

    def launch_sites(self) -> tuple[str, ...]:
        return ()  # not recorded for the twin

    def mxfp8_bits(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {}

    @property
    def mxfp8_grad_buffer_shared(self) -> bool:
        return False

    def param_gather_in_flight(self) -> bool:
        """Whether some bucket group's param all-gather is launched and not yet waited for."""
        return any(group.param_gather_handle is not None
                   for ddp in self.ddps for group in ddp.bucket_groups)

    def force_param_sync(self) -> None:
        """Gather every param now (the last step's: no forward follows it)."""
        for ddp in self.ddps:
            ddp.start_param_sync(force_sync=True)

    def close(self) -> None:
        self.on_zero_grad.clear()

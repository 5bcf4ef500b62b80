"""Driver: DDP grad sync inside Megatron-Core's 1F1B schedules, plain and interleaved.

refgrad.pipeline's model (a stack of Linear+tanh layers, ``LinearStackSpec``; optionally
its output head with deferred wgrad) is trained on a TP 1 x PP x DP grid (VPP model
chunks per pipeline rank) by Megatron-Core's own code, wired as Megatron-LM's
``megatron/training/training.py`` ``get_model``/``train`` wire it:

* each chunk built in fp32 from refgrad's initial values and wrapped in
  ``Float16Module`` (bf16 params, the first stage's input cast to bf16, the last stage's
  output to fp32), then in ``DistributedDataParallel`` (``disable_bucketing`` for chunks
  after the first, as ``get_model`` does);
* ``config.no_sync_func`` = the chunks' ``no_sync``, ``config.grad_sync_func`` = their
  ``start_grad_sync`` (``align_grad_reduce``, Megatron-LM's default),
  ``config.finalize_model_grads_func = finalize_model_grads``,
  ``config.grad_scale_func = optimizer.scale_loss``;
* with VPP, ``overlap_p2p_comm=True`` and ``batch_p2p_comm=False`` (Megatron-LM's defaults;
  ``overlap_p2p_comm=False`` gives ModelParallelConfig's default ``batch_p2p_comm=True``);
* ``get_forward_backward_func()`` (``forward_backward_pipelining_without_interleaving``,
  or ``_with_interleaving`` for VPP > 1), then the distributed optimizer's ``step()``
  (``get_megatron_optimizer``, Adam), ``zero_grad_buffer`` before each step.

The global stage of chunk ``v`` on pipeline rank ``p`` is ``v * P + p`` (Megatron's
interleaving), so refgrad's spec has ``P * V`` stages. Each step's inputs and targets
are ``refgrad.pipeline.microbatch_data`` (per DP rank, per step). Per step every rank
returns, keyed by refgrad's parameter names, its bf16 params before the step and each
param's reduced ``main_grad`` with the part of it this rank's shard owns (the only part
the reduce-scatter defines), plus its losses and the optimizer's grad norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from refgrad.pipeline import (
    HEAD_PARAM,
    LinearStackSpec,
    StageModule,
    head_weight_init,
    microbatch_data,
    stage_param_name,
)
from verify.candidates.megatron_core.runtime import ParallelGrid, megatron_world
from verify.distributed import spawn


@dataclass(frozen=True)
class PipelineCase:
    """A PP x DP (x VPP) training run of refgrad's Linear+tanh stack through Megatron-Core."""

    pipeline_parallel: int = 2
    data_parallel: int = 2
    virtual_pipeline: int = 1
    num_microbatches: int = 4
    steps: int = 2
    layers_per_stage: int = 2
    output_head: bool = False
    overlap_grad_reduce: bool = True
    align_grad_reduce: bool = True
    grad_reduce_in_fp32: bool = True
    overlap_p2p_comm: bool = True
    lr: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        ParallelGrid(pipeline_parallel=self.pipeline_parallel, data_parallel=self.data_parallel,
                     virtual_pipeline=self.virtual_pipeline)
        if self.virtual_pipeline > 1 and self.num_microbatches % self.pipeline_parallel:
            raise ValueError("PipelineCase.num_microbatches must be a multiple of "
                             "pipeline_parallel with virtual_pipeline > 1 (Megatron's interleaving)")
        if self.overlap_p2p_comm and self.virtual_pipeline == 1:
            object.__setattr__(self, "overlap_p2p_comm", False)  # as Megatron-LM's validate_args
        if self.steps < 1 or self.num_microbatches < 1:
            raise ValueError("PipelineCase.steps and num_microbatches must be >= 1")

    @property
    def grid(self) -> ParallelGrid:
        return ParallelGrid(pipeline_parallel=self.pipeline_parallel,
                            data_parallel=self.data_parallel, virtual_pipeline=self.virtual_pipeline)

    @property
    def spec(self) -> LinearStackSpec:
        """refgrad's model: one stage per (pipeline rank, model chunk)."""
        return LinearStackSpec(num_stages=self.pipeline_parallel * self.virtual_pipeline,
                               layers_per_stage=self.layers_per_stage, seed=self.seed,
                               output_head=self.output_head, defer_output_wgrad=True)

    def label(self) -> str:
        vpp = f" VPP={self.virtual_pipeline}" if self.virtual_pipeline > 1 else ""
        head = " deferred head" if self.output_head else ""
        sync = "overlap" if self.overlap_grad_reduce else "no-overlap"
        align = "+grad_sync_func" if self.overlap_grad_reduce and self.align_grad_reduce else ""
        p2p = ""
        if self.virtual_pipeline > 1:
            p2p = " overlap_p2p_comm" if self.overlap_p2p_comm else " batch_p2p_comm"
        return (f"PP={self.pipeline_parallel} DP={self.data_parallel}{vpp}{p2p} "
                f"M={self.num_microbatches}{head} bf16 distopt {sync}{align}")


class _Chunk(torch.nn.Module):
    """One global stage of refgrad's stack (its own fp32 initial values), and on the last
    stage the output head as Megatron's ``ColumnParallelLinear`` with deferred wgrad."""

    def __init__(self, case: PipelineCase, config, stage: int, vp_stage: int | None) -> None:
        from megatron.core.enums import ModelType
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        super().__init__()
        spec = case.spec
        self.stage = stage
        self.vp_stage = vp_stage
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = stage == 0
        self.post_process = stage == spec.num_stages - 1
        self.share_embeddings_and_output_weights = False
        self.body = StageModule(spec, stage)
        self.input_tensor = None
        self.embedding_activation_buffer: list = []
        self.grad_output_buffer: list = []
        self.output_layer = None
        if self.post_process and spec.output_head:
            self.output_layer = ColumnParallelLinear(
                spec.hidden, spec.hidden, config=config, init_method=torch.nn.init.zeros_,
                bias=False, gather_output=False,
                embedding_activation_buffer=self.embedding_activation_buffer,
                grad_output_buffer=self.grad_output_buffer)
            with torch.no_grad():
                self.output_layer.weight.copy_(head_weight_init(spec))

    def shared_embedding_or_output_weight(self):
        return self.output_layer.weight

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.input_tensor is None else self.input_tensor
        rows, batch, hidden = h.shape
        out = self.body(h.view(rows * batch, hidden)).view(rows, batch, hidden)
        if self.output_layer is not None:
            out, _ = self.output_layer(out)
        return out

    def named_for_refgrad(self) -> dict[str, torch.nn.Parameter]:
        named = {stage_param_name(self.stage, n): p for n, p in self.body.named_parameters()}
        if self.output_layer is not None:
            named[stage_param_name(self.stage, HEAD_PARAM)] = self.output_layer.weight
        return named


def _config(case: PipelineCase):
    from megatron.core.transformer import TransformerConfig

    spec = case.spec
    return TransformerConfig(
        num_layers=spec.num_stages, hidden_size=spec.hidden, num_attention_heads=1,
        use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, pipeline_model_parallel_size=case.pipeline_parallel,
        virtual_pipeline_model_parallel_size=(case.virtual_pipeline
                                              if case.virtual_pipeline > 1 else None),
        gradient_accumulation_fusion=case.output_head,
        defer_embedding_wgrad_compute=case.output_head,
        # Megatron-LM: batch_p2p_comm = not overlap_p2p_comm (overlap is its default with VPP).
        overlap_p2p_comm=case.overlap_p2p_comm, batch_p2p_comm=not case.overlap_p2p_comm)


def _build(case: PipelineCase, config, pp_rank: int):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    chunks, model = [], []
    for v in range(case.virtual_pipeline):
        vp_stage = v if case.virtual_pipeline > 1 else None
        chunk = _Chunk(case, config, v * case.pipeline_parallel + pp_rank, vp_stage)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=case.overlap_grad_reduce,
            grad_reduce_in_fp32=case.grad_reduce_in_fp32, bucket_size=64)
        model.append(DistributedDataParallel(config, ddp_config, Float16Module(config, chunk),
                                             disable_bucketing=v > 0))
        chunks.append(chunk)
    return chunks, model


def _wire(case: PipelineCase, config, model, optimizer) -> None:
    """Megatron-LM training.py's ``train()`` setup of the schedule's hooks."""
    from megatron.core.distributed import finalize_model_grads

    config.grad_scale_func = optimizer.scale_loss
    if case.overlap_grad_reduce:
        config.no_sync_func = [chunk.no_sync for chunk in model]
        if case.align_grad_reduce:
            config.grad_sync_func = [chunk.start_grad_sync for chunk in model]
        if len(model) == 1:
            config.no_sync_func = config.no_sync_func[0]
            if case.align_grad_reduce:
                config.grad_sync_func = config.grad_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads


def _owned(chunk_ddp, param: torch.nn.Parameter) -> tuple[int, int]:
    """The part ``[lo, hi)`` of ``param`` (flattened) that this DP rank's shard holds."""
    for buffer in chunk_ddp.buffers:
        if param in buffer.param_index_map:
            start, end, bucket_id = buffer.param_index_map[param]
            bucket = buffer.buckets[bucket_id]
            size = buffer.data_parallel_world_size
            shard = bucket.grad_data.numel() // size
            first = bucket.offset + buffer.data_parallel_group.rank() * shard
            lo, hi = max(start, first), min(end, first + shard)
            return (lo - start, hi - start) if hi > lo else (0, 0)
    raise KeyError("param is not in any of the chunk's buffers")


def _forward_step(data_iterator, model):
    x, target = next(data_iterator)
    output = model(x)

    def loss_func(output_tensor):
        rows, batch, hidden = output_tensor.shape
        loss = (output_tensor.view(rows * batch, hidden) - target).square().mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def _pipeline_rank(rank: int, world_size: int, case: PipelineCase) -> dict:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec = case.spec
    with megatron_world(case.grid) as (place, log):
        torch.manual_seed(case.seed)
        config = _config(case)
        chunks, model = _build(case, config, place.pp_rank)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=case.lr, bf16=True, use_distributed_optimizer=True,
                            clip_grad=0.0, weight_decay=0.0), model)
        _wire(case, config, model, optimizer)
        forward_backward = get_forward_backward_func()
        steps = []
        for step in range(case.steps):
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            params = {n: p.detach().clone() for c in chunks for n, p in c.named_for_refgrad().items()}
            inputs, targets = microbatch_data(spec, place.dp_rank, step, case.num_microbatches)
            data = [(x.view(spec.microbatch_size, 1, spec.hidden), t) for x, t in zip(inputs, targets)]
            iterators = [iter(data) for _ in model]
            losses = forward_backward(
                forward_step_func=_forward_step,
                data_iterator=iterators if len(model) > 1 else iterators[0],
                model=model if len(model) > 1 else model[0],
                num_microbatches=case.num_microbatches, seq_length=spec.microbatch_size,
                micro_batch_size=1, forward_only=False)
            grads = {}
            for chunk, chunk_ddp in zip(chunks, model):
                for name, p in chunk.named_for_refgrad().items():
                    grads[name] = (p.main_grad.detach().clone(), _owned(chunk_ddp, p))
            _, grad_norm, _ = optimizer.step()
            steps.append({"params": params, "grads": grads, "grad_norm": grad_norm,
                          "losses": [float(x["loss"]) for x in losses]})
        final = {n: p.detach().clone() for c in chunks for n, p in c.named_for_refgrad().items()}
        dist.barrier()
        return {"pp_rank": place.pp_rank, "dp_rank": place.dp_rank, "steps": steps,
                "final_params": final, "redirects": log.summary()}


def run_pipeline(case: PipelineCase, *, timeout_s: float = 240.0) -> list[dict]:
    """Megatron's schedule, DDP and distributed optimizer for ``case``; per-rank results."""
    return spawn(_pipeline_rank, case.grid.world_size, case, timeout_s=timeout_s)

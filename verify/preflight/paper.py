"""The full-size model on paper: buffer layouts, bytes on the wire, predicted reduction error.

Nothing here allocates a tensor of the model's size: the layouts come from
``refgrad.layout.compute_layout`` on the per-chunk list of parameter sizes
(production's arithmetic as the specification states it, one parameter at a time: the
figures are the spec's, never those of an implementation under test), and every other
figure is a formula over those sizes. Units: elements for layouts, bytes for
memory and traffic, per rank and per optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from gradvocab import Averaging
from refgrad.formats import FLOAT32, format_of, gamma
from refgrad.layout import Layout, compute_layout
from verify.preflight.config import DTYPE_BYTES, PreflightConfig
from verify.preflight.model import ParamSpec, chunk_parameters, layers_of_chunk
from verify.studies.reduce_scatter.sweep import DEFAULT_DP

BUCKET_RULES = ("Bucket size: max(40M, 1M x DP x CP) elements or --ddp-bucket-size on pipeline rank 0's "
                "first model chunk only; one bucket on every pipeline rank > 0 "
                "(megatron/core/distributed/distributed_data_parallel.py: `if disable_bucketing or "
                "pp_rank > 0: self.bucket_size = None`), on model chunks > 0 (training.py "
                "get_model) and without --overlap-grad-reduce (training.py resolve_ddp_bucket_size)")
WIRE_FORMULAS = {
    "grad_reduce_scatter": "sum over buckets of (N-1)/N * S * b_grad (ring reduce-scatter; "
                           "the fp32-accumulation all-to-all sends the same bytes)",
    "grad_all_reduce": "sum over buckets of 2 (N-1)/N * S * b_grad (ring all-reduce, no "
                       "distributed optimizer)",
    "param_all_gather": "sum over buckets of (N-1)/N * S * b_param (distributed optimizer; "
                        "b_param = 1 + 1/32 with MXFP8 --fp8-param-gather: E4M3 data + E8M0 scales)",
    "embedding_all_reduce": "2 (2-1)/2 * (vocab/TP * h) * b_grad on the first and last stage "
                            "(PP > 1 with tied embeddings or MTP, embedding group of 2)",
    "qk_layernorm_tp_all_reduce": "2 (T-1)/T * (the stage's q/k layernorm elements) * b_grad "
                                  "(--qk-layernorm: their grads summed over TP after the DP "
                                  "reduction, finalize_model_grads.py:451-454)",
    "pipeline_p2p": "M * (mbs * seq/CP/(TP if sequence parallel) * h * b_act) per chunk boundary "
                    "and direction: forward activations sent downstream, their grads upstream",
    "tensor_parallel": "blocks * M * 4 (T-1)/T * mbs * seq/CP * h * b_act (per TP block and "
                       "microbatch: 1 all-gather + 1 reduce-scatter forward and the mirror "
                       "backward with sequence parallelism; 2 all-reduces without: same bytes; "
                       "a GPT layer, and each MTP depth's transformer layer run on the last "
                       "stage, is 2 blocks, attention and MLP; a hybrid layer 1: its Mamba "
                       "mixer, attention or MLP)",
}


@dataclass(frozen=True)
class ChunkLayout:
    """One model chunk's parameters and the gradient buffer production builds for them."""

    stage: int
    chunk: int
    params: tuple[ParamSpec, ...]
    bucket_size: int | None
    bucket_rule: str
    layout: Layout

    @property
    def param_elements(self) -> int:
        return sum(p.numel for p in self.params)


def bucket_size_for(config: PreflightConfig, stage: int, chunk: int) -> tuple[int | None, str]:
    """Production's bucket size for a chunk, and the rule that set it."""
    if config.torch_fsdp2:
        # megatron/training/training.py get_model:1848: no bucket size for torch FSDP2, which
        # reduces per fully_shard module.
        return None, "none (torch FSDP2: one reduce-scatter per fully_shard module)"
    if not config.overlap_grad_reduce:
        # megatron/training/training.py resolve_ddp_bucket_size: None without overlap.
        return None, "one (no --overlap-grad-reduce)"
    if stage > 0:
        # megatron/core/distributed/distributed_data_parallel.py:
        # `if disable_bucketing or pp_rank > 0: self.bucket_size = None`.
        return None, "one (pipeline rank > 0)"
    if chunk > 0:
        # megatron/training/training.py get_model: disable_bucketing for chunk_idx > 0.
        return None, "one (model chunk > 0)"
    size = config.first_stage_bucket_size
    source = "--ddp-bucket-size" if config.ddp_bucket_size is not None else "max(40M, 1M x DP x CP)"
    return size, f"{size:,} ({source})"


def chunk_layouts(config: PreflightConfig) -> list[ChunkLayout]:
    """Every (stage, chunk)'s dense buffer, one DDP buffer per model chunk as Megatron wraps
    them, sharded and padded over the DP x CP group that reduces the gradients (the experts'
    ``allreduce=False`` params are :func:`expert_chunk_layouts`')."""
    return _buffer_layouts(config, expert=False, dp_size=config.data_context_parallel_size)


def expert_chunk_layouts(config: PreflightConfig) -> list[ChunkLayout]:
    """Every (stage, chunk)'s expert buffer, where it has expert params: Megatron-Core's DDP
    groups ``allreduce=False`` params into buffers of their own
    (param_and_grad_buffer.py:882 group_params_for_buffers, ``is_expert_parallel``), reduced
    over the expert-data-parallel group and padded with its size
    (distributed_data_parallel.py:223-229 ``intra_expt_dp_group``; distrib_optimizer.py:619
    compute_full_param_layout ``expert_data_parallel_world_size``), with the same bucket size
    as the chunk's dense buffer (``self.bucket_size``)."""
    if not config.expert_buffers:
        return []
    return _buffer_layouts(config, expert=True, dp_size=config.expert_data_parallel_size)


def _buffer_layouts(config: PreflightConfig, *, expert: bool, dp_size: int) -> list[ChunkLayout]:
    """The dense (``expert`` False) or expert buffer of every (stage, chunk) that has params of
    that kind, laid out over ``dp_size`` ranks with the chunk's bucket size."""
    out = []
    for stage in range(config.pipeline_model_parallel_size):
        for chunk in range(config.virtual_pipeline_model_parallel_size):
            params = [p for p in chunk_parameters(config, stage, chunk) if p.expert == expert]
            if expert and not params:
                continue
            size, rule = bucket_size_for(config, stage, chunk)
            shared = [i for i, p in enumerate(params) if p.shared_embedding]
            layout = compute_layout(
                [p.numel for p in params],
                dp_size=dp_size,
                bucket_size=size,
                use_distributed_optimizer=config.use_distributed_optimizer,
                pad_buckets_for_high_nccl_busbw=config.ddp_pad_buckets_for_high_nccl_busbw,
                shared_embedding=shared,
            )
            if shared and config.use_distributed_optimizer:
                # Megatron-Core's param_and_grad_buffer._does_param_require_new_bucket: with the
                # distributed optimizer a shared embedding gets a bucket of its own, whatever
                # the size rule (so "one" bucket by the rule can read 2 in the layout).
                rule += " + 1 for the shared embedding (own bucket, distributed optimizer)"
            out.append(ChunkLayout(stage, chunk, tuple(params), size, rule, layout))
    return out


def _ring_fraction(n: int) -> float:
    return (n - 1) / n


def param_gather_bytes_per_element(config: PreflightConfig) -> float:
    """Bytes per element of the param all-gather."""
    if config.fp8_param_gather:
        return 1 + 1 / 32 if config.fp8_recipe == "mxfp8" else 1.0
    return float(DTYPE_BYTES[config.params_dtype])


def memory_rows(config: PreflightConfig, chunks: list[ChunkLayout]) -> list[dict]:
    """Per chunk: sizes, padding, buffer bytes and the MXFP8 sharing saving (2 B x numel)."""
    grad_bytes, param_bytes = DTYPE_BYTES[config.grad_dtype], DTYPE_BYTES[config.params_dtype]
    rows = []
    for c in chunks:
        numel = c.layout.numel
        padding = numel - c.param_elements
        # verify/checks/mxfp8.py check_memory: sharing removes the bf16 param buffer, 2 B/element.
        saving = 2 * numel if config.use_distributed_optimizer else 0
        rows.append({
            "stage": c.stage, "chunk": c.chunk, "num_params": len(c.params),
            "param_elements": c.param_elements, "buffer_numel": numel,
            "numel_unpadded": c.layout.numel_unpadded, "padding_elements": padding,
            "padding_fraction": padding / numel, "bucket_rule": c.bucket_rule,
            "layers": len(layers_of_chunk(config, c.stage, c.chunk)),
            # MTP depths on the chunk (multi_token_prediction.py get_mtp_num_layers_to_build):
            # all on the last stage's last chunk.
            "mtp_layers": (config.mtp.mtp_num_layers if config.mtp is not None
                           and (c.stage, c.chunk) == (config.pipeline_model_parallel_size - 1,
                                                      config.virtual_pipeline_model_parallel_size - 1)
                           else 0),
            "bucket_size": c.bucket_size,
            "num_buckets": c.layout.num_buckets,
            "bucket_numels": [end - start for start, end in c.layout.bucket_indices],
            "grad_buffer_bytes": numel * grad_bytes,
            "param_buffer_bytes": ((0 if config.mxfp8_sharing else numel * param_bytes)
                                   if config.use_distributed_optimizer
                                   else c.param_elements * param_bytes),
            "mxfp8_sharing_enabled": config.mxfp8_sharing,
            "mxfp8_sharing_saving_bytes": saving,
        })
    return rows


def optimizer_state_rows(config: PreflightConfig, chunks: list[ChunkLayout],
                         experts: list[ChunkLayout]) -> list[dict]:
    """Per pipeline stage (one rank of it): the fp32 bytes the optimizer keeps beside the
    buffers, over the stage's dense and expert params. Megatron-Core wraps the torch optimizer
    (core/optimizer/__init__.py:638-681) in the DistributedOptimizer (each rank's shard of
    every buffer, over DP x CP, the experts' over expert DP; counted as the padded shard
    numel / N, an upper bound: padding holds no state), else in
    Float16OptimizerWithFloat16Params with 16-bit params (an fp32 copy of every param,
    optimizer.py:1012) or the FP32Optimizer (the params themselves). The main params: fp32
    copies of 16-bit params (distrib_optimizer.py:445; fp32 params are stepped in place,
    :465); the state: :attr:`OptimizerChoice.state_tensors` fp32 tensors of the same size
    (and ``state_bytes_torch_sgd``: without Transformer Engine or apex).

    Under Megatron-FSDP or torch FSDP2 the elements are what :meth:`ShardedDPConfig.memory`
    gives the rank (sharded or not as the strategy says), as in :func:`sharded_rows`, so that
    the two tables agree."""
    choice = config.optimizer
    if config.sharded_dp is not None:
        return _sharded_optimizer_state_rows(config, chunks, experts)
    if config.use_distributed_optimizer:
        wrapper = "DistributedOptimizer"
    elif config.params_dtype != "fp32":
        wrapper = "Float16OptimizerWithFloat16Params"
    else:
        wrapper = "FP32Optimizer"
    rows = []
    for stage in range(config.pipeline_model_parallel_size):
        elements = 0
        for buffers, n in ((chunks, config.data_context_parallel_size),
                           (experts, config.expert_data_parallel_size if experts else 1)):
            for c in buffers:
                if c.stage == stage:
                    elements += (c.layout.numel // n if config.use_distributed_optimizer
                                 else c.param_elements)
        main = 4 * elements if config.params_dtype != "fp32" else 0
        rows.append({
            "stage": stage, "optimizer": choice.name, "wrapper": wrapper,
            "elements": elements, "main_param_bytes": main,
            "state_tensors": list(choice.state_tensors),
            "state_bytes": 4 * len(choice.state_tensors) * elements,
            "state_bytes_torch_sgd": 4 * len(choice.state_tensors_torch) * elements,
        })
    return rows


def _sharded_optimizer_state_rows(config: PreflightConfig, chunks: list[ChunkLayout],
                                  experts: list[ChunkLayout]) -> list[dict]:
    """:func:`optimizer_state_rows` under fully-sharded DP: per stage, the sum over its dense
    chunks (over DP x CP) and expert chunks (over expert DP) of ShardedDPConfig.memory."""
    choice, sharded = config.optimizer, config.sharded_dp
    wrapper = ("DistributedOptimizer" if config.use_distributed_optimizer
               else "Float16OptimizerWithFloat16Params" if config.params_dtype != "fp32"
               else "FP32Optimizer")
    rows = []
    for stage in range(config.pipeline_model_parallel_size):
        elements = main = 0.0
        for buffers, n in ((chunks, config.data_context_parallel_size),
                           (experts, config.expert_data_parallel_size if experts else 1)):
            for c in buffers:
                if c.stage == stage:
                    held = sharded.memory(c.param_elements, n, config.params_dtype, 0)
                    elements += held["optimizer_elements"]
                    main += held["main_param_bytes"]
        elements = int(elements) if elements.is_integer() else elements  # n divides them
        rows.append({
            "stage": stage, "optimizer": choice.name, "wrapper": f"{wrapper} ({sharded.label})",
            "elements": elements, "main_param_bytes": main,
            "state_tensors": list(choice.state_tensors),
            "state_bytes": 4 * len(choice.state_tensors) * elements,
            "state_bytes_torch_sgd": 4 * len(choice.state_tensors_torch) * elements,
        })
    return rows


def activation_bytes(config: PreflightConfig) -> float:
    """One microbatch's activation (or its grad) at a pipeline boundary (a CP rank's share of
    the sequence: schedules.py divides the tensor shape's sequence by CP)."""
    seq = config.seq_length / config.context_parallel_size
    if config.sequence_parallel:
        seq = seq / config.tensor_model_parallel_size
    return config.micro_batch_size * seq * config.hidden_size * DTYPE_BYTES[config.params_dtype]


def wire_rows(config: PreflightConfig, chunks: list[ChunkLayout]) -> list[dict]:
    """Per pipeline stage (one rank of it): bytes each collective sends per step."""
    n, tp = config.data_context_parallel_size, config.tensor_model_parallel_size
    pp, vpp, m = (config.pipeline_model_parallel_size,
                  config.virtual_pipeline_model_parallel_size, config.num_microbatches)
    grad_b = DTYPE_BYTES[config.grad_dtype]
    act_b = DTYPE_BYTES[config.params_dtype]
    boundary = activation_bytes(config)
    rows = []
    for stage in range(pp):
        mine = [c for c in chunks if c.stage == stage]
        bucket_numels = [end - start for c in mine for start, end in c.layout.bucket_indices]
        grad, gather = _bucket_collective_bytes(config, n, bucket_numels)
        embedding = 0.0
        if config.word_embedding_all_reduce and stage in (0, pp - 1):
            embedding = (config.padded_vocab_size // tp) * config.hidden_size * grad_b
        virtual = [c.chunk * pp + stage for c in mine]
        sends_forward = sum(1 for v in virtual if v < pp * vpp - 1)
        sends_backward = sum(1 for v in virtual if v > 0)
        p2p = (sends_forward + sends_backward) * m * boundary
        layers = sum(len(layers_of_chunk(config, c.stage, c.chunk)) for c in mine)
        # Each MTP depth runs a transformer layer (the repeated one N times) on the last stage.
        mtp_runs = config.mtp.mtp_num_layers if config.mtp is not None and stage == pp - 1 else 0
        blocks = layers if config.hybrid is not None else 2 * (layers + mtp_runs)
        tensor = (blocks * m * 4 * (tp - 1) / tp * config.micro_batch_size * config.seq_length
                  / config.context_parallel_size * config.hidden_size * act_b)
        qk_norm = sum(p.numel for c in mine for p in c.params
                      if ".q_layernorm." in p.name or ".k_layernorm." in p.name)
        rows.append({
            "stage": stage, "grad_collective": _grad_collective(config),
            "grad_sync_bytes": grad, "param_all_gather_bytes": gather,
            "embedding_all_reduce_bytes": embedding,
            "qk_layernorm_tp_all_reduce_bytes": 2 * (tp - 1) / tp * qk_norm * grad_b,
            "pipeline_p2p_sent_bytes": p2p,
            "tensor_parallel_bytes": tensor, "layers": layers, "mtp_layer_runs": mtp_runs,
        })
    return rows


def expert_wire_rows(config: PreflightConfig, chunks: list[ChunkLayout]) -> list[dict]:
    """Per pipeline stage (one rank of it): bytes the expert buffers' collectives send per
    step, over the expert-data-parallel group (the formulas of :data:`WIRE_FORMULAS` with
    N = expert DP)."""
    n = config.expert_data_parallel_size
    rows = []
    for stage in range(config.pipeline_model_parallel_size):
        bucket_numels = [end - start for c in chunks if c.stage == stage
                         for start, end in c.layout.bucket_indices]
        grad, gather = _bucket_collective_bytes(config, n, bucket_numels)
        rows.append({
            "stage": stage, "expert_dp": n, "grad_collective": _grad_collective(config),
            "grad_sync_bytes": grad, "param_all_gather_bytes": gather,
        })
    return rows


def sharded_rows(config: PreflightConfig, chunks: list[ChunkLayout]) -> list[dict]:
    """Per (stage, chunk) under Megatron-FSDP or torch FSDP2: what one rank holds and sends per
    step for the chunk's params (:meth:`ShardedDPConfig.memory` and ``.wire`` over DP x CP);
    none under DDP. The chunk's elements are the model's, without Megatron-FSDP's padding."""
    sharded = config.sharded_dp
    if sharded is None:
        return []
    n = config.data_context_parallel_size
    return [{"stage": c.stage, "chunk": c.chunk, "param_elements": c.param_elements,
             **sharded.memory(c.param_elements, n, config.params_dtype,
                              len(config.optimizer.state_tensors)),
             **sharded.wire(c.param_elements, n, config.params_dtype, config.num_microbatches)}
            for c in chunks]


def _grad_collective(config: PreflightConfig) -> str:
    return "reduce-scatter" if config.use_distributed_optimizer else "all-reduce"


def _bucket_collective_bytes(config: PreflightConfig, n: int,
                             bucket_numels: list[int]) -> tuple[float, float]:
    """Bytes one rank sends per step reducing buckets of ``bucket_numels`` over ``n`` ranks
    (a reduce-scatter with the distributed optimizer, else an all-reduce: twice the ring's
    traffic), and for the param all-gather that follows (none without it)."""
    grad_b = DTYPE_BYTES[config.grad_dtype]
    factor = 1 if config.use_distributed_optimizer else 2
    grad = sum(factor * _ring_fraction(n) * s * grad_b for s in bucket_numels)
    gather = (sum(_ring_fraction(n) * s * param_gather_bytes_per_element(config)
                  for s in bucket_numels) if config.use_distributed_optimizer else 0.0)
    return grad, gather


def _gamma_or_none(k: int, unit_roundoff: Fraction) -> float | None:
    """refgrad's Higham ``gamma(k)`` as a float; None (no bound) where it does not exist
    (``k u >= 1``)."""
    try:
        return float(gamma(k, unit_roundoff))
    except ValueError:
        return None


def reduction_error(config: PreflightConfig, expert: bool = False) -> dict:
    """Predicted relative error of the DP gradient reduction (over DP x CP ranks; ``expert``:
    the expert buffers' over expert DP), from the accumulation study's models."""
    n = config.expert_data_parallel_size if expert else config.data_context_parallel_size
    wire = config.grad_dtype
    study_dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(wire)
    wire_format = format_of(study_dtype) if study_dtype else FLOAT32
    u = float(wire_format.unit_roundoff)
    fp32_accumulate = (config.ddp_reduce_scatter_with_fp32_accumulation
                       and config.use_distributed_optimizer)
    if fp32_accumulate:
        method = f"all-to-all + fp32 accumulation, one rounding to {wire}"
        gamma_fp32 = _gamma_or_none(n - 1, FLOAT32.unit_roundoff)
        typical, worst = u, None if gamma_fp32 is None else u + gamma_fp32
        model = "one rounding: u (independent of N); worst u + gamma_fp32(N-1)"
    else:
        method = f"ring {'reduce-scatter' if config.use_distributed_optimizer else 'all-reduce'} in {wire}"
        # N addends, N-1 roundings: Higham & Mary's probabilistic bound is ~sqrt(N-1) u and
        # the deterministic one gamma(N-1), both relative to sum |g|, so typical <= worst.
        typical, worst = math.sqrt(n - 1) * u, _gamma_or_none(n - 1, wire_format.unit_roundoff)
        model = ("typical sqrt(N-1) u (N-1 roundings, Higham & Mary); worst gamma(N-1) = "
                 "(N-1)u/(1-(N-1)u); both relative to sum |g|")
    # How the average is formed (config.grad_averaging): NCCL's ReduceOp.AVG multiplies by a
    # rounded 1/N, a bias on every element on top of the sum's rounding.
    bias = (n * nccl_average_factor(n, wire) - 1) if config.averaging is Averaging.AVG else 0.0
    if expert and config.averaging is Averaging.AVG:
        # distributed_data_parallel.py:205: x EDP/(DP x CP) (a Python float, applied in fp32
        # opmath by the in-place multiply), then AVG over EDP: the product of the two rounded
        # factors against 1/(DP x CP).
        pre = torch.tensor(config.expert_gradient_scaling_factor, dtype=torch.float32).item()
        bias = pre * nccl_average_factor(n, wire) * config.data_context_parallel_size - 1
    if bias:
        typical += abs(bias)
        worst = None if worst is None else worst + abs(bias)
        model += f"; + |bias| {abs(bias):.3g} of ReduceOp.AVG's rounded 1/N"
    if n == 1:
        typical = worst = 0.0
    low, high = min(DEFAULT_DP), max(DEFAULT_DP)
    if study_dtype is None:
        basis = ("model only: `verify accumulation` measures fp16/bf16 wires; an fp32 wire "
                 "follows the same model with u = 2^-24")
    elif low <= n <= high:
        basis = f"within the measured range of `verify accumulation` (N = {low}..{high})"
    else:
        basis = f"extrapolated: N = {n} is beyond the measured N = {low}..{high}"
    return {"method": method, "wire_dtype": wire, "dp": n, "unit_roundoff": u,
            "typical_relative_error": typical, "worst_case_bound": worst, "model": model,
            "basis": basis,
            "averaging": config.expert_grad_averaging if expert else config.grad_averaging,
            "gradient_scaling_factor": (config.expert_gradient_scaling_factor if expert
                                        else config.gradient_scaling_factor),
            "reduce_op": config.grad_reduce_op, "averaging_bias": bias}


def nccl_average_factor(n: int, wire: str) -> float:
    """The factor NCCL's ReduceOp.AVG multiplies every rank's floating-point input by before
    summing: 1/n rounded to float, then to the wire dtype (nccl src/enqueue.cc hostToDevRedOp:
    ncclAvg on float types is ncclDevPreMulSum with ``__float2bfloat16(float(1.0/nRanks))``,
    ``__float2half(...)`` or ``float(1.0/nRanks)``)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[wire]
    return torch.tensor(1.0 / n, dtype=torch.float32).to(dtype).item()

"""Megatron-LM's own answer for one launch: its launch path, run on the CPU.

Stages, in Megatron's order (the first that raises is the verdict):

1. ``argparse``: ``megatron.training.arguments.parse_args`` on the launch's flags,
   with ``WORLD_SIZE`` and ``RANK=0`` as a launcher sets them;
2. ``validate_args``: ``megatron.training.arguments.validate_args``;
3. ``microbatches``: ``megatron.core.num_microbatches_calculator``'s calculator, built as
   ``megatron/training/global_vars.py set_global_variables`` builds it;
4. ``TransformerConfig``: ``megatron.training.argument_utils.core_transformer_config_from_args``
   (TransformerConfig and ModelParallelConfig ``__post_init__``);
5. ``layer split``: ``megatron.core.transformer.transformer_block.get_num_layers_to_build``
   and ``transformer_layer.get_transformer_layer_offset`` for every (pipeline rank, virtual
   stage), as ``get_model`` builds the chunks;
6. ``model build``: the ``divide()`` calls with which Megatron-Core's modules split their
   weights over TP (``megatron/core/tensor_parallel/layers.py`` Column/RowParallelLinear and
   VocabParallelEmbedding, ``megatron/core/transformer/attention.py Attention.__init__``),
   and, under ``--transformer-impl transformer_engine`` (the default), Transformer Engine's
   ``DotProductAttention`` assert "The number of attention heads must be divisible by the
   number of GQA groups!", restated on the shapes of the GPT layer (building the model needs
   a GPU);
7. ``DDP config``: ``megatron.training.training.get_megatron_ddp_config`` and the bucket size
   of ``resolve_ddp_bucket_size``, which ``get_model`` makes after the model;
8. ``DDP wrap``: ``DistributedDataParallel.__init__``'s assert on per-token loss with
   averaging in the collective and its gradient scaling factor, and the collective's op
   (restated: the wrap needs process groups and a GPU);
8b. ``optimizer``: with ``--optimizer sgd``, ``get_megatron_optimizer``'s torch SGD built by
   Megatron's own code on one CPU param, then the distributed
   optimizer's Adam-only assert (:func:`_build_optimizer`);
9. ``interleaved schedule``: the two checks on M at the top of
   ``megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving``
   at the first step (that function needs CUDA and process groups before it reaches them, so
   their conditions are restated here, verbatim).

With experts, after the microbatch calculator, ``parallel state``: the expert grid of
``megatron/core/parallel_state.py initialize_model_parallel`` (world // (ETP x EP x PP),
refused when it does not divide; restated verbatim, the function needs torch.distributed),
and in ``model build`` the MoE layer pattern of ``gpt_layer_specs.py`` and the experts' and
shared experts' ``divide()``s.

With a hybrid pattern (``--hybrid-layer-pattern``), ``layer split`` is Megatron-Core's own
``select_pipeline_segment`` (hybrid_layer_allocation.py) for every (pipeline rank, virtual
stage), ``model build`` the divides of the layer kinds the pattern builds and the Mamba
mixer's asserts (mamba_mixer.py:239-272, restated verbatim: the mixer needs mamba_ssm and a
GPU), and each chunk's dense buffer is laid out by Megatron-Core's own
``DistributedOptimizer.compute_full_param_layout`` on meta tensors whose shapes are restated
from hybrid_model.py, hybrid_layer_specs.py, mamba_mixer.py and the attention/MLP modules
(``hybrid_layout``).
With ``--use-megatron-fsdp`` or ``--use-torch-fsdp2`` (``get_model`` wraps the chunks in
Megatron-FSDP or torch FSDP2, training.py:1837-1844): no bucket size for torch FSDP2
(:1848), and the averaging as the wrapper forms it: Megatron-FSDP's scaling factor
(megatron_fsdp.py:370-384) through Megatron's own ``gradient_reduce_preprocessing``, torch
FSDP2's through torch's own ``_get_gradient_divide_factors``; such a launch runs without
``CUDA_DEVICE_MAX_CONNECTIONS`` (validate_args asserts it unset or > 1 under FSDP).
With multi-token prediction (``--mtp-num-layers``), the ``layer split`` stage also asks
Megatron-Core's own ``multi_token_prediction.get_mtp_num_layers_to_build`` for every
(pipeline rank, virtual stage) (``parallel_state``'s pipeline rank and sizes set through its
own setters), ``model build`` restates ``eh_proj``'s ``divide()`` of h over TP, and the
figures carry whether the first and last stage all-reduce the word embeddings' grads:
Megatron-Core's own ``finalize_model_grads._get_shared_word_embedding_weight`` on a stand-in
module (tied or MTP), over an embedding group of more than one rank (PP > 1,
``parallel_state.default_embedding_ranks``).

The figures of an accepted launch: DP, CP, M, VPP, layers (and first layer index) per
pipeline rank and virtual stage, each model chunk's DDP bucket size as
``megatron/training/training.py get_model`` sets it, and how the grads are averaged (the
DDP's pre-scale factor, the collective's op, per-token loss); with experts, the expert DP
size, each chunk's expert buffer (its elements and, with the distributed optimizer,
Megatron-Core's own layout of it: ``DistributedOptimizer.compute_full_param_layout`` on
meta tensors) and the expert gradient scaling factor.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback

import hybrid_side
import megatron_env


class _Group:
    """A process group that only knows its size (all resolve_ddp_bucket_size asks)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _refused(stage: str, exc: BaseException, captured: str = "") -> dict:
    text = str(exc) or type(exc).__name__
    if stage == "argparse":
        text = captured.strip().splitlines()[-1] if captured.strip() else text
    return {"accepted": False, "stage": stage, "error": f"{type(exc).__name__}: {text}"[:400]}


def megatron_verdict(argv: list[str], world_size: int, env: dict | None = None) -> dict:
    """Megatron-LM's verdict on ``argv`` (the flags after the training script) at ``world_size``;
    ``env``: variables the launch script exports ("unset" removes one)."""
    megatron_env.load()
    from megatron.core.num_microbatches_calculator import _build_num_microbatches_calculator
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.core.utils import divide
    from megatron.training import argument_utils, arguments, training

    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), "0"
    # validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 for TP or CP > 1 under DDP and
    # "unset or > 1" under either FSDP (arguments.py:1014, :1143): the launch sets it as its
    # data-parallel mode needs (the FSDP example unsets it), unless its script says otherwise.
    sharded = "--use-megatron-fsdp" in argv or "--use-torch-fsdp2" in argv
    connections = "unset" if sharded else "1"
    for name, value in {"CUDA_DEVICE_MAX_CONNECTIONS": connections, **(env or {})}.items():
        if value == "unset":
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    sys.argv = ["pretrain_gpt.py", *argv]
    sink = io.StringIO()
    stage = "argparse"
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            args = arguments.parse_args()
            stage = "validate_args"
            arguments.validate_args(args)
            stage = "microbatches"
            # megatron/training/global_vars.py set_global_variables.
            calculator = _build_num_microbatches_calculator(
                0, args.global_batch_size, args.micro_batch_size,
                args.data_parallel_size * args.gtp_weight_remat_size,
                args.decrease_batch_size_if_needed, args.step_batch_size_schedule,
                args.seq_length)
            m = calculator.get()
            stage = "parallel state"
            expert_dp = _expert_grid(args) if args.num_experts is not None else None
            stage = "TransformerConfig"
            config = argument_utils.core_transformer_config_from_args(args)
            stage = "layer split"
            pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
            chunks = vpp or 1
            layers, offsets = [], []
            hybrid = args.hybrid_layer_pattern is not None
            if hybrid:
                layers, offsets, kinds = hybrid_side.split(config, args, pp, vpp)
            for pp_rank in range(pp if not hybrid else 0):
                per_stage, first = [], []
                for chunk in range(chunks):
                    vp_stage = chunk if vpp is not None else None
                    per_stage.append(get_num_layers_to_build(config, vp_stage=vp_stage,
                                                             pp_rank=pp_rank))
                    first.append(get_transformer_layer_offset(config, vp_stage=vp_stage,
                                                              pp_rank=pp_rank))
                layers.append(per_stage)
                offsets.append(first)
            mtp_layers = _mtp_layers(config, pp, chunks)
            stage = "model build"
            if hybrid:
                hybrid_side.divide_like_the_model(config, args, divide, kinds)
            else:
                _divide_like_the_model(config, args, divide)
            if config.mtp_num_layers:
                # multi_token_prediction.py:1000 eh_proj, a ColumnParallelLinear(2h -> h).
                divide(config.hidden_size, config.tensor_model_parallel_size)
            stage = "DDP config"
            ddp_config = training.get_megatron_ddp_config(args)
            training.get_pg_size = lambda group=None: group.size()
            dp_cp = args.data_parallel_size * args.context_parallel_size
            # get_model:1848: no bucket size for torch FSDP2 (its own config has none).
            bucket = None if args.use_torch_fsdp2 else training.resolve_ddp_bucket_size(
                ddp_config, _Group(dp_cp), ddp_config.overlap_grad_reduce, num_parameters=0)
            # megatron/training/training.py get_model: per-chunk bucket sizes.
            buckets = [[None if (chunk > 0 or args.overlap_param_gather_with_optimizer_step
                                 or pp_rank > 0) else bucket for chunk in range(chunks)]
                       for pp_rank in range(pp)]
            expert_layout = (_expert_layouts(config, args, ddp_config, layers, offsets, buckets,
                                             mtp_layers,
                                             expert_dp)
                             if expert_dp is not None else None)
            hybrid_layout = (hybrid_side.layouts(config, args, ddp_config, kinds, buckets, dp_cp)
                             if hybrid else None)
            stage = "DDP wrap"
            if args.use_torch_fsdp2:  # get_model:1837-1844: which wrapper
                scaling = _torch_fsdp2_scaling(config, dp_cp)
            elif args.use_megatron_fsdp:
                scaling = _megatron_fsdp_scaling(config, ddp_config, dp_cp)
            else:
                scaling = _ddp_scaling(config, ddp_config, dp_cp)
            expert_scaling = (_expert_scaling(config, ddp_config, dp_cp, expert_dp)
                              if expert_layout else None)
            stage = "optimizer"
            _build_optimizer(args)
            if vpp is not None and pp > 1:
                stage = "interleaved schedule"
                group = config.microbatch_group_size_per_vp_stage
                if group > m or group < pp:
                    raise ValueError("The number of contiguous micro-batches in a virtual "
                                     f"pipeline stage should range in [PP={pp} , M={m}]")
                final = m % group
                if 0 < final < pp:
                    raise RuntimeError(f"The remainder of M divided by N should be 0, or larger "
                                       f"than or equal to the pipeline-parallel size, but it is "
                                       f"{final}.")
    except SystemExit as exc:
        return _refused(stage, exc, sink.getvalue())
    except Exception as exc:  # noqa: BLE001 - any raise is Megatron's refusal
        out = _refused(stage, exc)
        if stage not in ("validate_args", "microbatches", "parallel state", "TransformerConfig",
                         "layer split",
                         "model build", "DDP config", "DDP wrap", "optimizer",
                         "interleaved schedule"):
            out["traceback"] = traceback.format_exc()
        return out
    return {"accepted": True, "dp": args.data_parallel_size, "cp": args.context_parallel_size,
            "m": m, "vpp": vpp or 1, "layers": layers, "offsets": offsets,
            "bucket_sizes": buckets, "grad_scaling": scaling, "expert_dp": expert_dp,
            "expert_layout": expert_layout, "expert_scaling": expert_scaling,
            "hybrid_layout": hybrid_layout, "mtp_layers": mtp_layers,
            "embedding_sync": _embedding_sync(config, args)}


def _build_optimizer(args) -> None:
    """``get_megatron_optimizer``'s build of the torch optimizer, run: Megatron-LM's own
    ``get_megatron_optimizer_config`` (OptimizerConfig's ``__post_init__``) and
    ``_get_megatron_optimizer_based_on_param_groups(..., skip_megatron_wrapping=True)`` on
    one CPU param, for SGD (torch's class here, as Megatron-Core imports it without
    Transformer Engine or apex, whose FusedSGD checks lr, momentum and weight decay alike);
    then, with the distributed optimizer,
    ``DistributedOptimizer.__init__``'s assert (distrib_optimizer.py:688-694), restated
    verbatim on the built optimizer and the module's own classes (the constructor needs
    CUDA before it). The grad scaler between them is not built (it needs CUDA)."""
    import torch
    from megatron.core.optimizer import (
        _get_megatron_optimizer_based_on_param_groups,
        distrib_optimizer,
    )
    from megatron.training import training

    config, _ = training.get_megatron_optimizer_config(args)
    if config.optimizer != "sgd":
        # Adam is not built: torch's AdamW (here) refuses a missing --lr, which Transformer
        # Engine's FusedAdam (production's) need not, and preflight does not model it; the
        # distributed optimizer's assert passes Adam. Other optimizers are built elsewhere
        # (layer-wise); preflight refuses them as not modelled.
        return
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer, init_state_fn = _get_megatron_optimizer_based_on_param_groups(
        config, [], [{"params": [param]}], skip_megatron_wrapping=True)
    if config.use_distributed_optimizer:
        Adam, HybridDeviceOptimizer = distrib_optimizer.Adam, distrib_optimizer.HybridDeviceOptimizer
        assert (
            isinstance(optimizer, (Adam, torch.optim.AdamW, HybridDeviceOptimizer))
            or optimizer is None
            or init_state_fn is not None
        ), (
            "Only Adam, HybridDeviceOptimizer, and optimizers with an init_state_fn "
            "(e.g., Lion) are currently supported, due to checkpointing requirements."
        )


def _mtp_layers(config, pp: int, chunks: int) -> list:
    """Megatron-Core's get_mtp_num_layers_to_build for every (pipeline rank, virtual stage),
    its parallel_state told the rank and sizes through its own setters (0 everywhere without
    MTP)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import get_mtp_num_layers_to_build

    parallel_state.set_pipeline_model_parallel_world_size(pp)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(
        config.virtual_pipeline_model_parallel_size)
    grid = []
    try:
        for pp_rank in range(pp):
            parallel_state.set_pipeline_model_parallel_rank(pp_rank)
            vpp = config.virtual_pipeline_model_parallel_size
            grid.append([get_mtp_num_layers_to_build(config, vp_stage=chunk if vpp else None)
                         for chunk in range(chunks)])
    finally:
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)
    return grid


class _LanguageModule:
    """The two attributes finalize_model_grads reads of a model chunk to find its shared
    word embedding."""

    def __init__(self, tied: bool) -> None:
        self.share_embeddings_and_output_weights = tied

    def shared_embedding_or_output_weight(self) -> str:
        return "the word embeddings"


def _embedding_sync(config, args) -> bool:
    """Whether finalize_model_grads all-reduces the word embeddings' grads between stages:
    its own _get_shared_word_embedding_weight (tied embeddings or MTP) finds a weight, and the
    embedding group (first and last pipeline stage) has more than one rank."""
    from megatron.core.distributed.finalize_model_grads import _get_shared_word_embedding_weight
    from megatron.core.parallel_state import default_embedding_ranks

    module = _LanguageModule(not args.untie_embeddings_and_output_weights)
    shared = _get_shared_word_embedding_weight(module, config) is not None
    return shared and len(default_embedding_ranks(list(range(args.pipeline_model_parallel_size)))) > 1


def _ddp_scaling(config, ddp_config, dp_cp: int) -> list:
    """[the factor DDP pre-scales each bucket's grads by, the collective's op, per-token loss],
    from Megatron's own TransformerConfig and DDP config, by the rules of
    megatron/core/distributed/distributed_data_parallel.py:179-216 (its assert on per-token
    loss with averaging included) and param_and_grad_buffer.py:664-666 (restated: the wrap
    needs process groups and a GPU)."""
    if config.calculate_per_token_loss:
        assert not ddp_config.average_in_collective, (
            "Cannot average in collective when calculating per-token loss!")
        factor = 1.0
    elif ddp_config.average_in_collective:
        factor = 1.0
    else:
        factor = 1.0 / dp_cp
    op = "AVG" if ddp_config.average_in_collective else "SUM"
    return [factor, op, bool(config.calculate_per_token_loss)]


def _megatron_fsdp_scaling(config, ddp_config, dp_cp: int) -> list:
    """[factor, op, per-token loss] of Megatron-FSDP: megatron_fsdp.py:370-384
    _init_fsdp_param_and_grad_buffer's gradient_scaling_factor (restated: it needs process
    groups), then Megatron's own ``gradient_reduce_preprocessing`` (param_and_grad_buffer.py)
    on a one-element grad of the dtype the grads cross the wire in (mcore_fsdp_adapter.py's
    MixedPrecisionPolicy: main grads default to the params' dtype, the wire to the main grads')."""
    import torch
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        gradient_reduce_preprocessing,
    )

    if config.calculate_per_token_loss:
        factor = None
    elif ddp_config.average_in_collective:
        factor = 1.0
    else:
        factor = 1.0 / dp_cp
    grads = ddp_config.megatron_fsdp_main_grads_dtype or config.params_dtype
    wire = ddp_config.megatron_fsdp_grad_comm_dtype or grads
    op = gradient_reduce_preprocessing(torch.ones(1, dtype=wire), factor, ddp_config)
    names = {torch.distributed.ReduceOp.SUM: "SUM", torch.distributed.ReduceOp.AVG: "AVG"}
    return [1.0 if factor is None else factor, names.get(op, "PREMUL_SUM"),
            bool(config.calculate_per_token_loss)]


def _torch_fsdp2_scaling(config, dp_cp: int) -> list:
    """[factor, op, per-token loss] of torch FSDP2 as TorchFullyShardedDataParallel calls
    fully_shard (no MixedPrecisionPolicy: grads reduced in the params' dtype, over the DP x CP
    group): torch's own ``_get_gradient_divide_factors`` on a group of that size."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    pre, _, op, _ = _get_gradient_divide_factors(_Group(dp_cp), None, config.params_dtype)
    name = "AVG" if op == torch_reduce_op("AVG") else "SUM" if op == torch_reduce_op("SUM") else str(op)
    return [1.0 if pre is None else 1.0 / pre, name, bool(config.calculate_per_token_loss)]


def torch_reduce_op(name: str):
    import torch

    return getattr(torch.distributed.ReduceOp, name)


def _expert_grid(args) -> int:
    """megatron/core/parallel_state.py:871-883 initialize_model_parallel, verbatim on the args
    (it needs torch.distributed): the expert grid's data-parallel size."""
    world_size = args.world_size
    expert_tensor_parallel_size = args.expert_tensor_parallel_size
    if expert_tensor_parallel_size is None:
        expert_tensor_parallel_size = args.tensor_model_parallel_size
    expert_tensor_model_pipeline_parallel_size = (
        expert_tensor_parallel_size * args.expert_model_parallel_size
        * args.pipeline_model_parallel_size * getattr(args, "expert_gtp_weight_remat_size", 1))
    expert_data_parallel_size = world_size // expert_tensor_model_pipeline_parallel_size
    if world_size % expert_tensor_model_pipeline_parallel_size != 0:
        raise RuntimeError(f"world_size ({world_size}) is not divisible by "
                           "expert_tensor_model_pipeline_parallel size "
                           f"({expert_tensor_model_pipeline_parallel_size})")
    return expert_data_parallel_size


def _moe_layer_pattern(config) -> list[int]:
    """megatron/core/models/gpt/gpt_layer_specs.py:643-671 get_gpt_decoder_layer_specs,
    verbatim (the function builds Transformer Engine specs around it)."""
    if isinstance(config.moe_layer_freq, int):
        moe_layer_pattern = [
            1 if (i % config.moe_layer_freq == 0) else 0 for i in range(config.num_layers)]
    elif isinstance(config.moe_layer_freq, list):
        moe_layer_pattern = config.moe_layer_freq
        assert len(moe_layer_pattern) == config.num_layers, (
            f"Invalid length of moe_layer_pattern: {len(moe_layer_pattern)}, "
            f"expected {config.num_layers}, current moe layer pattern: {config.moe_layer_freq}")
    else:
        raise ValueError(f"Invalid moe_layer_freq: {type(config.moe_layer_freq)}, "
                         f"{config.moe_layer_freq}")
    for layer_number in range(config.num_layers):
        if moe_layer_pattern[layer_number] not in (0, 1):
            raise ValueError(f"Invalid layer pattern: {moe_layer_pattern}")
    return moe_layer_pattern


def _expert_layouts(config, args, ddp_config, layers, offsets, buckets, mtp_layers,
                    expert_dp) -> list:
    """Each (pipeline rank, virtual stage)'s expert buffer as Megatron-Core lays it out:
    [param elements, buffer numel, buckets] (numel and buckets only with the distributed
    optimizer, whose layout ``DistributedOptimizer.compute_full_param_layout`` computes, run
    here on meta tensors: it groups the ``allreduce=False`` params into the expert buffer and
    pads it over ``expert_data_parallel_world_size``), None where the chunk has no expert
    params. The experts' params are restated from moe_layer.py / experts.py on Megatron's
    TransformerConfig: per local expert (num_moe_experts // EP) fc1 [moe_ffn x (2 if gated) /
    ETP, h] and fc2 [h, moe_ffn / ETP] (with biases under add_bias_linear), SequentialMLP's
    order, or TEGroupedMLP's (every fc1, then every fc2) under --moe-grouped-gemm with the
    transformer_engine impl; allreduce = not (EP > 1 or ETP != TP) (layers.py:961)."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    pattern = _moe_layer_pattern(config)
    etp = config.expert_tensor_parallel_size
    use_expert_pgs = (config.expert_model_parallel_size > 1
                      or etp != config.tensor_model_parallel_size)
    if not use_expert_pgs:
        return []  # the experts' params are ordinary params in the dense buffers
    local = config.num_moe_experts // config.expert_model_parallel_size
    ffn = config.moe_ffn_hidden_size
    fc1 = (ffn * (2 if config.gated_linear_unit else 1) // etp, config.hidden_size)
    fc2 = (config.hidden_size, ffn // etp)
    grouped = args.moe_grouped_gemm and args.transformer_impl == "transformer_engine"

    def param(shape):
        p = torch.nn.Parameter(torch.empty(shape, device="meta", dtype=config.params_dtype))
        p.allreduce = False
        return p

    def expert_params():
        bias = config.add_bias_linear
        if grouped:
            return ([param(fc1) for _ in range(local)] + [param(fc1[:1]) for _ in range(local) if bias]
                    + [param(fc2) for _ in range(local)]
                    + [param(fc2[:1]) for _ in range(local) if bias])
        out = []
        for _ in range(local):
            out += [param(fc1)] + ([param(fc1[:1])] if bias else [])
            out += [param(fc2)] + ([param(fc2[:1])] if bias else [])
        return out

    grid = []
    for pp_rank, (counts, firsts) in enumerate(zip(layers, offsets)):
        row = []
        for chunk, (count, first) in enumerate(zip(counts, firsts)):
            params = [p for i in range(first, first + count) if pattern[i] for p in expert_params()]
            # MTP layers are of the decoder's last layer's spec (megatron/training/models/gpt.py
            # mtp_block_spec: decoder_specs[-1]); one layer under --mtp-use-repeated-layer.
            if mtp_layers[pp_rank][chunk] and pattern[-1]:
                built = 1 if config.mtp_use_repeated_layer else mtp_layers[pp_rank][chunk]
                params += [p for _ in range(built) for p in expert_params()]
            if not params:
                row.append(None)
                continue
            elements = sum(p.numel() for p in params)
            if not ddp_config.use_distributed_optimizer:
                row.append([elements, None, None])
                continue
            full = DistributedOptimizer.compute_full_param_layout(
                params, buckets[pp_rank][chunk], expert_dp, ddp_config,
                expert_data_parallel_world_size=expert_dp)
            ((key, layout),) = full.layouts.items()
            assert key.is_expert_parallel
            row.append([elements, layout.bucket_indices[-1][1], len(layout.bucket_indices)])
        grid.append(row)
    return grid


def _expert_scaling(config, ddp_config, dp_cp: int, expert_dp: int) -> float:
    """distributed_data_parallel.py:185-216's expert_gradient_scaling_factor (restated: the
    wrap needs process groups and a GPU)."""
    if config.calculate_per_token_loss:
        return 1.0
    if ddp_config.average_in_collective:
        return expert_dp / dp_cp
    return 1.0 / dp_cp


def _divide_like_the_model(config, args, divide) -> None:
    """The divide() calls of the GPT layer's modules over TP (see the module docstring)."""
    tp = config.tensor_model_parallel_size
    if args.transformer_impl == "transformer_engine":
        assert config.num_attention_heads % config.num_query_groups == 0, (
            "The number of attention heads must be divisible by the number of GQA groups!")
    q = config.kv_channels * config.num_attention_heads
    kv = config.kv_channels * config.num_query_groups
    divide(q, config.num_attention_heads)  # Attention: hidden_size_per_attention_head
    if config.num_query_groups < tp:
        divide(config.num_attention_heads, config.num_query_groups)
    else:
        divide(config.num_query_groups, tp)
        divide(config.num_attention_heads, tp)
    divide(q + 2 * kv, tp)  # linear_qkv: ColumnParallelLinear output
    divide(q, tp)  # linear_proj: RowParallelLinear input
    ffn = config.ffn_hidden_size
    divide(ffn * (2 if config.gated_linear_unit else 1), tp)  # linear_fc1: ColumnParallel
    divide(ffn, tp)  # linear_fc2: RowParallelLinear input
    if args.padded_vocab_size is not None:
        divide(args.padded_vocab_size, tp)  # VocabParallelEmbedding and the output layer
    if config.num_moe_experts is not None:
        _moe_layer_pattern(config)  # gpt_layer_specs.py, before the layers are built
        etp = config.expert_tensor_parallel_size
        moe_ffn = config.moe_ffn_hidden_size
        divide(moe_ffn * (2 if config.gated_linear_unit else 1), etp)  # experts' fc1 over ETP
        divide(moe_ffn, etp)  # experts' fc2
        shared = config.moe_shared_expert_intermediate_size
        if shared is not None:
            # shared_experts.py:124 SharedExpertMLP.__init__, then its MLP over TP.
            assert config.add_bias_linear == False, (  # noqa: E712 - Megatron's own assert
                "bias is not supported in the shared experts, ")
            divide(shared * (2 if config.gated_linear_unit else 1), tp)
            divide(shared, tp)

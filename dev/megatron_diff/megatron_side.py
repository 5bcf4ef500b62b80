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
9. ``interleaved schedule``: the two checks on M at the top of
   ``megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving``
   at the first step (that function needs CUDA and process groups before it reaches them, so
   their conditions are restated here, verbatim).

The figures of an accepted launch: DP, CP, M, VPP, layers (and first layer index) per
pipeline rank and virtual stage, each model chunk's DDP bucket size as
``megatron/training/training.py get_model`` sets it, and how the grads are averaged (the
DDP's pre-scale factor, the collective's op, per-token loss).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback

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
    for name, value in {"CUDA_DEVICE_MAX_CONNECTIONS": "1", **(env or {})}.items():
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
            stage = "TransformerConfig"
            config = argument_utils.core_transformer_config_from_args(args)
            stage = "layer split"
            pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
            chunks = vpp or 1
            layers, offsets = [], []
            for pp_rank in range(pp):
                per_stage, first = [], []
                for chunk in range(chunks):
                    vp_stage = chunk if vpp is not None else None
                    per_stage.append(get_num_layers_to_build(config, vp_stage=vp_stage,
                                                             pp_rank=pp_rank))
                    first.append(get_transformer_layer_offset(config, vp_stage=vp_stage,
                                                              pp_rank=pp_rank))
                layers.append(per_stage)
                offsets.append(first)
            stage = "model build"
            _divide_like_the_model(config, args, divide)
            stage = "DDP config"
            ddp_config = training.get_megatron_ddp_config(args)
            training.get_pg_size = lambda group=None: group.size()
            dp_cp = args.data_parallel_size * args.context_parallel_size
            bucket = training.resolve_ddp_bucket_size(
                ddp_config, _Group(dp_cp), ddp_config.overlap_grad_reduce, num_parameters=0)
            # megatron/training/training.py get_model: per-chunk bucket sizes.
            buckets = [[None if (chunk > 0 or args.overlap_param_gather_with_optimizer_step
                                 or pp_rank > 0) else bucket for chunk in range(chunks)]
                       for pp_rank in range(pp)]
            stage = "DDP wrap"
            scaling = _ddp_scaling(config, ddp_config, dp_cp)
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
        if stage not in ("validate_args", "microbatches", "TransformerConfig", "layer split",
                         "model build", "DDP config", "DDP wrap", "interleaved schedule"):
            out["traceback"] = traceback.format_exc()
        return out
    return {"accepted": True, "dp": args.data_parallel_size, "cp": args.context_parallel_size,
            "m": m, "vpp": vpp or 1, "layers": layers, "offsets": offsets,
            "bucket_sizes": buckets, "grad_scaling": scaling}


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

"""A parsed launch resolved into a :class:`PreflightConfig`, as Megatron-LM's validate_args does it.

Defaults and silent adjustments follow ``megatron/training/arguments.py
validate_args`` of Megatron-LM core_r0.19.0; each adjustment is recorded in
``notes``. The world size is the launcher's (Megatron reads ``WORLD_SIZE``):
preflight is told it by ``--world-size`` (its own option), ``WORLD_SIZE``
under torchrun, or the torchrun line at the head of an args file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from verify.preflight.config import (
    DEFAULT_CLIP_GRAD,
    DEFAULT_HYSTERESIS,
    DEFAULT_INITIAL_LOSS_SCALE,
    DEFAULT_LOSS_SCALE_WINDOW,
    DEFAULT_MIN_LOSS_SCALE,
    ConfigError,
    PreflightConfig,
    flag_name,
    pad_vocab_size,
    parallel_dims,
)
from verify.preflight.flags import ParsedFlags
from verify.preflight.pipeline_split import SplitError, virtual_pipeline_size

# validate_args: 'no longer valid' flags, and what replaced them.
_REMOVED = {"batch_size": "--micro-batch-size", "model_parallel_size": "--tensor-model-parallel-size",
            "checkpoint_activations": "--recompute-activations (or --recompute-granularity)"}


def _world(parsed: ParsedFlags, environ: Mapping[str, str],
           world_size: int | None) -> tuple[int, str]:
    """The world size and where it came from (Megatron: ``int(os.getenv("WORLD_SIZE"))``)."""
    if world_size is not None:
        return world_size, "--world-size"
    if environ.get("WORLD_SIZE"):
        try:
            return int(environ["WORLD_SIZE"]), "WORLD_SIZE (torchrun)"
        except ValueError:
            raise ConfigError(f"WORLD_SIZE must be an integer, got {environ['WORLD_SIZE']!r}") from None
    if parsed.launcher_world_size is not None:
        return parsed.launcher_world_size, "the launcher's --nproc-per-node x --nnodes"
    raise ConfigError("the world size is unknown: Megatron-LM takes it from the launcher "
                      "(WORLD_SIZE) and derives DP = world / (TP x PP x CP); give verify "
                      "preflight --world-size N, or run it under torchrun")


def _required(v: dict, spelling: Mapping[str, str], dest: str) -> object:
    if v.get(dest) is None:
        raise ConfigError(f"{flag_name(dest, spelling)} is required (megatron/training/arguments.py "
                          "validate_args)")
    return v[dest]


def _batch(v: dict, spelling: Mapping[str, str], dp: int) -> tuple[int, int]:
    """(micro batch, global batch): validate_args and the microbatch calculator's inputs."""
    n = lambda dest: flag_name(dest, spelling)  # noqa: E731
    schedule = v.get("step_batch_size_schedule")
    if schedule is not None and "global_batch_size" in v:
        raise ConfigError(f"{n('step_batch_size_schedule')} and {n('global_batch_size')} cannot "
                          "both be given (validate_args)")
    if schedule is not None:
        raise ConfigError(f"{n('step_batch_size_schedule')} {schedule!r}: not modelled: the "
                          "global batch, and with it the number of microbatches, changes during "
                          "training; preflight lays out one (Megatron-Core's grad-ready counts, "
                          "learned on the first batch, also break when M changes)")
    mbs = _required(v, spelling, "micro_batch_size")
    if mbs <= 0:
        raise ConfigError(f"{n('micro_batch_size')} must be > 0, got {mbs}")
    gbs = v.get("global_batch_size", mbs * dp)
    if gbs <= 0:
        raise ConfigError(f"{n('global_batch_size')} must be > 0, got {gbs}")
    eval_mbs = v.get("eval_micro_batch_size", mbs)
    eval_gbs = v.get("eval_global_batch_size", gbs)
    # Without an eval flag or --decrease-batch-size-if-needed this is the training batch's
    # rule, which rules.py names; validate_args checks it even when the training batch
    # would be rounded down.
    checked = ("eval_micro_batch_size" in v or "eval_global_batch_size" in v
               or v.get("decrease_batch_size_if_needed"))
    if checked and (eval_mbs * dp <= 0 or eval_gbs % (eval_mbs * dp)):
        raise ConfigError(f"the evaluation batch {eval_gbs} ({n('eval_global_batch_size')}, default "
                          f"{n('global_batch_size')}) must be divisible by {n('eval_micro_batch_size')}"
                          f" (default {n('micro_batch_size')}) {eval_mbs} x DP {dp} (validate_args, "
                          "before --decrease-batch-size-if-needed rounds the training batch)")
    return mbs, gbs


def _one_of(v: dict, spelling: Mapping[str, str], dest: str, alias: str) -> int:
    """A value given by its flag or Megatron's older alias (validate_args: not both)."""
    if v.get(dest) is not None and v.get(alias) is not None:
        raise ConfigError(f"{flag_name(dest, spelling)} and {flag_name(alias, spelling)} cannot "
                          "both be given (validate_args)")
    value = v.get(dest, v.get(alias))
    if value is None:
        raise ConfigError(f"{flag_name(dest, spelling)} is required (validate_args)")
    return value


def _position_embedding(v: dict, spelling: Mapping[str, str]) -> str:
    kind = v.get("position_embedding_type", "learned_absolute")
    if v.get("use_rotary_position_embeddings"):
        kind = "rope"  # validate_args: legacy RoPE flag
    if v.get("add_position_embedding") is False and kind != "rope":
        raise ConfigError("--no-position-embedding is deprecated, use --position-embedding-type "
                          "(validate_args)")
    if kind == "relative":
        raise ConfigError("--position-embedding-type relative: not modelled: relative attention "
                          "bias parameters are not laid out by preflight")
    if kind == "mrope" and v.get("mrope_section") is None:
        raise ConfigError("--position-embedding-type mrope needs --mrope-section (validate_args)")
    return kind


def _precision(v: dict, notes: list[str]) -> tuple[str, str]:
    """(params dtype, main-grad dtype), as validate_args sets them."""
    if v.get("bf16") and v.get("fp16"):  # validate_args: `assert not args.bf16` under fp16
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    params = "bf16" if v.get("bf16") else "fp16" if v.get("fp16") else "fp32"
    # validate_args: with --bf16 and the default --main-grads-dtype fp32, grads are accumulated
    # and all-reduced in fp32 unless --grad-reduce-in-bf16.
    accumulate_fp32 = bool(v.get("accumulate_allreduce_grads_in_fp32"))
    if params == "bf16":
        if v.get("grad_reduce_in_bf16"):
            accumulate_fp32 = False
        elif not accumulate_fp32:
            accumulate_fp32 = True
            notes.append("--bf16: Megatron accumulates and reduces grads in fp32 "
                         "(--grad-reduce-in-bf16 not given)")
    return params, "fp32" if accumulate_fp32 or params == "fp32" else params


def _fp8(v: dict, notes: list[str]) -> tuple[str | None, str | None]:
    """(--fp8-format, the recipe): FP8 is on only with --fp8-format (Megatron's args.fp8);
    --fp8-recipe defaults to delayed."""
    fmt = v.get("fp8")
    if fmt is None:
        if "fp8_recipe" in v:
            notes.append(f"--fp8-recipe {v['fp8_recipe']} has no effect: FP8 is off without "
                         "--fp8-format")
        return None, None
    return fmt, v.get("fp8_recipe", "delayed")


def _vocab(v: dict, spelling: dict, tp: int, notes: list[str]) -> int:
    if "padded_vocab_size" in v:
        return v["padded_vocab_size"]
    if "vocab_size" in v:
        vocab = pad_vocab_size(v["vocab_size"], v.get("make_vocab_size_divisible_by", 128), tp)
        notes.append(f"--vocab-size {v['vocab_size']} padded to {vocab} (multiple of "
                     f"--make-vocab-size-divisible-by x TP)")
        spelling["padded_vocab_size"] = "--vocab-size"
        return vocab
    raise ConfigError("the vocabulary size is unknown: Megatron reads it from the tokenizer's "
                      "files, which preflight does not; give --padded-vocab-size N (the 'padded "
                      "vocab (size: ...)' of Megatron's log) or --vocab-size N")


def resolve(parsed: ParsedFlags, environ: Mapping[str, str],
            world_size: int | None = None) -> PreflightConfig:
    """Apply Megatron's defaults and adjustments to the parsed flags; validate the result.
    ``world_size``: preflight's --world-size (else WORLD_SIZE, else the launcher line)."""
    v, spelling = dict(parsed.values), dict(parsed.spelling)
    notes: list[str] = list(parsed.notes)
    for dest, replacement in _REMOVED.items():
        if v.get(dest):
            raise ConfigError(f"{flag_name(dest, spelling)} is no longer valid in Megatron-LM, "
                              f"use {replacement} (validate_args)")
    world, world_source = _world(parsed, environ, world_size)
    tp = v.get("tensor_model_parallel_size", 1)
    pp = v.get("pipeline_model_parallel_size", 1)
    cp = v.get("context_parallel_size", 1)
    for dest, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("context_parallel_size", cp)):
        if value < 1:
            raise ConfigError(f"{flag_name(dest, spelling)} must be a positive integer, got {value}")
    if world < 1 or world % (tp * pp * cp):
        raise ConfigError(f"world size {world} ({world_source}) must be a positive multiple of "
                          f"TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp} "
                          "(megatron/training/arguments.py validate_args)")
    dp = world // (tp * pp * cp)
    mbs, gbs = _batch(v, spelling, dp)
    num_layers = _one_of(v, spelling, "num_layers", "encoder_num_layers")
    hidden = _required(v, spelling, "hidden_size")
    heads = _required(v, spelling, "num_attention_heads")
    max_positions = _required(v, spelling, "max_position_embeddings")
    seq = _one_of(v, spelling, "seq_length", "encoder_seq_length")
    first, last = v.get("decoder_first_pipeline_num_layers"), v.get("decoder_last_pipeline_num_layers")
    accounted = (int(bool(v.get("account_for_embedding_in_pipeline_split")))
                 + int(bool(v.get("account_for_loss_in_pipeline_split"))))
    try:
        vpp = virtual_pipeline_size(num_layers, pp, v.get("num_virtual_stages_per_pipeline_rank"),
                                    v.get("num_layers_per_virtual_pipeline_stage"), first, last,
                                    accounted, lambda dest: flag_name(dest, spelling))
    except SplitError as exc:
        raise ConfigError(str(exc)) from None
    params_dtype, grad_dtype = _precision(v, notes)
    fp8_format, fp8_recipe = _fp8(v, notes)
    if v.get("reuse_grad_buf_for_mxfp8_param_ag") and fp8_recipe != "mxfp8":
        # distributed_data_parallel_config.py: "Should be set to True only when fp8_recipe is
        # mxfp8" -- documented, not asserted.
        notes.append("--reuse-grad-buf-for-mxfp8-param-ag is meant for --fp8-recipe mxfp8 only")
    if v.get("ddp_reduce_scatter_with_fp32_accumulation") and grad_dtype == "fp32":
        notes.append("--ddp-reduce-scatter-with-fp32-accumulation stays on over fp32 grads in "
                     "Megatron-LM core_r0.19.0 (Megatron-LM main after it turns it off under "
                     "--accumulate-allreduce-grads-in-fp32)")
    sequence_parallel = bool(v.get("sequence_parallel"))
    if sequence_parallel and tp == 1:  # validate_args disables it with a warning
        sequence_parallel = False
        notes.append("--sequence-parallel ignored at --tensor-model-parallel-size 1 (as Megatron)")
    if v.get("tp_comm_overlap") and not sequence_parallel:
        raise ConfigError("--tp-comm-overlap requires --sequence-parallel (validate_args)")
    vocab = _vocab(v, spelling, tp, notes)
    swiglu = bool(v.get("swiglu"))
    if "ffn_hidden_size" in v:
        ffn = v["ffn_hidden_size"]
    else:  # validate_args defaults
        ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
    # --num-query-groups defaults to 1 and counts only with --group-query-attention
    # (argument_utils.py core_transformer_config_from_args).
    groups = v.get("num_query_groups", 1) if v.get("group_query_attention") else heads
    kv_channels = v.get("kv_channels", hidden // heads if heads > 0 else 0)
    return PreflightConfig(
        dims=parallel_dims(tp, pp, vpp, dp, cp, sequence_parallel, spelling),
        data_parallel_source=f"world size {world} ({world_source}) / (TP x PP x CP)",
        micro_batch_size=mbs, global_batch_size=gbs,
        num_layers=num_layers, hidden_size=hidden, ffn_hidden_size=ffn,
        num_attention_heads=heads, num_query_groups=groups, kv_channels=kv_channels,
        seq_length=seq, max_position_embeddings=max_positions,
        position_embedding_type=_position_embedding(v, spelling),
        padded_vocab_size=vocab,
        untie_embeddings_and_output_weights=bool(v.get("untie_embeddings_and_output_weights")),
        swiglu=swiglu, add_bias_linear=v.get("add_bias_linear", True),
        add_qkv_bias=bool(v.get("add_qkv_bias")),
        normalization=v.get("normalization", "LayerNorm"),
        params_dtype=params_dtype, grad_dtype=grad_dtype,
        use_distributed_optimizer=bool(v.get("use_distributed_optimizer")),
        overlap_grad_reduce=bool(v.get("overlap_grad_reduce")),
        overlap_param_gather=bool(v.get("overlap_param_gather")),
        # validate_args: p2p overlap is turned off without the interleaved schedule.
        overlap_p2p_comm=v.get("overlap_p2p_comm", True) and vpp > 1,
        ddp_bucket_size=v.get("ddp_bucket_size"),
        ddp_pad_buckets_for_high_nccl_busbw=bool(v.get("ddp_pad_buckets_for_high_nccl_busbw")),
        ddp_reduce_scatter_with_fp32_accumulation=bool(v.get("ddp_reduce_scatter_with_fp32_accumulation")),
        defer_embedding_wgrad_compute=bool(v.get("defer_embedding_wgrad_compute")),
        wgrad_deferral_limit=v.get("wgrad_deferral_limit", 0),
        fp8_format=fp8_format, fp8_recipe=fp8_recipe,
        fp8_param_gather=bool(v.get("fp8_param_gather")),
        reuse_grad_buf_for_mxfp8_param_ag=bool(v.get("reuse_grad_buf_for_mxfp8_param_ag")),
        gradient_accumulation_fusion=v.get("gradient_accumulation_fusion", True),
        seed=v.get("seed", 1234), world_size=world, world_size_source=world_source,
        account_for_embedding_in_pipeline_split=bool(v.get("account_for_embedding_in_pipeline_split")),
        account_for_loss_in_pipeline_split=bool(v.get("account_for_loss_in_pipeline_split")),
        decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
        microbatch_group_size_per_vp_stage=v.get("microbatch_group_size_per_vp_stage"),
        decrease_batch_size_if_needed=bool(v.get("decrease_batch_size_if_needed")),
        spelling=spelling, notes=tuple(notes),
        clip_grad=v.get("clip_grad", DEFAULT_CLIP_GRAD), loss_scale=v.get("loss_scale"),
        initial_loss_scale=v.get("initial_loss_scale", DEFAULT_INITIAL_LOSS_SCALE),
        min_loss_scale=v.get("min_loss_scale", DEFAULT_MIN_LOSS_SCALE),
        loss_scale_window=_whole(v, spelling, "loss_scale_window", DEFAULT_LOSS_SCALE_WINDOW),
        hysteresis=v.get("hysteresis", DEFAULT_HYSTERESIS),
    )


def _whole(values: dict, spelling: Mapping[str, str], attribute: str, default: int) -> int:
    """A float flag that must hold a whole number (Megatron parses --loss-scale-window as float)."""
    value = values.get(attribute, default)
    if isinstance(value, float):
        if not (math.isfinite(value) and value == int(value)):
            raise ConfigError(f"{flag_name(attribute, spelling)} must be a whole number, got {value}")
        value = int(value)
    return value


__all__ = ["resolve"]

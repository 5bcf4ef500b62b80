"""The rules under which Megatron-LM refuses to start, checked on a resolved configuration.

Each rule cites where Megatron-LM core_r0.19.0 (megatron-core 0.19.2) enforces it;
``check_config`` runs them in Megatron's order of stages (``validate_args``, the
microbatch calculator, ``TransformerConfig``/``ModelParallelConfig``, the DDP
config, the per-stage layer split, the interleaved schedule, the model's
``divide()`` over TP) and raises :class:`ConfigError` naming the flags.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from verify.preflight.pipeline_split import SplitError, interleaved_microbatch_check

if TYPE_CHECKING:
    from verify.preflight.config import PreflightConfig

# Megatron-LM's --position-embedding-type choices, less "relative" (refused when resolving:
# not modelled). Only learned_absolute has parameters.
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "mrope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_POSITIVE = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
             "context_parallel_size", "virtual_pipeline_model_parallel_size",
             "data_parallel_size", "micro_batch_size", "global_batch_size", "num_layers",
             "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
             "kv_channels", "seq_length", "max_position_embeddings", "padded_vocab_size")


class ConfigError(ValueError):
    """The configuration would not start in Megatron-Core (exit code 2)."""


def check_config(c: PreflightConfig) -> None:
    """Every rule, in Megatron's order; ConfigError on the first one broken."""
    n = c._name
    for attribute in _POSITIVE:
        value = getattr(c, attribute)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{n(attribute)} must be a positive integer, got {value!r}")
    if c.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        raise ConfigError(f"--position-embedding-type must be one of "
                          f"{POSITION_EMBEDDING_TYPES}, got {c.position_embedding_type!r}")
    if c.normalization not in NORMALIZATIONS:
        raise ConfigError(f"--normalization must be one of {NORMALIZATIONS}, "
                          f"got {c.normalization!r}")
    if c.ddp_bucket_size is not None and c.ddp_bucket_size < 1:
        raise ConfigError(f"--ddp-bucket-size must be a positive integer, got {c.ddp_bucket_size}")
    _check_grid(c)
    _check_batch(c)
    _check_sequence(c)
    _check_transformer_config(c)
    _check_deferral(c)
    _check_buffers(c)
    try:
        c.layer_split  # noqa: B018 - transformer_block.py get_num_layers_to_build raises here
        if c.virtual_pipeline_model_parallel_size > 1:
            _check_interleaving(c)
    except SplitError as exc:
        raise ConfigError(str(exc)) from None
    _check_model_build(c)
    _check_optimizer(c)


def _check_grid(c: PreflightConfig) -> None:
    """megatron/training/arguments.py validate_args: ``world_size % (TP x PP x CP) == 0``,
    then ``data_parallel_size = world_size // (TP x PP x CP)``."""
    tp, pp, cp, dp = (c.tensor_model_parallel_size, c.pipeline_model_parallel_size,
                      c.context_parallel_size, c.data_parallel_size)
    if c.world_size is not None and c.world_size != tp * pp * cp * dp:
        n = c._name
        raise ConfigError(
            f"world size {c.world_size} ({c.world_size_source}) must equal "
            f"{n('tensor_model_parallel_size')} ({tp}) x {n('pipeline_model_parallel_size')} "
            f"({pp}) x {n('context_parallel_size')} ({cp}) x DP ({dp}) = {tp * pp * cp * dp}")


def _check_batch(c: PreflightConfig) -> None:
    """megatron/core/num_microbatches_calculator.py ConstantNumMicroBatchesCalculator."""
    n = c._name
    unit = c.micro_batch_size * c.data_parallel_size
    if not c.decrease_batch_size_if_needed and c.global_batch_size % unit:
        raise ConfigError(
            f"{n('global_batch_size')} ({c.global_batch_size}) must be divisible by "
            f"{n('micro_batch_size')} ({c.micro_batch_size}) x data-parallel size "
            f"({c.data_parallel_size}) = {unit} (megatron/core/num_microbatches_calculator.py)")
    if c.num_microbatches < 1:
        raise ConfigError(
            f"{n('global_batch_size')} ({c.global_batch_size}) rounded down to a multiple of "
            f"{n('micro_batch_size')} x DP ({unit}) leaves no microbatch "
            "(num_microbatches_calculator.py: 'number of microbatches should be at least 1')")


def _check_sequence(c: PreflightConfig) -> None:
    """validate_args: the sequence over CP, and the position embeddings' length."""
    n, cp = c._name, c.context_parallel_size
    if cp > 1 and c.seq_length % (2 * cp):
        raise ConfigError(f"{n('seq_length')} ({c.seq_length}) must be a multiple of 2 x "
                          f"{n('context_parallel_size')} = {2 * cp} "
                          "(megatron/training/arguments.py validate_args)")
    if c.max_position_embeddings < c.seq_length:
        raise ConfigError(f"{n('max_position_embeddings')} ({c.max_position_embeddings}) must "
                          f"be >= {n('seq_length')} ({c.seq_length}) (validate_args)")


def _check_transformer_config(c: PreflightConfig) -> None:
    """validate_args and megatron/core/transformer/transformer_config.py __post_init__."""
    n, tp = c._name, c.tensor_model_parallel_size
    # validate_args: `assert args.hidden_size % args.num_attention_heads == 0` when
    # --kv-channels is not given.
    if "kv_channels" not in c.spelling and c.hidden_size % c.num_attention_heads:
        raise ConfigError(f"{n('hidden_size')} ({c.hidden_size}) must be divisible by "
                          f"{n('num_attention_heads')} ({c.num_attention_heads}) "
                          "(validate_args, --kv-channels not given)")
    if c.num_attention_heads % tp:
        raise ConfigError(f"{n('num_attention_heads')} ({c.num_attention_heads}) must be a "
                          f"multiple of {n('tensor_model_parallel_size')} ({tp}) "
                          "(TransformerConfig.__post_init__)")
    groups = c.num_query_groups
    if groups % tp and tp % groups:
        raise ConfigError(f"{n('num_query_groups')} ({groups}) must be a multiple or a divisor "
                          f"of {n('tensor_model_parallel_size')} ({tp}) "
                          "(TransformerConfig.__post_init__)")
    if c.fp8_param_gather and c.fp8_format is None:
        raise ConfigError("--fp8-param-gather requires FP8, --fp8-format e4m3 or hybrid "
                          "(TransformerConfig.__post_init__: 'fp8_param must be used together "
                          "with fp8 mode'; --fp8-recipe alone does not turn FP8 on)")


def _check_deferral(c: PreflightConfig) -> None:
    """megatron/core/model_parallel_config.py __post_init__ (three ValueErrors)."""
    if not c.defer_embedding_wgrad_compute:
        return
    n = c._name
    if c.pipeline_model_parallel_size == 1:
        raise ConfigError(f"{n('defer_embedding_wgrad_compute')} requires pipeline parallelism "
                          f"({n('pipeline_model_parallel_size')} > 1)")
    if not c.gradient_accumulation_fusion:
        raise ConfigError(f"{n('defer_embedding_wgrad_compute')} requires gradient "
                          "accumulation fusion (remove --no-gradient-accumulation-fusion)")
    if c.wgrad_deferral_limit < 0:
        raise ConfigError(f"{n('wgrad_deferral_limit')} must be >= 0 with "
                          f"{n('defer_embedding_wgrad_compute')}, got {c.wgrad_deferral_limit}")


def _check_buffers(c: PreflightConfig) -> None:
    """The DDP config and the optimizer's flags."""
    # distributed_data_parallel_config.py __post_init__: 'Reuse grad buffer only when keeping
    # params in MXFP8.'
    if c.reuse_grad_buf_for_mxfp8_param_ag and not c.fp8_param_gather:
        raise ConfigError("--reuse-grad-buf-for-mxfp8-param-ag requires --fp8-param-gather "
                          "(reuse the grad buffer only when keeping params in MXFP8)")
    # validate_args: '--fp8-param-gather only supported with distributed optimizer'.
    if c.fp8_param_gather and not c.use_distributed_optimizer:
        raise ConfigError("--fp8-param-gather requires --use-distributed-optimizer")
    # validate_args: --overlap-param-gather needs the distributed optimizer and 'Must use
    # --overlap-param-gather with --overlap-grad-reduce'.
    if c.overlap_param_gather and not c.use_distributed_optimizer:
        raise ConfigError("--overlap-param-gather requires --use-distributed-optimizer")
    if c.overlap_param_gather and not c.overlap_grad_reduce:
        raise ConfigError("--overlap-param-gather requires --overlap-grad-reduce")


def _check_interleaving(c: PreflightConfig) -> None:
    n = c._name
    pp = c.pipeline_model_parallel_size
    vpp_flag = n("virtual_pipeline_model_parallel_size")
    if "num_layers_per_virtual_pipeline_stage" in c.spelling:
        vpp_flag = n("num_layers_per_virtual_pipeline_stage")
    # validate_args: interleaving needs PP > 1 with p2p overlap (the default), PP > 2 without.
    minimum = 2 if c.overlap_p2p_comm else 3
    if pp < minimum:
        raise ConfigError(
            f"{vpp_flag} (VPP {c.virtual_pipeline_model_parallel_size}, interleaved schedule) "
            f"requires {n('pipeline_model_parallel_size')} >= {minimum}"
            f"{'' if c.overlap_p2p_comm else ' with --no-overlap-p2p-communication'}, got {pp}")
    group = c.microbatch_group_size_per_vp_stage or pp
    try:
        interleaved_microbatch_check(c.num_microbatches, pp, group, n)
    except SplitError as exc:
        raise SplitError(f"{vpp_flag} (VPP {c.virtual_pipeline_model_parallel_size}): {exc}") from None


def _check_model_build(c: PreflightConfig) -> None:
    """The divide() calls with which Megatron-Core's modules split their weights over TP:
    megatron/core/tensor_parallel/layers.py (Column/RowParallelLinear, VocabParallelEmbedding)
    and megatron/core/transformer/attention.py Attention.__init__; Transformer Engine's
    DotProductAttention (the default --transformer-impl) asserts heads % query groups."""
    n, tp = c._name, c.tensor_model_parallel_size
    heads, groups = c.num_attention_heads, c.num_query_groups
    if heads % groups:
        raise ConfigError(f"{n('num_attention_heads')} ({heads}) must be a multiple of "
                          f"{n('num_query_groups')} ({groups}) (Transformer Engine's "
                          "DotProductAttention; attention.py divide() when groups < TP)")
    q, kv = heads * c.kv_channels, groups * c.kv_channels
    ffn = c.ffn_hidden_size
    ffn_text = (n("ffn_hidden_size") if "ffn_hidden_size" in c.spelling else
                f"the FFN size (Megatron's default for {n('hidden_size')} {c.hidden_size}"
                f"{' under --swiglu: int(4 h x 2/3 / 64) x 64' if c.swiglu else ': 4 h'}; "
                f"{n('ffn_hidden_size')} not given)")
    for size, what in ((q + 2 * kv, "the QKV projection's output (heads + 2 x query groups) x "
                        "kv channels"),
                       (ffn, ffn_text),
                       (c.padded_vocab_size, n("padded_vocab_size"))):
        if size % tp:
            raise ConfigError(f"{what} ({size}) must be divisible by "
                              f"{n('tensor_model_parallel_size')} ({tp}) "
                              "(megatron/core/tensor_parallel/layers.py divide())")


def _check_optimizer(c: PreflightConfig) -> None:
    """The grad scaler's asserts (megatron/core/optimizer/grad_scaler.py) and preflight's
    own: a finite --clip-grad >= 0, whole positive --loss-scale-window and --hysteresis."""
    n = c._name
    if not (math.isfinite(c.clip_grad) and c.clip_grad >= 0):
        raise ConfigError(f"{n('clip_grad')} must be a finite number >= 0 (0 turns clipping "
                          f"off), got {c.clip_grad}")
    for attribute in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
        value = getattr(c, attribute)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{n(attribute)} must be a finite number > 0, got {value}")
    if c.min_loss_scale > c.initial_loss_scale:
        raise ConfigError(f"{n('min_loss_scale')} ({c.min_loss_scale:g}) must be <= "
                          f"{n('initial_loss_scale')} ({c.initial_loss_scale:g})")
    for attribute in ("loss_scale_window", "hysteresis"):
        value = getattr(c, attribute)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{n(attribute)} must be a positive integer, got {value!r}")

"""The user's training configuration, resolved and validated as Megatron-LM does it.

:func:`verify.preflight.resolve.resolve` turns a parsed launch into a
:class:`PreflightConfig`, applying the defaults and silent adjustments of
Megatron-LM's ``validate_args`` (each recorded in ``notes``); the dataclass's
``__post_init__`` then enforces the rules that make production refuse to start
(:func:`check_config`, below), naming the flags in the message. The rules
are those of :data:`~verify.preflight.flags.MEGATRON_LM` (megatron-core 0.19.2) and cite
the file and function that enforce each; ``check_config`` runs them in Megatron's order of
stages (``validate_args``, the microbatch calculator, ``TransformerConfig``/
``ModelParallelConfig``, the DDP config, the per-stage layer split, the interleaved schedule,
the model's ``divide()`` over TP). The rules live beside the dataclass they check: the
dataclass calls them and they read its fields, so two modules would import each other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from fastgrad.parallel_dims import ParallelDims
from verify.preflight.flags import MEGATRON_LM, flag_of
from verify.preflight.pipeline_split import (
    PipelineSplit,
    SplitError,
    interleaved_microbatch_check,
    split_layers,
)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DEFAULT_BUCKET_FLOOR = 40_000_000  # elements; megatron/training/training.py resolve_ddp_bucket_size
# megatron/training/arguments.py defaults of the optimizer flags.
DEFAULT_CLIP_GRAD = 1.0
DEFAULT_INITIAL_LOSS_SCALE = 2.0**32
DEFAULT_MIN_LOSS_SCALE = 1.0
DEFAULT_LOSS_SCALE_WINDOW = 1000
DEFAULT_HYSTERESIS = 2
# Preflight's attribute -> the Megatron attribute (argparse dest) its flag sets.
_DEST = {"virtual_pipeline_model_parallel_size": "num_virtual_stages_per_pipeline_rank",
         "fp8_format": "fp8"}
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


def flag_name(attribute: str, spelling: Mapping[str, str]) -> str:
    """The flag the user wrote for ``attribute`` (Megatron's spelling when not given)."""
    return flag_of(_DEST.get(attribute, attribute), spelling)


def parallel_dims(tp: int, pp: int, vpp: int, dp: int, cp: int, sequence_parallel: bool,
                  spelling: Mapping[str, str]) -> ParallelDims:
    """The grid's sizes as one :class:`ParallelDims`, each size checked first under the flag
    that set it (ConfigError names the flag and Megatron's rule)."""
    sizes = (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
             ("virtual_pipeline_model_parallel_size", vpp), ("data_parallel_size", dp),
             ("context_parallel_size", cp))
    for attribute, value in sizes:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{flag_name(attribute, spelling)} must be a positive integer, "
                              f"got {value!r}")
    if vpp > 1 and pp < 2:  # validate_args: interleaving needs PP > 1 (> 2 without p2p overlap)
        raise ConfigError(f"{flag_name('virtual_pipeline_model_parallel_size', spelling)} (VPP "
                          f"{vpp}, interleaved schedule) requires "
                          f"{flag_name('pipeline_model_parallel_size', spelling)} >= 2, got {pp}")
    if sequence_parallel and tp == 1:
        raise ConfigError(f"{flag_name('sequence_parallel', spelling)} needs "
                          f"{flag_name('tensor_model_parallel_size', spelling)} > 1")
    return ParallelDims(tp_size=tp, cp_size=cp, dp_size=dp, pp_size=pp, vpp_size=vpp,
                        sequence_parallel=sequence_parallel)


@dataclass(frozen=True)
class PreflightConfig:
    """Resolved Megatron settings (Megatron's attribute names); validates itself.

    ``dims`` is the one carrier of the grid's sizes (TP, CP, DP = world / (TP x PP x CP),
    PP, VPP model chunks per pipeline rank with 1 = no interleaving, and sequence
    parallelism); the Megatron-named sizes below are read-only views of it."""

    dims: ParallelDims
    data_parallel_source: str  # how the DP size was derived
    micro_batch_size: int
    global_batch_size: int
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    seq_length: int
    max_position_embeddings: int
    position_embedding_type: str
    padded_vocab_size: int
    untie_embeddings_and_output_weights: bool
    swiglu: bool
    add_bias_linear: bool
    normalization: str
    params_dtype: str  # "bf16", "fp16" or "fp32"
    grad_dtype: str  # the main-grad buffer's dtype, which is also the DP wire dtype
    use_distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    overlap_p2p_comm: bool
    ddp_bucket_size: int | None  # as given; None = Megatron's default
    ddp_pad_buckets_for_high_nccl_busbw: bool
    ddp_reduce_scatter_with_fp32_accumulation: bool
    defer_embedding_wgrad_compute: bool
    wgrad_deferral_limit: int
    fp8_format: str | None  # None: no FP8 (Megatron's args.fp8)
    fp8_recipe: str | None  # None without FP8
    fp8_param_gather: bool
    reuse_grad_buf_for_mxfp8_param_ag: bool
    gradient_accumulation_fusion: bool
    seed: int
    world_size: int | None = None
    world_size_source: str | None = None  # "--world-size", "WORLD_SIZE (torchrun)", ...
    clip_grad: float = DEFAULT_CLIP_GRAD  # global-norm clipping; 0 = off (optimizer.py: clip_grad > 0)
    loss_scale: float | None = None  # static loss scale; None = dynamic under --fp16, else none
    initial_loss_scale: float = DEFAULT_INITIAL_LOSS_SCALE
    min_loss_scale: float = DEFAULT_MIN_LOSS_SCALE
    loss_scale_window: int = DEFAULT_LOSS_SCALE_WINDOW
    hysteresis: int = DEFAULT_HYSTERESIS
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    microbatch_group_size_per_vp_stage: int | None = None  # None: PP (model_parallel_config.py)
    decrease_batch_size_if_needed: bool = False
    add_qkv_bias: bool = False
    megatron: str = MEGATRON_LM  # whose rules resolved and checked this configuration
    spelling: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    notes: tuple[str, ...] = ()

    def _name(self, attribute: str) -> str:
        return flag_name(attribute, self.spelling)

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ParallelDims):
            raise TypeError(f"PreflightConfig.dims must be a ParallelDims, got "
                            f"{type(self.dims).__name__}")
        if self.dims.built:
            raise ValueError("PreflightConfig.dims must be sizes only (a configuration on paper)")
        check_config(self)

    # Megatron's names for the sizes of ``dims`` (read-only).
    @property
    def tensor_model_parallel_size(self) -> int:
        return self.dims.tp_size

    @property
    def pipeline_model_parallel_size(self) -> int:
        return self.dims.pp_size

    @property
    def virtual_pipeline_model_parallel_size(self) -> int:
        """Model chunks per pipeline rank (1 = no interleaving)."""
        return self.dims.vpp_size

    @property
    def data_parallel_size(self) -> int:
        """world / (TP x PP x CP)."""
        return self.dims.dp_size

    @property
    def context_parallel_size(self) -> int:
        return self.dims.cp_size

    @property
    def sequence_parallel(self) -> bool:
        return self.dims.sequence_parallel

    @property
    def shape(self) -> str:
        """"TP=8 PP=2 VPP=2 DP=4" (with "CP=2" where context parallelism is on)."""
        cp = self.context_parallel_size
        return (f"TP={self.tensor_model_parallel_size} PP={self.pipeline_model_parallel_size} "
                f"VPP={self.virtual_pipeline_model_parallel_size}{f' CP={cp}' if cp > 1 else ''} "
                f"DP={self.data_parallel_size}")

    @property
    def data_context_parallel_size(self) -> int:
        """DP x CP: the group that reduces (and shards) the gradients, Megatron-Core's dp_cp
        group (megatron/core/distributed/distributed_data_parallel.py: ``dp_cp_group``)."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def running_global_batch_size(self) -> int:
        """The global batch a step runs: --global-batch-size, or with
        --decrease-batch-size-if-needed rounded down to a multiple of micro x DP
        (num_microbatches_calculator.py ConstantNumMicroBatchesCalculator)."""
        if not self.decrease_batch_size_if_needed:
            return self.global_batch_size
        unit = self.micro_batch_size * self.data_parallel_size
        return self.global_batch_size // unit * unit

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on every pipeline: global / (micro x DP); CP ranks share a
        sample, so CP does not divide it (num_microbatches_calculator.py)."""
        return self.running_global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def layer_split(self) -> PipelineSplit:
        """The transformer layers of every (pipeline stage, model chunk), as Megatron splits them."""
        return split_layers(self.num_layers, self.pipeline_model_parallel_size,
                            self.virtual_pipeline_model_parallel_size,
                            self.decoder_first_pipeline_num_layers,
                            self.decoder_last_pipeline_num_layers,
                            self.account_for_embedding_in_pipeline_split,
                            self.account_for_loss_in_pipeline_split, self._name)

    @property
    def even_split(self) -> bool:
        """Every (stage, chunk) builds the same number of layers."""
        return len({n for row in self.layer_split.layers for n in row}) == 1

    @property
    def loss_scaling(self) -> str | None:
        """Megatron's grad scaler: "constant" (--loss-scale), "dynamic" (--fp16), or None.

        megatron/core/optimizer/__init__.py: with fp16, bf16 or the distributed optimizer
        a given loss_scale makes a ConstantGradScaler, else fp16 gets a DynamicGradScaler.
        """
        if self.loss_scale and (self.params_dtype != "fp32" or self.use_distributed_optimizer):
            return "constant"
        return "dynamic" if self.params_dtype == "fp16" else None

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def mxfp8_sharing(self) -> bool:
        """Whether the MXFP8 params are all-gathered through the grad buffer."""
        return self.reuse_grad_buf_for_mxfp8_param_ag

    @property
    def default_bucket_size(self) -> int:
        """``max(40M, 1M x DP x CP)``: Megatron's bucket size when --ddp-bucket-size is not
        given (megatron/training/training.py resolve_ddp_bucket_size, over the dp_cp group)."""
        return max(DEFAULT_BUCKET_FLOOR, 1_000_000 * self.data_context_parallel_size)

    @property
    def first_stage_bucket_size(self) -> int | None:
        """Bucket size of pipeline rank 0's first chunk; None (one bucket) without overlap."""
        # megatron/training/training.py resolve_ddp_bucket_size: None if not overlap_grad_reduce.
        if not self.overlap_grad_reduce:
            return None
        return self.ddp_bucket_size if self.ddp_bucket_size is not None else self.default_bucket_size

    def to_dict(self) -> dict:
        """JSON-ready settings, with the derived microbatch count and layers per stage and chunk."""
        sizes = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size", "data_parallel_size",
                 "context_parallel_size", "sequence_parallel")
        out = {k: getattr(self, k) for k in sizes}
        out |= {k: getattr(self, k) for k in self.__dataclass_fields__
                if k not in ("spelling", "dims")}
        out["notes"] = list(self.notes)
        out["num_microbatches"] = self.num_microbatches
        out["data_context_parallel_size"] = self.data_context_parallel_size
        out["layers_per_stage_and_chunk"] = [list(row) for row in self.layer_split.layers]
        return out


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's ``vocab_size_with_padding``: up to a multiple of divisible_by x TP
    (megatron/core/tokenizers/utils/build_tokenizer.py)."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple



# --------------------------------------------------------------------------- the rules
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


__all__ = ["ConfigError", "DTYPE_BYTES", "PreflightConfig", "flag_name", "pad_vocab_size",
           "parallel_dims"]

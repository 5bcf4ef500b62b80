"""The user's training configuration, resolved and validated as Megatron-Core does it.

:func:`resolve` turns parsed flags into a :class:`PreflightConfig`, applying the
defaults and silent adjustments that Megatron's ``validate_args`` makes (each
recorded in ``notes``); the dataclass's ``__post_init__`` then enforces the
rules that make production refuse to start, naming the flags in the message.
The rules cite the Megatron-LM source (snapshot of 2026-08-22,
commit d98e8a64ddf3) they come from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from verify.preflight.flags import FLAG_SPECS, ParsedFlags

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
DEFAULT_BUCKET_FLOOR = 40_000_000  # elements; megatron/training/training.py resolve_ddp_bucket_size
# megatron/training/arguments.py defaults of the optimizer flags.
DEFAULT_CLIP_GRAD = 1.0
DEFAULT_INITIAL_LOSS_SCALE = 2.0**32
DEFAULT_MIN_LOSS_SCALE = 1.0
DEFAULT_LOSS_SCALE_WINDOW = 1000
DEFAULT_HYSTERESIS = 2


class ConfigError(ValueError):
    """The configuration would not start in Megatron-Core (exit code 2)."""


def _flag(attribute: str, spelling: Mapping[str, str]) -> str:
    if attribute in spelling:
        return spelling[attribute]
    return next(f for f, (a, _) in FLAG_SPECS.items() if a == attribute)


@dataclass(frozen=True)
class PreflightConfig:
    """Resolved Megatron settings (Megatron's attribute names); validates itself."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int  # 1 = no interleaving
    data_parallel_size: int
    data_parallel_source: str  # which flag or variable gave the DP size
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
    fp8_format: str | None
    fp8_recipe: str | None
    fp8_param_gather: bool
    reuse_grad_buf_for_mxfp8_param_ag: bool
    sequence_parallel: bool
    gradient_accumulation_fusion: bool
    seed: int
    world_size: int | None = None
    world_size_source: str | None = None  # "--world-size" or "WORLD_SIZE (torchrun)"
    clip_grad: float = DEFAULT_CLIP_GRAD  # global-norm clipping; 0 = off (optimizer.py: clip_grad > 0)
    loss_scale: float | None = None  # static loss scale; None = dynamic under --fp16, else none
    initial_loss_scale: float = DEFAULT_INITIAL_LOSS_SCALE
    min_loss_scale: float = DEFAULT_MIN_LOSS_SCALE
    loss_scale_window: int = DEFAULT_LOSS_SCALE_WINDOW
    hysteresis: int = DEFAULT_HYSTERESIS
    spelling: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    notes: tuple[str, ...] = ()

    def _name(self, attribute: str) -> str:
        return _flag(attribute, self.spelling)

    def __post_init__(self) -> None:
        n = self._name
        for attribute in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                          "virtual_pipeline_model_parallel_size", "data_parallel_size",
                          "micro_batch_size", "global_batch_size", "num_layers", "hidden_size",
                          "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                          "kv_channels", "seq_length", "max_position_embeddings",
                          "padded_vocab_size"):
            value = getattr(self, attribute)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{n(attribute)} must be a positive integer, got {value!r}")
        tp, pp, vpp, dp = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                           self.virtual_pipeline_model_parallel_size, self.data_parallel_size)
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ConfigError(f"--position-embedding-type must be one of "
                              f"{POSITION_EMBEDDING_TYPES}, got {self.position_embedding_type!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"--normalization must be one of {NORMALIZATIONS}, "
                              f"got {self.normalization!r}")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size < 1:
            raise ConfigError(f"--ddp-bucket-size must be a positive integer, got {self.ddp_bucket_size}")
        # megatron/training/arguments.py validate_args: `world_size % total_model_size == 0`,
        # then data_parallel_size = world_size // (TP * PP * CP).
        if self.world_size is not None and self.world_size != tp * pp * dp:
            raise ConfigError(
                f"world size {self.world_size} ({self.world_size_source}) must equal "
                f"{n('tensor_model_parallel_size')} ({tp}) x {n('pipeline_model_parallel_size')} "
                f"({pp}) x {self.data_parallel_source} ({dp}) = {tp * pp * dp}")
        # megatron/core/num_microbatches_calculator.py ConstantNumMicroBatchesCalculator:
        # 'global batch size (...) is not divisible by micro batch size (...) times data parallel size'.
        if self.global_batch_size % (self.micro_batch_size * dp) != 0:
            raise ConfigError(
                f"{n('global_batch_size')} ({self.global_batch_size}) must be divisible by "
                f"{n('micro_batch_size')} ({self.micro_batch_size}) x data-parallel size ({dp}) "
                f"= {self.micro_batch_size * dp}")
        # megatron/training/arguments.py: `assert args.hidden_size % args.num_attention_heads == 0`
        # (when --kv-channels is not given).
        if "kv_channels" not in self.spelling and self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{n('hidden_size')} ({self.hidden_size}) must be divisible by "
                              f"{n('num_attention_heads')} ({self.num_attention_heads})")
        # megatron/core/transformer/transformer_config.py __post_init__:
        # num_attention_heads and num_query_groups must be multiples of TP.
        for attribute in ("num_attention_heads", "num_query_groups"):
            if getattr(self, attribute) % tp:
                raise ConfigError(f"{n(attribute)} ({getattr(self, attribute)}) must be a multiple "
                                  f"of {n('tensor_model_parallel_size')} ({tp})")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"{n('num_attention_heads')} ({self.num_attention_heads}) must be a "
                              f"multiple of {n('num_query_groups')} ({self.num_query_groups})")
        # megatron/core/tensor_parallel/layers.py: Column/RowParallelLinear and
        # VocabParallelEmbedding split their dimension with divide(), which asserts divisibility.
        for attribute in ("ffn_hidden_size", "padded_vocab_size"):
            if getattr(self, attribute) % tp:
                raise ConfigError(f"{n(attribute)} ({getattr(self, attribute)}) must be divisible "
                                  f"by {n('tensor_model_parallel_size')} ({tp})")
        # megatron/training/arguments.py: 'Number of layers should be divisible by the
        # pipeline-model-parallel size'; with interleaving every virtual stage gets
        # num_layers / (PP * VPP) layers (transformer_block.get_num_layers_to_build floors
        # it, which would drop layers, so it is refused here).
        if self.num_layers % (pp * vpp):
            vpp_text = f" x {n('virtual_pipeline_model_parallel_size')} ({vpp})" if vpp > 1 else ""
            raise ConfigError(f"{n('num_layers')} ({self.num_layers}) must be divisible by "
                              f"{n('pipeline_model_parallel_size')} ({pp}){vpp_text}")
        if vpp > 1:
            self._check_interleaving()
        self._check_deferral()
        self._check_optimizer()
        # megatron/core/distributed/distributed_data_parallel_config.py __post_init__:
        # 'Reuse grad buffer only when keeping params in MXFP8.'
        if self.reuse_grad_buf_for_mxfp8_param_ag and not self.fp8_param_gather:
            raise ConfigError("--reuse-grad-buf-for-mxfp8-param-ag requires --fp8-param-gather "
                              "(reuse the grad buffer only when keeping params in MXFP8)")
        # megatron/training/arguments.py: '--fp8-param-gather only supported with distributed optimizer'.
        if self.fp8_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("--fp8-param-gather requires --use-distributed-optimizer")
        # megatron/training/arguments.py: --overlap-param-gather needs the distributed
        # optimizer and 'Must use --overlap-param-gather with --overlap-grad-reduce'.
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("--overlap-param-gather requires --use-distributed-optimizer")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ConfigError("--overlap-param-gather requires --overlap-grad-reduce")

    def _check_interleaving(self) -> None:
        n = self._name
        pp, m = self.pipeline_model_parallel_size, self.num_microbatches
        vpp_flag = n("virtual_pipeline_model_parallel_size")
        # megatron/training/arguments.py: interleaving needs PP > 1 with --overlap-p2p-communication
        # (the default), PP > 2 without it.
        minimum = 2 if self.overlap_p2p_comm else 3
        if pp < minimum:
            raise ConfigError(
                f"{vpp_flag} > 1 (interleaved schedule) requires {n('pipeline_model_parallel_size')}"
                f" >= {minimum}{'' if self.overlap_p2p_comm else ' with --no-overlap-p2p-communication'}"
                f", got {pp}")
        # megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving:
        # microbatch_group_size_per_vp_stage (default PP, model_parallel_config.py) must lie in
        # [PP, M], and M % group must be 0 or >= PP; with the default group that is M % PP == 0.
        if m < pp or m % pp:
            raise ConfigError(
                f"{vpp_flag} > 1 (interleaved schedule) needs the number of microbatches "
                f"{n('global_batch_size')} / ({n('micro_batch_size')} x DP) = {m} to be a "
                f"multiple of {n('pipeline_model_parallel_size')} ({pp}) and >= it")

    def _check_optimizer(self) -> None:
        n = self._name
        if not (math.isfinite(self.clip_grad) and self.clip_grad >= 0):
            raise ConfigError(f"{n('clip_grad')} must be a finite number >= 0 (0 turns clipping "
                              f"off), got {self.clip_grad}")
        for attribute in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
            value = getattr(self, attribute)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{n(attribute)} must be a finite number > 0, got {value}")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(f"{n('min_loss_scale')} ({self.min_loss_scale:g}) must be <= "
                              f"{n('initial_loss_scale')} ({self.initial_loss_scale:g})")
        for attribute in ("loss_scale_window", "hysteresis"):
            value = getattr(self, attribute)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{n(attribute)} must be a positive integer, got {value!r}")

    @property
    def loss_scaling(self) -> str | None:
        """Megatron's grad scaler: "constant" (--loss-scale), "dynamic" (--fp16), or None.

        megatron/core/optimizer/__init__.py: with fp16, bf16 or the distributed optimizer
        a given loss_scale makes a ConstantGradScaler, else fp16 gets a DynamicGradScaler.
        """
        if self.loss_scale and (self.params_dtype != "fp32" or self.use_distributed_optimizer):
            return "constant"
        return "dynamic" if self.params_dtype == "fp16" else None

    def _check_deferral(self) -> None:
        # megatron/core/model_parallel_config.py __post_init__ (three ValueErrors).
        if not self.defer_embedding_wgrad_compute:
            return
        if self.pipeline_model_parallel_size == 1:
            raise ConfigError("--defer-embedding-wgrad-compute requires pipeline parallelism "
                              "(--pipeline-model-parallel-size > 1)")
        if not self.gradient_accumulation_fusion:
            raise ConfigError("--defer-embedding-wgrad-compute requires gradient accumulation "
                              "fusion (remove --no-gradient-accumulation-fusion)")
        if self.wgrad_deferral_limit < 0:
            raise ConfigError(f"--wgrad-deferral-limit must be >= 0 with "
                              f"--defer-embedding-wgrad-compute, got {self.wgrad_deferral_limit}")

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on every pipeline: global / (micro x DP)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def mxfp8_sharing(self) -> bool:
        """Whether the MXFP8 params are all-gathered through the grad buffer."""
        return self.reuse_grad_buf_for_mxfp8_param_ag

    @property
    def default_bucket_size(self) -> int:
        """``max(40M, 1M x DP)``: Megatron's bucket size when --ddp-bucket-size is not given."""
        return max(DEFAULT_BUCKET_FLOOR, 1_000_000 * self.data_parallel_size)

    @property
    def first_stage_bucket_size(self) -> int | None:
        """Bucket size of pipeline rank 0's first chunk; None (one bucket) without overlap."""
        # megatron/training/training.py resolve_ddp_bucket_size: None if not overlap_grad_reduce.
        if not self.overlap_grad_reduce:
            return None
        return self.ddp_bucket_size if self.ddp_bucket_size is not None else self.default_bucket_size

    def to_dict(self) -> dict:
        """JSON-ready settings, with the derived microbatch count."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("spelling",)}
        out["notes"] = list(self.notes)
        out["num_microbatches"] = self.num_microbatches
        return out


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's ``_vocab_size_with_padding``: up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def _resolve_data_parallel(values: dict, spelling: Mapping[str, str],
                           environ: Mapping[str, str], tp: int,
                           pp: int) -> tuple[int, str, int | None, str | None]:
    """(DP size, its source, world size or None, its source), as Megatron derives DP."""
    world, world_source = values.get("world_size"), spelling.get("world_size")
    if world is None and environ.get("WORLD_SIZE"):
        try:
            world = int(environ["WORLD_SIZE"])
        except ValueError:
            raise ConfigError(f"WORLD_SIZE must be an integer, got {environ['WORLD_SIZE']!r}") from None
        world_source = "WORLD_SIZE (torchrun)"
    if "data_parallel_size" in values:
        return values["data_parallel_size"], "--data-parallel-size", world, world_source
    if world is None:
        raise ConfigError("the data-parallel size is unknown: give --data-parallel-size, or "
                          "--world-size (or run under torchrun, which sets WORLD_SIZE)")
    if world < 1 or world % (tp * pp):
        raise ConfigError(f"world size {world} ({world_source}) must be a positive multiple of "
                          f"--tensor-model-parallel-size x --pipeline-model-parallel-size = {tp * pp}")
    return world // (tp * pp), f"{world_source} / (TP x PP)", world, world_source


def _resolve_virtual_stages(values: dict, spelling: Mapping[str, str], pp: int) -> int:
    """VPP from either flag, as megatron/training/arguments.py validate_args derives it."""
    per_stage = values.get("num_layers_per_virtual_pipeline_stage")
    if per_stage is None:
        return values.get("virtual_pipeline_model_parallel_size") or 1
    if "virtual_pipeline_model_parallel_size" in values:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage and "
                          f"{spelling['virtual_pipeline_model_parallel_size']} cannot both be set")
    layers = values["num_layers"]
    if per_stage < 1 or layers % pp or (layers // pp) % per_stage:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage ({per_stage}) must divide "
                          f"the layers per pipeline stage, --num-layers ({layers}) / "
                          f"--pipeline-model-parallel-size ({pp})")
    return (layers // pp) // per_stage


def resolve(parsed: ParsedFlags, environ: Mapping[str, str]) -> PreflightConfig:
    """Apply Megatron's defaults and adjustments to the parsed flags; validate the result."""
    v, spelling = dict(parsed.values), dict(parsed.spelling)
    notes: list[str] = []
    for attribute in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                      "micro_batch_size"):
        if attribute not in v:
            raise ConfigError(f"{_flag(attribute, spelling)} is required")
    tp = v.get("tensor_model_parallel_size", 1)
    pp = v.get("pipeline_model_parallel_size", 1)
    if tp < 1 or pp < 1:
        bad = "tensor_model_parallel_size" if tp < 1 else "pipeline_model_parallel_size"
        raise ConfigError(f"{_flag(bad, spelling)} must be a positive integer, got {v[bad]}")
    dp, dp_source, world, world_source = _resolve_data_parallel(v, spelling, environ, tp, pp)
    if v.get("bf16") and v.get("fp16"):  # arguments.py: `assert not args.bf16` under fp16
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    params_dtype = "bf16" if v.get("bf16") else "fp16" if v.get("fp16") else "fp32"
    # arguments.py: with --bf16 and the default --main-grads-dtype fp32, grads are accumulated
    # and all-reduced in fp32 unless --grad-reduce-in-bf16.
    accumulate_fp32 = bool(v.get("accumulate_allreduce_grads_in_fp32"))
    if params_dtype == "bf16":
        if v.get("grad_reduce_in_bf16"):
            accumulate_fp32 = False
        elif not accumulate_fp32:
            accumulate_fp32 = True
            notes.append("--bf16: Megatron accumulates and reduces grads in fp32 "
                         "(--grad-reduce-in-bf16 not given)")
    grad_dtype = "fp32" if accumulate_fp32 or params_dtype == "fp32" else params_dtype
    if v.get("reuse_grad_buf_for_mxfp8_param_ag") and v.get("fp8_recipe") != "mxfp8":
        # distributed_data_parallel_config.py: "Should be set to True only when fp8_recipe is
        # mxfp8" -- documented, not asserted.
        notes.append("--reuse-grad-buf-for-mxfp8-param-ag is meant for --fp8-recipe mxfp8 only")
    rs_fp32 = bool(v.get("ddp_reduce_scatter_with_fp32_accumulation"))
    if rs_fp32 and grad_dtype == "fp32":  # arguments.py turns it off with a warning
        rs_fp32 = False
        notes.append("--ddp-reduce-scatter-with-fp32-accumulation ignored: grads already reduce "
                     "in fp32 (Megatron sets it to False)")
    sequence_parallel = bool(v.get("sequence_parallel"))
    if sequence_parallel and tp == 1:  # arguments.py disables it with a warning
        sequence_parallel = False
        notes.append("--sequence-parallel ignored at --tensor-model-parallel-size 1 (as Megatron)")
    if "padded_vocab_size" in v:
        vocab = v["padded_vocab_size"]
    elif "vocab_size" in v:
        vocab = pad_vocab_size(v["vocab_size"], v.get("make_vocab_size_divisible_by", 128), tp)
        notes.append(f"--vocab-size {v['vocab_size']} padded to {vocab} (multiple of "
                     f"--make-vocab-size-divisible-by x TP)")
        spelling["padded_vocab_size"] = "--vocab-size"
    else:
        raise ConfigError("--padded-vocab-size (or --vocab-size) is required")
    hidden, heads = v["hidden_size"], v["num_attention_heads"]
    swiglu = bool(v.get("swiglu"))
    if "ffn_hidden_size" in v:
        ffn = v["ffn_hidden_size"]
    else:  # arguments.py defaults
        ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
    groups = v.get("num_query_groups", heads) if v.get("group_query_attention") else heads
    kv_channels = v.get("kv_channels", hidden // heads if heads > 0 else 0)
    vpp = _resolve_virtual_stages(v, spelling, pp)
    return PreflightConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, data_parallel_size=dp,
        data_parallel_source=dp_source,
        micro_batch_size=v["micro_batch_size"],
        global_batch_size=v.get("global_batch_size", v["micro_batch_size"] * dp),
        num_layers=v["num_layers"], hidden_size=hidden, ffn_hidden_size=ffn,
        num_attention_heads=heads, num_query_groups=groups, kv_channels=kv_channels,
        seq_length=v["seq_length"],
        max_position_embeddings=v.get("max_position_embeddings", v["seq_length"]),
        position_embedding_type=v.get("position_embedding_type", "learned_absolute"),
        padded_vocab_size=vocab,
        untie_embeddings_and_output_weights=bool(v.get("untie_embeddings_and_output_weights")),
        swiglu=swiglu, add_bias_linear=v.get("add_bias_linear", True),
        normalization=v.get("normalization", "LayerNorm"),
        params_dtype=params_dtype, grad_dtype=grad_dtype,
        use_distributed_optimizer=bool(v.get("use_distributed_optimizer")),
        overlap_grad_reduce=bool(v.get("overlap_grad_reduce")),
        overlap_param_gather=bool(v.get("overlap_param_gather")),
        overlap_p2p_comm=v.get("overlap_p2p_comm", True),
        ddp_bucket_size=v.get("ddp_bucket_size"),
        ddp_pad_buckets_for_high_nccl_busbw=bool(v.get("ddp_pad_buckets_for_high_nccl_busbw")),
        ddp_reduce_scatter_with_fp32_accumulation=rs_fp32,
        defer_embedding_wgrad_compute=bool(v.get("defer_embedding_wgrad_compute")),
        wgrad_deferral_limit=v.get("wgrad_deferral_limit", 0),
        fp8_format=v.get("fp8_format"), fp8_recipe=v.get("fp8_recipe"),
        fp8_param_gather=bool(v.get("fp8_param_gather")),
        reuse_grad_buf_for_mxfp8_param_ag=bool(v.get("reuse_grad_buf_for_mxfp8_param_ag")),
        sequence_parallel=sequence_parallel,
        gradient_accumulation_fusion=v.get("gradient_accumulation_fusion", True),
        seed=v.get("seed", 1234), world_size=world,
        world_size_source=world_source, spelling=spelling, notes=tuple(notes),
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
            raise ConfigError(f"{_flag(attribute, spelling)} must be a whole number, got {value}")
        value = int(value)
    return value


__all__ = ["ConfigError", "DTYPE_BYTES", "PreflightConfig", "pad_vocab_size", "resolve"]

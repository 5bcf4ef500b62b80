"""The user's training configuration, resolved and validated as Megatron-LM does it.

:func:`verify.preflight.resolve.resolve` turns a parsed launch into a
:class:`PreflightConfig`, applying the defaults and silent adjustments of
Megatron-LM's ``validate_args`` (each recorded in ``notes``, each refusal collected); the
dataclass's ``__post_init__`` then runs every rule that makes production refuse to start
(:data:`RULES`, by :func:`check_config`, below) and raises one :class:`ConfigError` listing
every refusal, resolve's and its own, naming the flags in each message. The rules are those
of :data:`~verify.preflight.flags.MEGATRON_LM` (megatron-core 0.19.2) and cite the file and
line that enforce each; the refusals are ordered as Megatron meets them (the stages of
:data:`~verify.preflight.flags.STAGES`: ``validate_args`` by line, the microbatch
calculator, ``ModelParallelConfig``, ``TransformerConfig``, ``get_model``'s model build,
DDP config and DDP wrap, the optimizer, the interleaved schedule's first step). A rule that
reads a value a refusal leaves undefined (``PreflightConfig.undefined``) is not checked and
is named as such. The rules live beside the dataclass they check: the dataclass calls them
and they read its fields, so two modules would import each other.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from gradvocab import Averaging, ParallelDims, default_bucket_size
from verify.preflight.flags import MEGATRON_LM, LaunchRefused, Refusal, flag_of
from verify.preflight.hybrid import ATTENTION, MLP, HybridConfig, mixer_refusals
from verify.preflight.moe import (
    MoEConfig,
    expert_data_parallel_size,
    expert_grid_refusals,
    model_build_refusals,
    transformer_config_refusals,
)
from verify.preflight.mtp import MTPConfig, qk_norm_params
from verify.preflight.mtp import model_build_refusals as mtp_build_refusals
from verify.preflight.mtp import validate_args_refusals as mtp_validate_args_refusals
from verify.preflight.optimizer import (
    OptimizerChoice,
    distributed_optimizer_refusals,
    learning_rate_refusals,
    optimizer_build_refusals,
)
from verify.preflight.pipeline_split import (
    PipelineSplit,
    SplitError,
    interleaved_microbatch_check,
    split_layers,
)
from verify.preflight.sharded_dp import MEGATRON_FSDP, TORCH_FSDP2, ShardedDPConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
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


class ConfigError(LaunchRefused):
    """The configuration would not start in Megatron-Core (exit code 2): every rule it
    breaks, in Megatron-LM's order (:class:`~verify.preflight.flags.LaunchRefused`)."""


def flag_name(attribute: str, spelling: Mapping[str, str]) -> str:
    """The flag the user wrote for ``attribute`` (Megatron's spelling when not given)."""
    return flag_of(_DEST.get(attribute, attribute), spelling)


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
    # --calculate-per-token-loss: the loss is a sum over tokens, grads are summed over DP x CP
    # without a 1/(DP x CP) pre-scale, and finalize_model_grads divides them by the global
    # batch's token count (distributed_data_parallel.py, finalize_model_grads.py).
    calculate_per_token_loss: bool = False
    # --ddp-average-in-collective: no pre-scale; the collective averages (ReduceOp.AVG).
    ddp_average_in_collective: bool = False
    # Mixture of experts (--num-experts): None for a dense model.
    moe: MoEConfig | None = None
    # Hybrid Mamba model (--hybrid-layer-pattern): None for a GPT model.
    hybrid: HybridConfig | None = None
    # --optimizer (adam or sgd) and what SGD's build reads (verify/preflight/optimizer.py).
    optimizer: OptimizerChoice = OptimizerChoice()
    # Megatron-FSDP or torch FSDP2 in place of DDP (verify/preflight/sharded_dp.py); None: DDP.
    sharded_dp: ShardedDPConfig | None = None
    # --qk-layernorm / --qk-l2-norm, and multi-token prediction (--mtp-num-layers; None without):
    # verify/preflight/mtp.py.
    qk_layernorm: bool = False
    qk_l2_norm: bool = False
    mtp: MTPConfig | None = None
    megatron: str = MEGATRON_LM  # whose rules resolved and checked this configuration
    spelling: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    notes: tuple[str, ...] = ()
    # What resolving the launch refused before the configuration's own rules, and the values
    # those refusals leave undefined (placeholders here, never read: the rules that need them
    # are not checked). A configuration with either is never built: construction raises one
    # ConfigError listing them with every rule of check_config it can decide.
    refused: tuple[Refusal, ...] = field(default=(), compare=False, repr=False)
    undefined: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def _name(self, attribute: str) -> str:
        return flag_name(attribute, self.spelling)

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ParallelDims):
            raise TypeError(f"PreflightConfig.dims must be a ParallelDims, got "
                            f"{type(self.dims).__name__}")
        if self.dims.built:
            raise ValueError("PreflightConfig.dims must be sizes only (a configuration on paper)")
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise TypeError(f"PreflightConfig.moe must be a MoEConfig or None, got "
                            f"{type(self.moe).__name__}")
        if self.hybrid is not None and not isinstance(self.hybrid, HybridConfig):
            raise TypeError(f"PreflightConfig.hybrid must be a HybridConfig or None, got "
                            f"{type(self.hybrid).__name__}")
        if not isinstance(self.optimizer, OptimizerChoice):
            raise TypeError(f"PreflightConfig.optimizer must be an OptimizerChoice, got "
                            f"{type(self.optimizer).__name__}")
        if self.sharded_dp is not None and not isinstance(self.sharded_dp, ShardedDPConfig):
            raise TypeError(f"PreflightConfig.sharded_dp must be a ShardedDPConfig or None, got "
                            f"{type(self.sharded_dp).__name__}")
        if self.mtp is not None and not isinstance(self.mtp, MTPConfig):
            raise TypeError(f"PreflightConfig.mtp must be an MTPConfig or None, got "
                            f"{type(self.mtp).__name__}")
        found, not_checked = check_config(self)
        if self.refused or found:
            raise ConfigError([*self.refused, *found], not_checked=not_checked)
        if self.undefined:
            raise ValueError(f"PreflightConfig: {sorted(self.undefined)} undefined, yet no refusal "
                             "says why")

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
        """The transformer layers of every (pipeline stage, model chunk), as Megatron splits them
        (a hybrid pattern's '|' segments: :meth:`HybridConfig.stage_layers`)."""
        if self.hybrid is not None and self.hybrid.has_pipes:
            return PipelineSplit.of_segments(self.hybrid.stage_layers(
                self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size))
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
        """Megatron's bucket size when --ddp-bucket-size is not given: gradvocab's rule over
        DP x CP (megatron/training/training.py resolve_ddp_bucket_size, over the dp_cp group)."""
        return default_bucket_size(self.data_context_parallel_size)

    @property
    def first_stage_bucket_size(self) -> int | None:
        """Bucket size of pipeline rank 0's first chunk; None (one bucket) without overlap."""
        # megatron/training/training.py resolve_ddp_bucket_size: None if not overlap_grad_reduce;
        # not resolved at all for torch FSDP2 (get_model:1848).
        if not self.overlap_grad_reduce or self.torch_fsdp2:
            return None
        return self.ddp_bucket_size if self.ddp_bucket_size is not None else self.default_bucket_size

    @property
    def averaging(self) -> Averaging:
        """How production combines the DP x CP grads: the two flags converted, here only.
        SUM under --calculate-per-token-loss (finalize_model_grads divides by the token count
        after the reduction), AVG under --ddp-average-in-collective, else PRESCALE
        (megatron/core/distributed/distributed_data_parallel.py:179-203)."""
        if self.sharded_dp is not None:  # the op of ShardedDPConfig.averaging, as an Averaging
            summed = self.calculate_per_token_loss and self.sharded_dp.implementation == MEGATRON_FSDP
            return Averaging.from_megatron(average=not summed,
                                           average_in_collective=self.grad_reduce_op == "AVG")
        if self.calculate_per_token_loss and self.ddp_average_in_collective:
            # refused at the DDP wrap (_ddp_wrap); reported as the collective would run
            return Averaging.AVG
        return Averaging.from_megatron(average=not self.calculate_per_token_loss,
                                       average_in_collective=self.ddp_average_in_collective)

    @property
    def gradient_scaling_factor(self) -> float:
        """What Megatron-Core's DDP multiplies each bucket's grads by before the collective:
        1/(DP x CP) for PRESCALE, else 1.0 (``averaging``'s pre-scale; None is 1.0); under
        fully-sharded DP, :meth:`ShardedDPConfig.averaging`'s."""
        if self.sharded_dp is not None:
            return self._sharded_averaging[0]
        pre_scale = self.averaging.factors(self.data_context_parallel_size).pre_scale
        return 1.0 if pre_scale is None else pre_scale

    @property
    def grad_reduce_op(self) -> str:
        """The grad collective's op by name, "AVG" or "SUM" (``averaging.reduce_op``;
        megatron/core/distributed/param_and_grad_buffer.py start_grad_sync:664-666); under
        Megatron-FSDP also "PREMUL_SUM" (:meth:`ShardedDPConfig.averaging`)."""
        if self.sharded_dp is not None:
            return self._sharded_averaging[1]
        return self.averaging.reduce_op.name

    @property
    def grad_averaging(self) -> str:
        """How the DP x CP average of the grads is formed, in words."""
        if self.sharded_dp is not None:
            return self._sharded_averaging[2]
        n, wire = self.data_context_parallel_size, self.grad_dtype
        if self.averaging is Averaging.SUM:
            return (f"per-token loss: grads summed unscaled over DP x CP = {n}, then x 1/T in "
                    f"{wire} after the reduction (T: the global batch's loss-mask tokens, "
                    "all-reduced; finalize_model_grads.py)")
        if self.averaging is Averaging.AVG:
            return (f"ReduceOp.AVG over DP x CP = {n} (no pre-scale; NCCL multiplies each "
                    f"grad by 1/{n} rounded to {wire}, then sums)")
        return f"x 1/{n} in {wire} before the collective, then ReduceOp.SUM over DP x CP = {n}"

    @property
    def torch_fsdp2(self) -> bool:
        """Whether torch FSDP2 wraps the chunks (no bucketed buffer of Megatron's)."""
        return self.sharded_dp is not None and self.sharded_dp.implementation == TORCH_FSDP2

    @property
    def _sharded_averaging(self) -> tuple[float, str, str]:
        return self.sharded_dp.averaging(self.data_context_parallel_size,
                                         self.calculate_per_token_loss,
                                         self.ddp_average_in_collective)

    @property
    def qk_norm_params(self) -> bool:
        """Whether every attention layer has q/k layernorm parameters (verify/preflight/mtp.py)."""
        return qk_norm_params(self.qk_layernorm, self.qk_l2_norm)

    @property
    def word_embedding_all_reduce(self) -> bool:
        """Whether the first and last stage all-reduce the word embeddings' grads: PP > 1 with
        tied embeddings or MTP (finalize_model_grads.py:132-147)."""
        return self.pipeline_model_parallel_size > 1 and (self.tied_embeddings or self.mtp is not None)

    @property
    def expert_data_parallel_size(self) -> int | None:
        """The expert grid's DP: world / (ETP x EP x PP), world = TP x PP x CP x DP
        (megatron/core/parallel_state.py:874-880; the expert grid has no CP). None without
        experts."""
        if self.moe is None:
            return None
        world = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                 * self.context_parallel_size * self.data_parallel_size)
        return expert_data_parallel_size(world, self.moe, self.pipeline_model_parallel_size)

    @property
    def expert_buffers(self) -> bool:
        """Whether DDP builds expert buffers (the experts' params ``allreduce=False``)."""
        return self.moe is not None and self.moe.expert_params_in_own_buffer(
            self.tensor_model_parallel_size)

    @property
    def expert_gradient_scaling_factor(self) -> float | None:
        """What DDP multiplies the expert buffers' grads by before their collective over expert
        DP (distributed_data_parallel.py:185-216): 1.0 under per-token loss; EDP / (DP x CP)
        under --ddp-average-in-collective (then ReduceOp.AVG over EDP: 1/(DP x CP) in all);
        else 1/(DP x CP), as the dense grads. None without expert buffers."""
        if not self.expert_buffers:
            return None
        if self.averaging is Averaging.SUM:
            return 1.0
        if self.averaging is Averaging.AVG:
            return self.expert_data_parallel_size / self.data_context_parallel_size
        return 1.0 / self.data_context_parallel_size

    @property
    def expert_grad_averaging(self) -> str | None:
        """How the expert grads' DP average is formed, in words (None without expert buffers)."""
        if not self.expert_buffers:
            return None
        edp, n, wire = (self.expert_data_parallel_size, self.data_context_parallel_size,
                        self.grad_dtype)
        if self.averaging is Averaging.SUM:
            return (f"per-token loss: expert grads summed unscaled over expert DP = {edp}, then "
                    f"x 1/T after the reduction (finalize_model_grads.py)")
        if self.averaging is Averaging.AVG:
            return (f"x {edp}/{n} (expert DP / (DP x CP)) in {wire}, then ReduceOp.AVG over "
                    f"expert DP = {edp}: 1/{n} in all")
        return f"x 1/{n} in {wire} before the collective, then ReduceOp.SUM over expert DP = {edp}"

    def to_dict(self) -> dict:
        """JSON-ready settings, with the derived microbatch count and layers per stage and chunk."""
        sizes = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size", "data_parallel_size",
                 "context_parallel_size", "sequence_parallel")
        out = {k: getattr(self, k) for k in sizes}
        out |= {k: getattr(self, k) for k in self.__dataclass_fields__
                if k not in ("spelling", "dims", "refused", "undefined", "moe", "hybrid",
                             "optimizer", "sharded_dp", "mtp")}
        out["optimizer"] = self.optimizer.to_dict()
        out["notes"] = list(self.notes)
        out["num_microbatches"] = self.num_microbatches
        out["data_context_parallel_size"] = self.data_context_parallel_size
        out["gradient_scaling_factor"] = self.gradient_scaling_factor
        out["grad_reduce_op"] = self.grad_reduce_op
        out["grad_averaging"] = self.grad_averaging
        out["layers_per_stage_and_chunk"] = [list(row) for row in self.layer_split.layers]
        out["sharded_dp"] = None if self.sharded_dp is None else self.sharded_dp.to_dict()
        if self.moe is not None:
            out["moe"] = self.moe.to_dict() | {
                "moe_layers": [i for i, m in enumerate(self.moe.moe_layers(self.num_layers)) if m],
                "expert_data_parallel_size": self.expert_data_parallel_size,
                "expert_buffers": self.expert_buffers,
                "expert_gradient_scaling_factor": self.expert_gradient_scaling_factor,
                "expert_grad_averaging": self.expert_grad_averaging}
        if self.hybrid is not None:
            out["hybrid"] = self.hybrid.to_dict(self.hidden_size)
        out["mtp"] = None if self.mtp is None else self.mtp.to_dict()
        out["qk_norm_params"] = self.qk_norm_params
        out["word_embedding_all_reduce"] = self.word_embedding_all_reduce
        return out


# --------------------------------------------------------------------------- the rules
# A rule yields each refusal it finds, and a note for each part it cannot decide (a value it
# would read comes from one refused by an earlier rule).
Rule = Callable[[PreflightConfig], Iterator["Refusal | str"]]
# What a refusal can leave undefined, named for the "not checked" notes.
_UNDEFINED_NAMES = {"data_parallel_size": "DP (world size / (TP x PP x CP))",
                    "expert_grid": "the expert grid (ETP, EP)",
                    "virtual_pipeline_model_parallel_size": "the virtual pipeline size"}


def check_config(c: PreflightConfig) -> tuple[list[Refusal], list[str]]:
    """Every rule of :data:`RULES` on ``c``: (the refusals, in Megatron-LM's order; the rules
    not decided because a value they read is undefined, each saying which). A size that is
    not a positive integer is refused first, and counts as undefined for the rules after."""
    invalid = {a: getattr(c, a) for a in _POSITIVE if a not in c.undefined
               and not _is_positive_int(getattr(c, a))}
    found = [Refusal(f"{_UNDEFINED_NAMES.get(a) or c._name(a)} must be a positive integer, got "
                     f"{value!r}", "validate_args") for a, value in invalid.items()]
    undefined = c.undefined | set(invalid)
    not_checked: list[str] = []
    for rule, needs, what in RULES:
        if rule in _INTERLEAVED and _VPP not in undefined and c.virtual_pipeline_model_parallel_size == 1:
            continue  # no interleaving: nothing to check, nothing left unchecked
        if (rule in _MOE and c.moe is None) or (rule is _mtp_build and c.mtp is None):
            continue  # no experts, no MTP: likewise
        if c.hybrid is not None and rule in _HYBRID_BUILDS and not c.hybrid.builds(_HYBRID_BUILDS[rule]):
            continue  # a hybrid model without layers of the kind the rule builds
        missing = [n for n in needs if n in undefined]
        if missing:
            names = ", ".join(_UNDEFINED_NAMES.get(m) or c._name(m) for m in missing)
            not_checked.append(f"{what}: it reads {names}, which a refusal above leaves "
                               "undefined or concerns")
            continue
        for item in rule(c):
            (not_checked if isinstance(item, str) else found).append(item)
    return sorted(found, key=lambda r: r.order), not_checked


def _is_positive_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _choices(c: PreflightConfig) -> Iterator[Refusal]:
    """argparse's choices (a PreflightConfig built in code can break them)."""
    if c.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        yield Refusal(f"--position-embedding-type must be one of {POSITION_EMBEDDING_TYPES}, "
                      f"got {c.position_embedding_type!r}", "parse_args")
    if c.normalization not in NORMALIZATIONS:
        yield Refusal(f"--normalization must be one of {NORMALIZATIONS}, got "
                      f"{c.normalization!r}", "parse_args")
    if c.ddp_bucket_size is not None and c.ddp_bucket_size < 1:
        yield Refusal(f"--ddp-bucket-size must be a positive integer, got {c.ddp_bucket_size}",
                      "DDP config")


def _grid(c: PreflightConfig) -> Iterator[Refusal]:
    """megatron/training/arguments.py:430 validate_args: ``world_size % (TP x PP x CP) == 0``,
    then ``data_parallel_size = world_size // (TP x PP x CP)`` (:446)."""
    tp, pp, cp, dp = (c.tensor_model_parallel_size, c.pipeline_model_parallel_size,
                      c.context_parallel_size, c.data_parallel_size)
    if "data_parallel_size" in c.undefined:
        return  # resolve refused the world's split already
    if c.world_size is not None and c.world_size != tp * pp * cp * dp:
        n = c._name
        yield Refusal(
            f"world size {c.world_size} ({c.world_size_source}) must equal "
            f"{n('tensor_model_parallel_size')} ({tp}) x {n('pipeline_model_parallel_size')} "
            f"({pp}) x {n('context_parallel_size')} ({cp}) x DP ({dp}) = {tp * pp * cp * dp}",
            "validate_args", 430)


def _batch(c: PreflightConfig) -> Iterator[Refusal]:
    """megatron/core/num_microbatches_calculator.py ConstantNumMicroBatchesCalculator. Without
    an evaluation batch flag validate_args:694 checks the same division first (the evaluation
    batch defaults to the training one)."""
    n = c._name
    unit = c.micro_batch_size * c.data_parallel_size
    eval_given = "eval_micro_batch_size" in c.spelling or "eval_global_batch_size" in c.spelling
    if not c.decrease_batch_size_if_needed and c.global_batch_size % unit:
        yield Refusal(
            f"{n('global_batch_size')} ({c.global_batch_size}) must be divisible by "
            f"{n('micro_batch_size')} ({c.micro_batch_size}) x data-parallel size "
            f"({c.data_parallel_size}) = {unit} (megatron/core/num_microbatches_calculator.py)",
            *(("set_global_variables", 0) if eval_given else ("validate_args", 694)))
    elif c.num_microbatches < 1:
        yield Refusal(
            f"{n('global_batch_size')} ({c.global_batch_size}) rounded down to a multiple of "
            f"{n('micro_batch_size')} x DP ({unit}) leaves no microbatch "
            "(num_microbatches_calculator.py: 'number of microbatches should be at least 1')",
            "set_global_variables")


def _sequence_over_cp(c: PreflightConfig) -> Iterator[Refusal]:
    """megatron/training/arguments.py:1296 validate_args: the sequence over twice CP."""
    n, cp = c._name, c.context_parallel_size
    if cp > 1 and c.seq_length % (2 * cp):
        yield Refusal(f"{n('seq_length')} ({c.seq_length}) must be a multiple of 2 x "
                      f"{n('context_parallel_size')} = {2 * cp} "
                      "(megatron/training/arguments.py validate_args)", "validate_args", 1296)


def _position_length(c: PreflightConfig) -> Iterator[Refusal]:
    """megatron/training/arguments.py:1314 validate_args."""
    n = c._name
    if c.max_position_embeddings < c.seq_length:
        yield Refusal(f"{n('max_position_embeddings')} ({c.max_position_embeddings}) must be >= "
                      f"{n('seq_length')} ({c.seq_length}) (validate_args)", "validate_args", 1314)


def _heads_split_hidden(c: PreflightConfig) -> Iterator[Refusal]:
    """megatron/training/arguments.py:1292 validate_args: ``assert args.hidden_size %
    args.num_attention_heads == 0`` when --kv-channels is not given."""
    n = c._name
    if "kv_channels" not in c.spelling and c.hidden_size % c.num_attention_heads:
        yield Refusal(f"{n('hidden_size')} ({c.hidden_size}) must be divisible by "
                      f"{n('num_attention_heads')} ({c.num_attention_heads}) "
                      "(validate_args, --kv-channels not given)", "validate_args", 1292)


def _heads_over_tp(c: PreflightConfig) -> Iterator[Refusal]:
    """megatron/core/transformer/transformer_config.py:1325 TransformerConfig.__post_init__."""
    n, tp = c._name, c.tensor_model_parallel_size
    if c.num_attention_heads % tp:
        yield Refusal(f"{n('num_attention_heads')} ({c.num_attention_heads}) must be a multiple "
                      f"of {n('tensor_model_parallel_size')} ({tp}) "
                      "(TransformerConfig.__post_init__)", "TransformerConfig", 1325)


def _groups_and_tp(c: PreflightConfig) -> Iterator[Refusal | str]:
    """transformer_config.py:1338-1345: query groups a multiple or a divisor of TP (fewer
    groups than TP ranks is allowed: attention.py:355-361 all-gathers the QKV projection)."""
    n, tp, groups = c._name, c.tensor_model_parallel_size, c.num_query_groups
    if groups == c.num_attention_heads and c.num_attention_heads % tp:
        # The groups are the heads (no GQA), refused over TP just before: one cause, one refusal.
        return
    if groups % tp and tp % groups:
        yield Refusal(f"{n('num_query_groups')} ({groups}) must be a multiple or a divisor of "
                      f"{n('tensor_model_parallel_size')} ({tp}) (TransformerConfig.__post_init__)",
                      "TransformerConfig", 1338)


def _fp8_param(c: PreflightConfig) -> Iterator[Refusal]:
    """transformer_config.py:1439: 'fp8_param must be used together with fp8 mode'."""
    if c.fp8_param_gather and c.fp8_format is None:
        yield Refusal("--fp8-param-gather requires FP8, --fp8-format e4m3 or hybrid "
                      "(TransformerConfig.__post_init__: 'fp8_param must be used together "
                      "with fp8 mode'; --fp8-recipe alone does not turn FP8 on)",
                      "TransformerConfig", 1439)


def _deferral(c: PreflightConfig) -> Iterator[Refusal]:
    """megatron/core/model_parallel_config.py:545-558 __post_init__ (three ValueErrors)."""
    if not c.defer_embedding_wgrad_compute:
        return
    n = c._name
    if c.pipeline_model_parallel_size == 1:
        yield Refusal(f"{n('defer_embedding_wgrad_compute')} requires pipeline parallelism "
                      f"({n('pipeline_model_parallel_size')} > 1)", "ModelParallelConfig", 545)
    if not c.gradient_accumulation_fusion:
        yield Refusal(f"{n('defer_embedding_wgrad_compute')} requires gradient accumulation "
                      "fusion (remove --no-gradient-accumulation-fusion)", "ModelParallelConfig", 550)
    if c.wgrad_deferral_limit < 0:
        yield Refusal(f"{n('wgrad_deferral_limit')} must be >= 0 with "
                      f"{n('defer_embedding_wgrad_compute')}, got {c.wgrad_deferral_limit}",
                      "ModelParallelConfig", 555)


def _buffers(c: PreflightConfig) -> Iterator[Refusal]:
    """The DDP config and validate_args' rules on the optimizer's buffers."""
    # distributed_data_parallel_config.py:254 __post_init__: 'Reuse grad buffer only when
    # keeping params in MXFP8.'
    if c.reuse_grad_buf_for_mxfp8_param_ag and not c.fp8_param_gather:
        yield Refusal("--reuse-grad-buf-for-mxfp8-param-ag requires --fp8-param-gather (reuse "
                      "the grad buffer only when keeping params in MXFP8)", "DDP config", 254)
    # validate_args:1060: '--fp8-param-gather only supported with distributed optimizer'.
    if c.fp8_param_gather and not c.use_distributed_optimizer:
        yield Refusal("--fp8-param-gather requires --use-distributed-optimizer",
                      "validate_args", 1060)
    # validate_args:990-993: --overlap-param-gather needs the distributed optimizer and 'Must
    # use --overlap-param-gather with --overlap-grad-reduce'.
    if c.overlap_param_gather and not c.use_distributed_optimizer:
        yield Refusal("--overlap-param-gather requires --use-distributed-optimizer",
                      "validate_args", 990)
    if c.overlap_param_gather and not c.overlap_grad_reduce:
        yield Refusal("--overlap-param-gather requires --overlap-grad-reduce", "validate_args", 993)


def _layer_split(c: PreflightConfig) -> Iterator[Refusal]:
    """TransformerConfig's split rules and transformer_block.py get_num_layers_to_build."""
    try:
        c.layer_split  # noqa: B018 - raises where Megatron does
    except SplitError as exc:
        yield Refusal(str(exc), exc.stage, exc.line)


def _interleaving(c: PreflightConfig) -> Iterator[Refusal]:
    """validate_args:967-975: interleaving needs PP > 1 with p2p overlap (the default), PP > 2
    without."""
    if c.virtual_pipeline_model_parallel_size == 1:
        return
    n, pp = c._name, c.pipeline_model_parallel_size
    minimum = 2 if c.overlap_p2p_comm else 3
    if pp < minimum:
        yield Refusal(
            f"{_vpp_flag(c)} (VPP {c.virtual_pipeline_model_parallel_size}, interleaved schedule) "
            f"requires {n('pipeline_model_parallel_size')} >= {minimum}"
            f"{'' if c.overlap_p2p_comm else ' with --no-overlap-p2p-communication'}, got {pp}",
            "validate_args", 967 if c.overlap_p2p_comm else 972)


def _interleaved_microbatches(c: PreflightConfig) -> Iterator[Refusal]:
    """schedules.py forward_backward_pipelining_with_interleaving: the checks on M."""
    if c.virtual_pipeline_model_parallel_size == 1 or c.pipeline_model_parallel_size < 2:
        return
    pp = c.pipeline_model_parallel_size
    group = c.microbatch_group_size_per_vp_stage or pp
    try:
        interleaved_microbatch_check(c.num_microbatches, pp, group, c._name)
    except SplitError as exc:
        yield Refusal(f"{_vpp_flag(c)} (VPP {c.virtual_pipeline_model_parallel_size}): {exc}",
                      exc.stage, exc.line)


def _vpp_flag(c: PreflightConfig) -> str:
    if "num_layers_per_virtual_pipeline_stage" in c.spelling:
        return c._name("num_layers_per_virtual_pipeline_stage")
    return c._name("virtual_pipeline_model_parallel_size")


def _tp_divides(c: PreflightConfig, size: int, what: str, where: str) -> Iterator[Refusal]:
    tp = c.tensor_model_parallel_size
    if size % tp:
        yield Refusal(f"{what} ({size}) must be divisible by {c._name('tensor_model_parallel_size')} "
                      f"({tp}) ({where} divide())", "model build")


def _heads_per_group(c: PreflightConfig) -> Iterator[Refusal]:
    """megatron/core/transformer/attention.py:355-366 Attention.__init__ divides the heads by
    the query groups where there are fewer groups than TP ranks (and by TP otherwise, which
    TransformerConfig already requires); Transformer Engine's DotProductAttention, of the
    default --transformer-impl, asserts 'The number of attention heads must be divisible by
    the number of GQA groups!' otherwise."""
    n, heads, groups = c._name, c.num_attention_heads, c.num_query_groups
    if heads % groups:
        yield Refusal(f"{n('num_attention_heads')} ({heads}) must be a multiple of "
                      f"{n('num_query_groups')} ({groups}) (Transformer Engine's "
                      "DotProductAttention; attention.py divide() when groups < TP)", "model build")


def _qkv_over_tp(c: PreflightConfig) -> Iterator[Refusal | str]:
    """linear_qkv, a ColumnParallelLinear of (heads + 2 x groups) x kv channels outputs
    (attention.py SelfAttention.__init__; megatron/core/tensor_parallel/layers.py:880
    ``divide(output_size, world_size)``)."""
    if "kv_channels" not in c.spelling and c.hidden_size % c.num_attention_heads:
        yield (f"the QKV projection over TP: its kv channels default to "
               f"{c._name('hidden_size')} / {c._name('num_attention_heads')}, refused above")
        return
    size = (c.num_attention_heads + 2 * c.num_query_groups) * c.kv_channels
    yield from _tp_divides(c, size, "the QKV projection's output (heads + 2 x query groups) x "
                           "kv channels", "megatron/core/tensor_parallel/layers.py")


def _ffn_over_tp(c: PreflightConfig) -> Iterator[Refusal]:
    """linear_fc2, a RowParallelLinear of ffn inputs (layers.py RowParallelLinear
    ``divide(input_size, world_size)``; linear_fc1's 2 x ffn under SwiGLU then divides too)."""
    n = c._name
    what = (n("ffn_hidden_size") if "ffn_hidden_size" in c.spelling else
            f"the FFN size (Megatron's default for {n('hidden_size')} {c.hidden_size}"
            f"{' under --swiglu: int(4 h x 2/3 / 64) x 64' if c.swiglu else ': 4 h'}; "
            f"{n('ffn_hidden_size')} not given)")
    yield from _tp_divides(c, c.ffn_hidden_size, what, "megatron/core/tensor_parallel/layers.py")


def _vocab_over_tp(c: PreflightConfig) -> Iterator[Refusal]:
    """VocabParallelEmbedding and the output layer: tensor_parallel/utils.py:118
    VocabUtility.vocab_range_from_global_vocab_size ``divide(global_vocab_size, world_size)``."""
    yield from _tp_divides(c, c.padded_vocab_size, c._name("padded_vocab_size"),
                           "megatron/core/tensor_parallel/utils.py")


def _mamba_mixers(c: PreflightConfig) -> Iterator[Refusal]:
    """Building the Mamba mixers (:mod:`verify.preflight.hybrid`)."""
    if c.hybrid is not None:
        yield from mixer_refusals(c.hybrid, c.hidden_size, c.tensor_model_parallel_size,
                                  c.fp8_format is not None, c._name)


def _ddp_wrap(c: PreflightConfig) -> Iterator[Refusal]:
    """megatron/core/distributed/distributed_data_parallel.py:180-182 DistributedDataParallel
    .__init__ (get_model wraps each chunk): 'Cannot average in collective when calculating
    per-token loss!'."""
    # Megatron-FSDP and torch FSDP2 have no such assert (sharded_dp.py ShardedDPConfig.averaging).
    if c.sharded_dp is None and c.calculate_per_token_loss and c.ddp_average_in_collective:
        yield Refusal(f"{c._name('calculate_per_token_loss')} cannot be combined with "
                      f"{c._name('ddp_average_in_collective')}: per-token loss sums the grads and "
                      "divides by the token count after the reduction, so the collective must "
                      "not average (megatron/core/distributed/distributed_data_parallel.py "
                      "DistributedDataParallel.__init__: 'Cannot average in collective when "
                      "calculating per-token loss!')", "DDP wrap")


def _expert_grid(c: PreflightConfig) -> Iterator[Refusal]:
    """parallel_state.py:881: the world over ETP x EP x PP (:mod:`verify.preflight.moe`)."""
    if c.moe is None:
        return
    world = (c.tensor_model_parallel_size * c.pipeline_model_parallel_size
             * c.context_parallel_size * c.data_parallel_size)
    yield from expert_grid_refusals(c.moe, world, c.pipeline_model_parallel_size, c._name)


def _experts_config(c: PreflightConfig) -> Iterator[Refusal]:
    """TransformerConfig.__post_init__'s MoE rules (:mod:`verify.preflight.moe`)."""
    if c.moe is not None:
        yield from transformer_config_refusals(c.moe, c.add_bias_linear, c._name)


def _experts_build(c: PreflightConfig) -> Iterator[Refusal]:
    """Building the MoE layers (:mod:`verify.preflight.moe`)."""
    if c.moe is not None:
        yield from model_build_refusals(c.moe, c.num_layers, c.tensor_model_parallel_size,
                                        c.swiglu, c.add_bias_linear, c._name)


def _learning_rate(c: PreflightConfig) -> Iterator[Refusal]:
    """validate_args:1320 on --lr (:mod:`verify.preflight.optimizer`)."""
    yield from learning_rate_refusals(c.optimizer, c._name)


def _optimizer_build(c: PreflightConfig) -> Iterator[Refusal]:
    """The SGD constructor's checks, before the grad scaler (:mod:`verify.preflight.optimizer`)."""
    yield from optimizer_build_refusals(c.optimizer, c._name)


def _distributed_sgd(c: PreflightConfig) -> Iterator[Refusal]:
    """DistributedOptimizer's assert, after the grad scaler (:mod:`verify.preflight.optimizer`)."""
    megatron_fsdp = c.sharded_dp is not None and c.sharded_dp.implementation == MEGATRON_FSDP
    yield from distributed_optimizer_refusals(c.optimizer, c.use_distributed_optimizer, c._name,
                                              megatron_fsdp)


def _mtp_position(c: PreflightConfig) -> Iterator[Refusal]:
    """validate_args:856: MTP with rope or no position embeddings (:mod:`verify.preflight.mtp`)."""
    if c.mtp is not None:
        yield from mtp_validate_args_refusals(c.mtp, c.position_embedding_type, c._name)


def _mtp_build(c: PreflightConfig) -> Iterator[Refusal]:
    """Building the MTP layers (:mod:`verify.preflight.mtp`)."""
    if c.mtp is not None:
        yield from mtp_build_refusals(c.mtp, c.hidden_size, c.tensor_model_parallel_size, c._name)


def _optimizer(c: PreflightConfig) -> Iterator[Refusal]:
    """The grad scaler's asserts (megatron/core/optimizer/grad_scaler.py) and preflight's
    own: a finite --clip-grad >= 0, whole positive --loss-scale-window and --hysteresis."""
    n = c._name
    if not (math.isfinite(c.clip_grad) and c.clip_grad >= 0):
        yield Refusal(f"{n('clip_grad')} must be a finite number >= 0 (0 turns clipping off), "
                      f"got {c.clip_grad}", "optimizer")
    for attribute in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
        value = getattr(c, attribute)
        if value is not None and not (math.isfinite(value) and value > 0):
            yield Refusal(f"{n(attribute)} must be a finite number > 0, got {value}", "optimizer")
    if c.min_loss_scale > c.initial_loss_scale:
        yield Refusal(f"{n('min_loss_scale')} ({c.min_loss_scale:g}) must be <= "
                      f"{n('initial_loss_scale')} ({c.initial_loss_scale:g})", "optimizer")
    for attribute in ("loss_scale_window", "hysteresis"):
        value = getattr(c, attribute)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            yield Refusal(f"{n(attribute)} must be a positive integer, got {value!r}", "optimizer")


_BATCH = ("data_parallel_size", "micro_batch_size", "global_batch_size")
_TP, _PP, _VPP = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "virtual_pipeline_model_parallel_size")
_INTERLEAVED = (_interleaving, _interleaved_microbatches)
_MOE = (_expert_grid, _experts_config, _experts_build)
# The model-build rules of a layer kind a hybrid pattern may leave out (hybrid_block.py builds
# only the layers of its pattern): attention's and the MLP's.
_HYBRID_BUILDS = {_heads_per_group: ATTENTION, _qkv_over_tp: ATTENTION, _ffn_over_tp: MLP}
# (rule, the values it reads that a refusal can leave undefined, what it checks), in the
# order preflight runs them; check_config sorts what they find into Megatron-LM's order.
RULES: tuple[tuple[Rule, tuple[str, ...], str], ...] = (
    (_choices, (), "choices"),
    (_grid, (), "the world size's split into TP x PP x CP x DP"),
    (_batch, _BATCH, "the microbatch count"),
    (_sequence_over_cp, ("seq_length", "context_parallel_size"), "the sequence over 2 x CP"),
    (_position_length, ("seq_length", "max_position_embeddings"), "the position embeddings' length"),
    (_heads_split_hidden, ("hidden_size", "num_attention_heads"), "the hidden size over the heads"),
    (_heads_over_tp, ("num_attention_heads", _TP), "the heads over TP"),
    (_groups_and_tp, ("num_query_groups", "num_attention_heads", _TP), "the query groups and TP"),
    (_fp8_param, (), "FP8 params"),
    (_mtp_position, (), "multi-token prediction's position embeddings"),
    (_expert_grid, ("data_parallel_size", "expert_grid", _TP, _PP), "the expert grid"),
    (_experts_config, (), "the MoE settings"),
    (_deferral, (_PP,), "the embedding wgrad deferral"),
    (_buffers, (), "the DDP buffers"),
    (_layer_split, ("num_layers", _PP, _VPP), "the layer split"),
    (_interleaving, (_PP, _VPP), "the interleaved schedule's PP"),
    (_interleaved_microbatches, (*_BATCH, _PP, _VPP), "the interleaved schedule's microbatches"),
    (_heads_per_group, ("num_attention_heads", "num_query_groups"), "the heads per query group"),
    (_qkv_over_tp, ("num_attention_heads", "num_query_groups", "kv_channels", "hidden_size", _TP),
     "the QKV projection over TP"),
    (_ffn_over_tp, ("ffn_hidden_size", _TP), "the FFN over TP"),
    (_vocab_over_tp, ("padded_vocab_size", _TP), "the vocabulary over TP"),
    (_experts_build, ("num_layers", "moe_ffn_hidden_size", "moe_layer_freq", _TP),
     "the MoE layers"),
    (_mamba_mixers, ("hidden_size", _TP), "the Mamba mixers"),
    (_mtp_build, ("hidden_size", _TP), "the MTP projection over TP"),
    (_ddp_wrap, (), "the DDP wrap"),
    (_learning_rate, (), "the learning rate"),
    (_optimizer_build, (), "the SGD optimizer's build"),
    (_optimizer, (), "the optimizer"),
    (_distributed_sgd, (), "SGD with the distributed optimizer"),
)


__all__ = ["ConfigError", "DTYPE_BYTES", "RULES", "PreflightConfig", "check_config", "flag_name"]

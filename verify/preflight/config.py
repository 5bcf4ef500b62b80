"""The user's training configuration, resolved and validated as Megatron-LM does it.

:func:`verify.preflight.resolve.resolve` turns a parsed launch into a
:class:`PreflightConfig`, applying the defaults and silent adjustments of
Megatron-LM's ``validate_args`` (each recorded in ``notes``); the dataclass's
``__post_init__`` then enforces the rules that make production refuse to start
(:mod:`verify.preflight.rules`), naming the flags in the message. The rules
are those of :data:`~verify.preflight.flags.MEGATRON_LM` and cite the file and
function they come from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from verify.preflight.flags import MEGATRON_LM, flag_of
from verify.preflight.pipeline_split import PipelineSplit, split_layers
from verify.preflight.rules import ConfigError, check_config

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


def flag_name(attribute: str, spelling: Mapping[str, str]) -> str:
    """The flag the user wrote for ``attribute`` (Megatron's spelling when not given)."""
    return flag_of(_DEST.get(attribute, attribute), spelling)


@dataclass(frozen=True)
class PreflightConfig:
    """Resolved Megatron settings (Megatron's attribute names); validates itself."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int  # 1 = no interleaving
    data_parallel_size: int  # world / (TP x PP x CP)
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
    sequence_parallel: bool
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
    context_parallel_size: int = 1
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
        check_config(self)

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
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("spelling",)}
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


__all__ = ["ConfigError", "DTYPE_BYTES", "PreflightConfig", "flag_name", "pad_vocab_size"]

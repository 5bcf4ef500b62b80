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

from gradvocab import ParallelDims
from verify.preflight.config import (
    DEFAULT_CLIP_GRAD,
    DEFAULT_HYSTERESIS,
    DEFAULT_INITIAL_LOSS_SCALE,
    DEFAULT_LOSS_SCALE_WINDOW,
    DEFAULT_MIN_LOSS_SCALE,
    ConfigError,
    PreflightConfig,
    flag_name,
)
from verify.preflight.flags import ParsedFlags, Refusal
from verify.preflight.hybrid import read_hybrid
from verify.preflight.moe import LayerFreqError, MoEConfig, parse_layer_freq
from verify.preflight.mtp import mtp_from_flags
from verify.preflight.optimizer import (
    DEFAULT_MIN_LR,
    DEFAULT_SGD_MOMENTUM,
    DEFAULT_WEIGHT_DECAY,
    OptimizerChoice,
)
from verify.preflight.pipeline_split import SplitError, virtual_pipeline_size
from verify.preflight.sharded_dp import resolve_sharded_dp

# validate_args: 'no longer valid' flags, what replaced them, and the line that refuses them.
_REMOVED = {"batch_size": ("--micro-batch-size", 574),
            "model_parallel_size": ("--tensor-model-parallel-size", 580),
            "checkpoint_activations": ("--recompute-activations (or --recompute-granularity)", 584)}
# A value a refusal leaves undefined is carried as this placeholder, which no rule reads: the
# rules that need it are not checked (PreflightConfig.undefined), and the configuration is
# never built.
_PLACEHOLDER = 1


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
        raise ConfigError(Refusal(
            f"{flag_name('virtual_pipeline_model_parallel_size', spelling)} (VPP {vpp}, "
            f"interleaved schedule) requires {flag_name('pipeline_model_parallel_size', spelling)}"
            f" >= 2, got {pp}", "validate_args", 967))
    if sequence_parallel and tp == 1:
        raise ConfigError(f"{flag_name('sequence_parallel', spelling)} needs "
                          f"{flag_name('tensor_model_parallel_size', spelling)} > 1")
    return ParallelDims(tp_size=tp, cp_size=cp, dp_size=dp, pp_size=pp, vpp_size=vpp,
                        sequence_parallel=sequence_parallel)


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's ``vocab_size_with_padding``: up to a multiple of divisible_by x TP
    (megatron/core/tokenizers/utils/build_tokenizer.py)."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


class _Found:
    """The refusals found while resolving (in the order validate_args meets them), and the
    values they leave undefined."""

    def __init__(self, spelling: Mapping[str, str]) -> None:
        self.refusals: list[Refusal] = []
        self.undefined: set[str] = set()
        self.spelling = spelling

    def name(self, dest: str) -> str:
        return flag_name(dest, self.spelling)

    def refuse(self, message: str, line: int = 0, *undefined: str,
               stage: str = "validate_args") -> None:
        self.refusals.append(Refusal(message, stage, line))
        self.undefined.update(undefined)

    def required(self, v: dict, dest: str, line: int = 1277) -> int:
        """validate_args:1277 ``_check_arg_is_not_none`` (the placeholder when missing)."""
        if v.get(dest) is None:
            self.refuse(f"{self.name(dest)} is required (megatron/training/arguments.py "
                        "validate_args)", line, dest)
            return _PLACEHOLDER
        return v[dest]

    def one_of(self, v: dict, dest: str, alias: str, lines: tuple[int, int]) -> int:
        """A value given by its flag or Megatron's older alias (validate_args: not both)."""
        if v.get(dest) is not None and v.get(alias) is not None:
            self.refuse(f"{self.name(dest)} and {self.name(alias)} cannot both be given "
                        "(validate_args)", lines[0], dest)
            return _PLACEHOLDER
        value = v.get(dest, v.get(alias))
        if value is None:
            self.refuse(f"{self.name(dest)} is required (validate_args)", lines[1], dest)
            return _PLACEHOLDER
        return value


def _world(parsed: ParsedFlags, environ: Mapping[str, str], world_size: int | None,
           found: _Found) -> tuple[int | None, str]:
    """The world size and where it came from (Megatron: ``int(os.getenv("WORLD_SIZE"))``);
    None (refused) when unknown."""
    if world_size is not None:
        return world_size, "--world-size"
    if environ.get("WORLD_SIZE"):
        try:
            return int(environ["WORLD_SIZE"]), "WORLD_SIZE (torchrun)"
        except ValueError:
            found.refuse(f"WORLD_SIZE must be an integer, got {environ['WORLD_SIZE']!r}")
            return None, ""
    if parsed.launcher_world_size is not None:
        return parsed.launcher_world_size, "the launcher's --nproc-per-node x --nnodes"
    found.refuse("the world size is unknown: Megatron-LM takes it from the launcher "
                 "(WORLD_SIZE) and derives DP = world / (TP x PP x CP); give verify "
                 "preflight --world-size N, or run it under torchrun")
    return None, ""


def _batch(v: dict, dp: int, found: _Found) -> tuple[int, int]:
    """(micro batch, global batch): validate_args:674-697 and the microbatch calculator's inputs."""
    n = found.name
    schedule = v.get("step_batch_size_schedule")
    if schedule is not None and "global_batch_size" in v:
        found.refuse(f"{n('step_batch_size_schedule')} and {n('global_batch_size')} cannot both "
                     "be given (validate_args)", 680, "global_batch_size")
    elif schedule is not None:
        found.refuse(f"{n('step_batch_size_schedule')} {schedule!r}: not modelled: the global "
                     "batch, and with it the number of microbatches, changes during training; "
                     "preflight lays out one (Megatron-Core's grad-ready counts, learned on the "
                     "first batch, also break when M changes)", 680, "global_batch_size")
    mbs = found.required(v, "micro_batch_size", 674)
    if "micro_batch_size" not in found.undefined and mbs <= 0:
        found.refuse(f"{n('micro_batch_size')} must be > 0, got {mbs}", 675, "micro_batch_size")
    if "global_batch_size" in v:
        gbs = v["global_batch_size"]
    elif {"micro_batch_size", "data_parallel_size"} & found.undefined:
        found.undefined.add("global_batch_size")  # its default is micro x DP
        gbs = _PLACEHOLDER
    else:
        gbs = mbs * dp
    if "global_batch_size" not in found.undefined and gbs <= 0:
        found.refuse(f"{n('global_batch_size')} must be > 0, got {gbs}", 687, "global_batch_size")
    # Without an eval flag or --decrease-batch-size-if-needed this is the training batch's
    # rule, which config.py names; validate_args checks it even when the training batch
    # would be rounded down.
    checked = ("eval_micro_batch_size" in v or "eval_global_batch_size" in v
               or v.get("decrease_batch_size_if_needed"))
    needed = {"micro_batch_size", "global_batch_size", "data_parallel_size"}
    if checked and not needed & found.undefined:
        eval_mbs = v.get("eval_micro_batch_size", mbs)
        eval_gbs = v.get("eval_global_batch_size", gbs)
        if eval_mbs * dp <= 0 or eval_gbs % (eval_mbs * dp):
            found.refuse(f"the evaluation batch {eval_gbs} ({n('eval_global_batch_size')}, default "
                         f"{n('global_batch_size')}) must be divisible by "
                         f"{n('eval_micro_batch_size')} (default {n('micro_batch_size')}) "
                         f"{eval_mbs} x DP {dp} (validate_args, before "
                         "--decrease-batch-size-if-needed rounds the training batch)", 694)
    return mbs, gbs


def _position_embedding(v: dict, found: _Found) -> str:
    """validate_args:1571-1591 (a refused kind is carried as "none", read by no rule)."""
    kind = v.get("position_embedding_type", "learned_absolute")
    if v.get("use_rotary_position_embeddings"):
        kind = "rope"  # validate_args: legacy RoPE flag
    if v.get("add_position_embedding") is False and kind != "rope":
        found.refuse("--no-position-embedding is deprecated, use --position-embedding-type "
                     "(validate_args)", 1579)
    if kind == "relative":
        found.refuse("--position-embedding-type relative: not modelled: relative attention "
                     "bias parameters are not laid out by preflight", 1582)
        return "none"
    if kind == "mrope" and v.get("mrope_section") is None:
        found.refuse("--position-embedding-type mrope needs --mrope-section (validate_args)", 1589)
    return kind


def _precision(v: dict, notes: list[str], found: _Found) -> tuple[str, str]:
    """(params dtype, main-grad dtype), as validate_args:1170-1194 sets them."""
    if v.get("bf16") and v.get("fp16"):  # validate_args:1173 `assert not args.bf16` under fp16
        found.refuse("--bf16 and --fp16 are mutually exclusive", 1173)
    params = "bf16" if v.get("bf16") else "fp16" if v.get("fp16") else "fp32"
    # validate_args: with --bf16 and the default --main-grads-dtype fp32, grads are accumulated
    # and all-reduced in fp32 unless --grad-reduce-in-bf16.
    accumulate_fp32 = bool(v.get("accumulate_allreduce_grads_in_fp32"))
    if params == "bf16":
        if v.get("grad_reduce_in_bf16"):
            accumulate_fp32 = False
        elif not accumulate_fp32:
            accumulate_fp32 = True
            # (Megatron-FSDP and torch FSDP2 have their own grad dtype: sharded_dp.py says it.)
            if not (v.get("use_megatron_fsdp") or v.get("use_torch_fsdp2")):
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


def _vocab(v: dict, spelling: dict, tp: int, notes: list[str], found: _Found) -> int:
    if "padded_vocab_size" in v:
        return v["padded_vocab_size"]
    if "vocab_size" in v:
        vocab = pad_vocab_size(v["vocab_size"], v.get("make_vocab_size_divisible_by", 128), tp)
        notes.append(f"--vocab-size {v['vocab_size']} padded to {vocab} (multiple of "
                     f"--make-vocab-size-divisible-by x TP)")
        spelling["padded_vocab_size"] = "--vocab-size"
        return vocab
    # set_global_variables builds the tokenizer from its files, after the microbatch calculator.
    found.refuse("the vocabulary size is unknown: Megatron reads it from the tokenizer's "
                 "files, which preflight does not; give --padded-vocab-size N (the 'padded "
                 "vocab (size: ...)' of Megatron's log) or --vocab-size N", 0,
                 "padded_vocab_size", stage="set_global_variables")
    return _PLACEHOLDER


def _pipeline(v: dict, num_layers: int, pp: int, found: _Found) -> int:
    """validate_args:894-953: the virtual pipeline size (the placeholder when refused)."""
    per_rank = v.get("num_virtual_stages_per_pipeline_rank")
    per_stage = v.get("num_layers_per_virtual_pipeline_stage")
    first, last = v.get("decoder_first_pipeline_num_layers"), v.get("decoder_last_pipeline_num_layers")
    accounted = (int(bool(v.get("account_for_embedding_in_pipeline_split")))
                 + int(bool(v.get("account_for_loss_in_pipeline_split"))))
    if {"num_layers", "pipeline_model_parallel_size"} & found.undefined:
        if per_stage is not None:  # it divides the layers per stage, which are undefined
            found.undefined.add("virtual_pipeline_model_parallel_size")
            return _PLACEHOLDER
        num_layers = pp = 1  # the divisibility of the layers is not checked: no refusal below
    try:
        return virtual_pipeline_size(num_layers, pp, per_rank, per_stage, first, last,
                                     accounted, found.name)
    except SplitError as exc:
        # The layers do not split: the layer split is not checked again. Without an
        # interleaving flag the virtual pipeline size is 1 all the same (validate_args:953).
        if per_rank is None and per_stage is None:
            found.refuse(str(exc), exc.line, "num_layers", stage=exc.stage)
            return 1
        found.refuse(str(exc), exc.line, "virtual_pipeline_model_parallel_size", "num_layers",
                     stage=exc.stage)
        return _PLACEHOLDER


def _single(value: object) -> object:
    """validate_args:1606-1609: a one-element list of --moe-router-load-balancing-type or
    --moe-aux-loss-coeff is its element; a longer one stays a list (a tuple here)."""
    if isinstance(value, list):
        return value[0] if len(value) == 1 else tuple(value)
    return value


def _moe(v: dict, ffn: int, tp: int, found: _Found) -> MoEConfig | None:
    """The MoE settings (validate_args:569 and :1593-1609), None without experts; the rules
    validate_args checks on them are refused here, the rest by check_config."""
    n = found.name
    experts = v.get("num_experts")
    if experts == 0:  # validate_args:1593
        experts = None
    ep = v.get("expert_model_parallel_size", 1)
    etp = v.get("expert_tensor_parallel_size") or tp  # validate_args:569 (None: TP)
    for dest, value in (("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
        if value < 1:
            found.refuse(f"{n(dest)} must be a positive integer, got {value}", 0, "expert_grid")
    if ep > 1 and experts is None:
        found.refuse(f"{n('expert_model_parallel_size')} {ep} needs {n('num_experts')} "
                     "(validate_args: 'num_experts must be non None to use expert model "
                     "parallelism')", 1601)
    elif ep > 1 and experts % ep:
        found.refuse(f"{n('num_experts')} ({experts}) must be a multiple of "
                     f"{n('expert_model_parallel_size')} ({ep}) (validate_args: 'Number of "
                     "experts should be a multiple of expert model parallel_size.')", 1602)
    try:
        freq = parse_layer_freq(v.get("moe_layer_freq", 1))
    except LayerFreqError as exc:
        found.refuse(f"argument {n('moe_layer_freq')}: {exc} (Megatron-LM's moe_freq_type)",
                     0, "moe_layer_freq", stage="parse_args")
        freq = 1
    if experts is None:
        dense = (isinstance(freq, tuple) and 0 in freq) or (isinstance(freq, int) and freq > 1)
        if v.get("moe_ffn_hidden_size") is not None and not dense:
            # TransformerConfig:1538-1554 (with a dense layer in the pattern it is ignored).
            found.refuse(f"{n('moe_ffn_hidden_size')} is given without {n('num_experts')} "
                         "(TransformerConfig.__post_init__: 'Please set num_moe_experts or "
                         "remove moe_ffn_hidden_size.')", 1551, stage="TransformerConfig")
        return None
    moe_ffn = v.get("moe_ffn_hidden_size")
    if moe_ffn is None:  # validate_args:1595 (after the FFN's own default)
        if "ffn_hidden_size" in found.undefined:
            found.undefined.add("moe_ffn_hidden_size")
        moe_ffn = ffn
    if "expert_grid" in found.undefined:
        ep = etp = 1
    return MoEConfig(
        num_experts=experts, moe_ffn_hidden_size=moe_ffn,
        expert_model_parallel_size=max(ep, 1), expert_tensor_parallel_size=max(etp, 1),
        moe_router_topk=v.get("moe_router_topk", 2), moe_layer_freq=freq,
        moe_shared_expert_intermediate_size=v.get("moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=bool(v.get("moe_shared_expert_gate")),
        moe_shared_expert_overlap=bool(v.get("moe_shared_expert_overlap")),
        moe_grouped_gemm=bool(v.get("moe_grouped_gemm")),
        moe_router_pre_softmax=bool(v.get("moe_router_pre_softmax")),
        moe_router_score_function=v.get("moe_router_score_function", "softmax"),
        moe_router_load_balancing_type=_single(v.get("moe_router_load_balancing_type", "aux_loss")),
        moe_aux_loss_coeff=_single(v.get("moe_aux_loss_coeff", 0.0)),
        moe_token_dispatcher_type=v.get("moe_token_dispatcher_type", "allgather"),
        transformer_impl=v.get("transformer_impl", "transformer_engine"),
    )


def resolve(parsed: ParsedFlags, environ: Mapping[str, str],
            world_size: int | None = None) -> PreflightConfig:
    """Apply Megatron's defaults and adjustments to the parsed flags and validate the result;
    ConfigError lists every refusal, in Megatron-LM's order. ``world_size``: preflight's
    --world-size (else WORLD_SIZE, else the launcher line)."""
    v, spelling = dict(parsed.values), dict(parsed.spelling)
    notes: list[str] = list(parsed.notes)
    found = _Found(spelling)
    n = found.name
    for dest, (replacement, line) in _REMOVED.items():
        if v.get(dest):
            found.refuse(f"{n(dest)} is no longer valid in Megatron-LM, use {replacement} "
                         "(validate_args)", line)
    world, world_source = _world(parsed, environ, world_size, found)
    sizes = {dest: v.get(dest, 1) for dest in ("tensor_model_parallel_size",
                                               "pipeline_model_parallel_size", "context_parallel_size")}
    for dest, value in sizes.items():
        if value < 1:
            found.refuse(f"{n(dest)} must be a positive integer, got {value}", 0, dest,
                         "data_parallel_size")
            sizes[dest] = _PLACEHOLDER
    tp, pp, cp = sizes.values()
    if world is None:
        found.undefined.add("data_parallel_size")
    elif "data_parallel_size" not in found.undefined and (world < 1 or world % (tp * pp * cp)):
        found.refuse(f"world size {world} ({world_source}) must be a positive multiple of "
                     f"TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp} "
                     "(megatron/training/arguments.py validate_args)", 430, "data_parallel_size")
    dp = _PLACEHOLDER if "data_parallel_size" in found.undefined else world // (tp * pp * cp)
    mbs, gbs = _batch(v, dp, found)
    reading = None
    if v.get("hybrid_layer_pattern") is not None or v.get("hybrid_override_pattern") is not None:
        # validate_args:717-891, before the layer count is required: the pattern gives it.
        reading = read_hybrid(v, None if "pipeline_model_parallel_size" in found.undefined
                              else pp, n)
        found.refusals.extend(reading.refusals)
        found.undefined.update(reading.undefined)
        notes.extend(reading.notes)
        v["num_layers"] = _PLACEHOLDER if reading.num_layers is None else reading.num_layers
    num_layers = found.one_of(v, "num_layers", "encoder_num_layers", (1265, 1277))
    hidden = found.required(v, "hidden_size")
    heads = found.required(v, "num_attention_heads")
    max_positions = found.required(v, "max_position_embeddings")
    seq = found.one_of(v, "seq_length", "encoder_seq_length", (1308, 1310))
    if reading is None:
        vpp = _pipeline(v, num_layers, pp, found)
    else:
        vpp = reading.virtual_pipeline_size or _PLACEHOLDER
    params_dtype, grad_dtype = _precision(v, notes, found)
    # Megatron-FSDP / torch FSDP2 (verify/preflight/sharded_dp.py): validate_args' rules, and
    # the values it changes (the distributed optimizer on, FP8 param gather off, ...).
    sharded_dp, sharded_refusals, changed = resolve_sharded_dp(v, params_dtype, n, notes)
    found.refusals.extend(sharded_refusals)
    v.update(changed)
    if sharded_dp is not None:  # their own grad dtype, not DDP's fp32 accumulation
        grad_dtype = sharded_dp.main_grads_dtype
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
    if sequence_parallel and tp == 1:  # validate_args:1396 disables it with a warning
        sequence_parallel = False
        notes.append("--sequence-parallel ignored at --tensor-model-parallel-size 1 (as Megatron)")
    if v.get("tp_comm_overlap") and not sequence_parallel:
        found.refuse("--tp-comm-overlap requires --sequence-parallel (validate_args)", 1402)
    position_embedding_type = _position_embedding(v, found)
    vocab = _vocab(v, spelling, tp, notes, found)
    swiglu = bool(v.get("swiglu"))
    # A derived default reads the values it derives from: one refused (or not a positive
    # integer, which check_config refuses) leaves it undefined, not refused again.
    if "hidden_size" in found.undefined or hidden < 1:
        found.undefined.add("hidden_size_derivations")
    if "ffn_hidden_size" in v:
        ffn = v["ffn_hidden_size"]
    elif "hidden_size_derivations" in found.undefined:
        found.undefined.add("ffn_hidden_size")
        ffn = _PLACEHOLDER
    else:  # validate_args:1280 defaults
        ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
    # --num-query-groups defaults to 1 and counts only with --group-query-attention
    # (argument_utils.py core_transformer_config_from_args).
    groups = v.get("num_query_groups", 1) if v.get("group_query_attention") else heads
    heads_undefined = "num_attention_heads" in found.undefined or heads < 1
    if not v.get("group_query_attention") and heads_undefined:
        found.undefined.add("num_query_groups")
    if "kv_channels" in v:
        kv_channels = v["kv_channels"]
    elif "hidden_size_derivations" in found.undefined or heads_undefined:
        found.undefined.add("kv_channels")
        kv_channels = _PLACEHOLDER
    else:
        kv_channels = hidden // heads
    loss_scale_window = _whole(v, found, "loss_scale_window", DEFAULT_LOSS_SCALE_WINDOW)
    moe = _moe(v, ffn, tp, found)
    try:
        dims = parallel_dims(tp, pp, vpp, dp, cp, sequence_parallel, spelling)
    except ConfigError as exc:  # VPP > 1 at PP 1 (validate_args:967), a size below 1
        found.refusals.extend(exc.refusals)
        found.undefined.add("virtual_pipeline_model_parallel_size")
        dims = parallel_dims(tp, pp, _PLACEHOLDER, dp, cp, sequence_parallel, spelling)
    found.undefined.discard("hidden_size_derivations")
    return PreflightConfig(
        dims=dims,
        data_parallel_source=f"world size {world} ({world_source}) / (TP x PP x CP)",
        micro_batch_size=mbs, global_batch_size=gbs,
        num_layers=num_layers, hidden_size=hidden, ffn_hidden_size=ffn,
        num_attention_heads=heads, num_query_groups=groups, kv_channels=kv_channels,
        seq_length=seq, max_position_embeddings=max_positions,
        position_embedding_type=position_embedding_type,
        padded_vocab_size=vocab,
        untie_embeddings_and_output_weights=bool(v.get("untie_embeddings_and_output_weights")),
        swiglu=swiglu, add_bias_linear=v.get("add_bias_linear", True),
        add_qkv_bias=bool(v.get("add_qkv_bias")),
        normalization=v.get("normalization", "LayerNorm"),
        params_dtype=params_dtype, grad_dtype=grad_dtype,
        use_distributed_optimizer=bool(v.get("use_distributed_optimizer")),
        overlap_grad_reduce=bool(v.get("overlap_grad_reduce")),
        overlap_param_gather=bool(v.get("overlap_param_gather")),
        # validate_args:978: p2p overlap is turned off without the interleaved schedule.
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
        decoder_first_pipeline_num_layers=v.get("decoder_first_pipeline_num_layers"),
        decoder_last_pipeline_num_layers=v.get("decoder_last_pipeline_num_layers"),
        microbatch_group_size_per_vp_stage=v.get("microbatch_group_size_per_vp_stage"),
        decrease_batch_size_if_needed=bool(v.get("decrease_batch_size_if_needed")),
        calculate_per_token_loss=bool(v.get("calculate_per_token_loss")),
        ddp_average_in_collective=bool(v.get("ddp_average_in_collective")),
        moe=moe, hybrid=reading and reading.config, spelling=spelling, notes=tuple(notes),
        optimizer=OptimizerChoice(v.get("optimizer", "adam"), lr=v.get("lr"),
                                  min_lr=v.get("min_lr", DEFAULT_MIN_LR),
                                  weight_decay=v.get("weight_decay", DEFAULT_WEIGHT_DECAY),
                                  sgd_momentum=v.get("sgd_momentum", DEFAULT_SGD_MOMENTUM)),
        sharded_dp=sharded_dp,
        qk_layernorm=bool(v.get("qk_layernorm")), qk_l2_norm=bool(v.get("qk_l2_norm")),
        mtp=mtp_from_flags(v.get("mtp_num_layers"), v.get("mtp_use_repeated_layer"),
                           v.get("mtp_loss_scaling_factor")),
        clip_grad=v.get("clip_grad", DEFAULT_CLIP_GRAD), loss_scale=v.get("loss_scale"),
        initial_loss_scale=v.get("initial_loss_scale", DEFAULT_INITIAL_LOSS_SCALE),
        min_loss_scale=v.get("min_loss_scale", DEFAULT_MIN_LOSS_SCALE),
        loss_scale_window=loss_scale_window,
        hysteresis=v.get("hysteresis", DEFAULT_HYSTERESIS),
        refused=tuple(found.refusals), undefined=frozenset(found.undefined),
    )


def _whole(values: dict, found: _Found, attribute: str, default: int) -> int:
    """A float flag that must hold a whole number (Megatron parses --loss-scale-window as float)."""
    value = values.get(attribute, default)
    if isinstance(value, float):
        if not (math.isfinite(value) and value == int(value)):
            found.refuse(f"{found.name(attribute)} must be a whole number, got {value}",
                         stage="optimizer")
            return default
        value = int(value)
    return value


__all__ = ["resolve"]

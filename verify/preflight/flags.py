"""A Megatron-LM launch line, read as Megatron-LM's own ``parse_args`` reads it.

The flags are those of Megatron-LM core_r0.19.0 (megatron-core 0.19.2):
``megatron_flags.json`` is generated from its parser
(``megatron/training/arguments.py add_megatron_arguments``, by
``dev/megatron_diff/dump_flags.py``), and :func:`parse_megatron_flags` builds
an ``argparse`` parser from it, so a launch line gets Megatron's verdict on
names, arities, types and choices: an unknown flag, a missing value, an
unquoted multi-word value, ``--min-lr -1e-5`` (argparse takes ``-1e-5`` for an
option) are refused as Megatron refuses them.

Of the flags Megatron accepts, preflight reads those in :data:`MODELLED`;
:data:`NOT_MODELLED` lists the flags that would change the parallel layout,
the gradient path or the batch in ways preflight does not lay out, which are
refused naming the flag; every other flag is listed as ignored.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

MEGATRON_LM = "Megatron-LM core_r0.19.0 (megatron-core 0.19.2)"


# Megatron-LM's launch path, in the order it checks a launch: parse_args, validate_args
# (megatron/training/arguments.py), set_global_variables (the microbatch calculator, then
# the tokenizer), initialize_model_parallel (megatron/core/parallel_state.py: the expert
# grid, made by initialize_megatron before the model), ModelParallelConfig.__post_init__ (run first by TransformerConfig's), the
# rest of TransformerConfig.__post_init__, then get_model (megatron/training/training.py):
# the model's modules, the DDP config, the DDP wrap; the optimizer and its grad scaler; the
# first training step.
STAGES = ("parse_args", "validate_args", "set_global_variables", "initialize_model_parallel",
          "ModelParallelConfig",
          "TransformerConfig", "model build", "DDP config", "DDP wrap", "optimizer", "first step")


@dataclass(frozen=True)
class Refusal:
    """One rule of Megatron-LM's launch path that a launch breaks: the message (naming the
    flags and the rule), the stage of :data:`STAGES` that checks it and, in validate_args, the
    line of ``megatron/training/arguments.py`` (core_r0.19.0) that does, to order the rules
    Megatron checks in one function; 0 keeps the order in which preflight checks them."""

    message: str
    stage: str
    line: int = 0

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"Refusal.stage must be one of {STAGES}, got {self.stage!r}")

    @property
    def order(self) -> tuple[int, int]:
        return STAGES.index(self.stage), self.line


class LaunchRefused(ValueError):
    """Every refusal of a launch, in Megatron-LM's order (exit code 2).

    ``refusals``: the rules broken (a bare message is one refusal of ``stage``), sorted
    stably by stage and validate_args line: the first is the one Megatron-LM stops at, each
    next the one it would stop at once those before were fixed. ``not_checked``: the rules
    that could not be decided because a refusal leaves a value they read undefined (a DP
    that does not divide leaves no microbatch count), each saying which."""

    def __init__(self, refusals: str | Refusal | Sequence[str | Refusal], stage: str = "validate_args",
                 not_checked: Sequence[str] = ()) -> None:
        items = [refusals] if isinstance(refusals, (str, Refusal)) else list(refusals)
        if not items:
            raise ValueError("LaunchRefused needs at least one refusal")
        found = [r if isinstance(r, Refusal) else Refusal(r, stage) for r in items]
        self.refusals: tuple[Refusal, ...] = tuple(sorted(found, key=lambda r: r.order))
        self.not_checked: tuple[str, ...] = tuple(not_checked)
        super().__init__(self.text())

    @property
    def messages(self) -> tuple[str, ...]:
        return tuple(r.message for r in self.refusals)

    def text(self) -> str:
        """One refusal: its message; several: numbered, in Megatron-LM's order."""
        if len(self.refusals) == 1:
            return self.refusals[0].message
        return (f"{len(self.refusals)} refusals, in the order Megatron-LM checks them:\n"
                + "\n".join(f"  {i}. {m}" for i, m in enumerate(self.messages, start=1)))

    def to_dict(self) -> list[dict]:
        """JSON-ready refusals, in order."""
        return [{"message": r.message, "stage": r.stage} for r in self.refusals]


class FlagError(LaunchRefused):
    """The launch's flags could not be read as Megatron-LM reads them (exit code 2)."""

    def __init__(self, refusals: str | Refusal | Sequence[str | Refusal],
                 not_checked: Sequence[str] = ()) -> None:
        super().__init__(refusals, "parse_args", not_checked)


@dataclass(frozen=True)
class FlagAction:
    """One option of Megatron-LM's parser: its spellings, attribute, action and value rules."""

    flags: tuple[str, ...]
    dest: str
    action: str  # store, store_true, store_false, boolean_optional
    nargs: int | str | None
    type: str  # int, float, str, enum (a name of ``choices``), other (Megatron's converter)
    choices: tuple[str, ...] | None


def _load_actions() -> tuple[FlagAction, ...]:
    text = resources.files("verify.preflight").joinpath("megatron_flags.json").read_text("utf-8")
    return tuple(FlagAction(tuple(a["flags"]), a["dest"], a["action"], a["nargs"], a["type"],
                            None if a["choices"] is None else tuple(a["choices"]))
                 for a in json.loads(text)["actions"])


MEGATRON_ACTIONS = _load_actions()
MEGATRON_FLAGS: Mapping[str, FlagAction] = {f: a for a in MEGATRON_ACTIONS for f in a.flags}
_FLAG_OF_DEST = {a.dest: a.flags[0] for a in MEGATRON_ACTIONS}

# The fully-sharded DP flags that change nothing without --use-megatron-fsdp or
# --use-torch-fsdp2: listed as ignored then (verify/preflight/sharded_dp.py reads them).
FSDP_ONLY = frozenset({
    "data_parallel_sharding_strategy", "init_model_with_meta_device", "fsdp_double_buffer",
    "megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype",
    "megatron_fsdp_main_params_dtype", "torch_fsdp2_reshard_after_forward",
    "check_weight_hash_across_dp_replicas_interval",
})

# The Megatron attributes (argparse dests) preflight reads; every other flag is ignored
# (listed) or, in NOT_MODELLED, refused.
MODELLED = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "num_virtual_stages_per_pipeline_rank", "num_layers_per_virtual_pipeline_stage",
    "microbatch_group_size_per_vp_stage", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "overlap_p2p_comm",
    "micro_batch_size", "global_batch_size", "decrease_batch_size_if_needed",
    "step_batch_size_schedule", "eval_micro_batch_size", "eval_global_batch_size",
    "num_layers", "encoder_num_layers", "hidden_size", "ffn_hidden_size",
    "num_attention_heads", "group_query_attention", "num_query_groups", "kv_channels",
    "seq_length", "encoder_seq_length", "max_position_embeddings", "position_embedding_type",
    "use_rotary_position_embeddings", "add_position_embedding", "padded_vocab_size",
    "vocab_size", "make_vocab_size_divisible_by", "untie_embeddings_and_output_weights",
    "swiglu", "add_bias_linear", "add_qkv_bias", "normalization", "bf16", "fp16",
    "use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
    "ddp_bucket_size", "ddp_pad_buckets_for_high_nccl_busbw",
    "accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16",
    "ddp_reduce_scatter_with_fp32_accumulation", "defer_embedding_wgrad_compute",
    "wgrad_deferral_limit", "fp8", "fp8_recipe", "fp8_param_gather",
    "reuse_grad_buf_for_mxfp8_param_ag", "sequence_parallel", "gradient_accumulation_fusion",
    "seed", "clip_grad", "loss_scale", "initial_loss_scale", "min_loss_scale",
    "loss_scale_window", "hysteresis", "batch_size", "model_parallel_size",
    "checkpoint_activations", "tp_comm_overlap", "mrope_section",
    "calculate_per_token_loss", "ddp_average_in_collective",
    # mixture of experts (verify/preflight/moe.py)
    "num_experts", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_shared_expert_overlap",
    "moe_grouped_gemm", "moe_router_pre_softmax", "moe_router_score_function",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_token_dispatcher_type",
    "transformer_impl",
    # hybrid Mamba models (verify/preflight/hybrid.py)
    "hybrid_layer_pattern", "hybrid_override_pattern", "mamba_state_dim", "mamba_head_dim",
    "mamba_num_groups", "mamba_num_heads",
    # the optimizer (verify/preflight/optimizer.py)
    "optimizer", "sgd_momentum", "lr", "min_lr", "weight_decay",
    # fully-sharded data parallelism (verify/preflight/sharded_dp.py)
    "use_megatron_fsdp", "use_torch_fsdp2", "ckpt_format", "nccl_ub", "fsdp_manual_registration",
    *FSDP_ONLY,
    # query/key layernorm and multi-token prediction (verify/preflight/mtp.py)
    "qk_layernorm", "qk_l2_norm", "mtp_num_layers", "mtp_use_repeated_layer",
    "mtp_loss_scaling_factor",
})
# Without MTP (--mtp-num-layers absent or 0) these change nothing: listed as ignored then.
MTP_ONLY = frozenset({"mtp_use_repeated_layer", "mtp_loss_scaling_factor"})

# The --mamba-* sizes change nothing without a hybrid pattern: listed as ignored then.
HYBRID_ONLY = frozenset({"mamba_state_dim", "mamba_head_dim", "mamba_num_groups",
                         "mamba_num_heads"})

# The MoE flags that change nothing without experts (--num-experts absent or 0, which
# validate_args:1593 makes None): listed as ignored then. --expert-model-parallel-size,
# --moe-ffn-hidden-size and --moe-layer-freq stay read: Megatron refuses the first two
# without experts (validate_args:1601, TransformerConfig:1551), reading the third.
MOE_ONLY = frozenset({
    "num_experts", "expert_tensor_parallel_size", "moe_router_topk",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_shared_expert_overlap",
    "moe_grouped_gemm", "moe_router_pre_softmax", "moe_router_score_function",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_token_dispatcher_type",
    "transformer_impl",  # with experts: the local spec never groups them
})

# Read only under --optimizer sgd, whose build takes them (core/optimizer/__init__.py:618);
# with Adam they are listed as ignored, as before SGD was modelled. --lr and --min-lr are read
# for every optimizer: validate_args:1319-1320 asserts --min-lr <= --lr whatever it is.
SGD_ONLY = frozenset({"sgd_momentum", "weight_decay"})

# Given in place of Megatron-LM's spelling, these were preflight's own inventions.
RENAMED = {
    "--data-parallel-size": "Megatron-LM derives DP = world size / (TP x PP x "
                            "CP) from the launcher; give preflight the world size with "
                            "--world-size N (before `--`), or run it under torchrun (WORLD_SIZE)",
    "--virtual-pipeline-model-parallel-size": "use "
                                              "--num-virtual-stages-per-pipeline-rank N (or "
                                              "--num-layers-per-virtual-pipeline-stage L)",
    "--gradient-accumulation-fusion": "fusion is on by default, "
                                      "--no-gradient-accumulation-fusion turns it off",
}


def _given(value: object, values: Mapping[str, object]) -> bool:
    return True


def _above_one(value: object, values: Mapping[str, object]) -> bool:
    return isinstance(value, int) and value > 1


def _not(default: str) -> Callable[[object, Mapping[str, object]], bool]:
    return lambda value, values: value != default


# The symbols of a hybrid pattern (megatron/core/models/hybrid/hybrid_layer_allocation.py
# Symbols) that preflight does not lay out (verify/preflight/hybrid.py models M, *, - and |).
HYBRID_NOT_MODELLED = {"G": "GDN 'G' layers", "+": "MLA '+' layers",
                       "D": "DeepSeek sparse attention 'D' layers", "E": "MoE 'E' layers",
                       "/": "MTP depths after '/'"}


def not_modelled_parts(pattern: str) -> list[str]:
    """The parts of a hybrid pattern preflight does not lay out (empty: modelled)."""
    return [what for symbol, what in HYBRID_NOT_MODELLED.items() if symbol in pattern]


def _hybrid_not_modelled(value: object, values: Mapping[str, object]) -> bool:
    """A hybrid pattern with layers or MTP depths preflight does not lay out, or with experts."""
    return bool(not_modelled_parts(str(value))) or bool(values.get("num_experts"))


def _in_hybrid(value: object, values: Mapping[str, object]) -> bool:
    """A setting given with a hybrid (Mamba) layer pattern."""
    hybrid = values.get("hybrid_layer_pattern") or values.get("hybrid_override_pattern")
    return bool(value) and bool(hybrid)


def _mtp_not_modelled(value: object, values: Mapping[str, object]) -> bool:
    """A negative MTP depth, or MTP inside a hybrid (Mamba) layer pattern."""
    hybrid = values.get("hybrid_layer_pattern") or values.get("hybrid_override_pattern")
    return isinstance(value, int) and (value < 0 or (value > 0 and bool(hybrid)))


def _with_mtp(value: object, values: Mapping[str, object]) -> bool:
    mtp = values.get("mtp_num_layers")
    return bool(value) and isinstance(mtp, int) and mtp > 0


def _weight_shards(value: object, values: Mapping[str, object]) -> bool:
    return value is not None and value != values.get("tensor_model_parallel_size", 1)


def _expert_weight_shards(value: object, values: Mapping[str, object]) -> bool:
    expert_tp = values.get("expert_tensor_parallel_size") or values.get("tensor_model_parallel_size", 1)
    return value is not None and value != expert_tp


_HYBRID_REASON = ("a hybrid pattern with GDN 'G', MLA '+', sparse attention 'D' or MoE 'E' "
                  "layers, MTP depths after '/', or --num-experts (M, * and - layers with | "
                  "stages are modelled)")


def _with_experts(value: object, values: Mapping[str, object]) -> bool:
    return bool(value) and bool(values.get("num_experts"))


# dest -> (why preflight does not lay it out, when a given value is not modelled)
NOT_MODELLED: dict[str, tuple[str, Callable[[object, Mapping[str, object]], bool]]] = {
    "moe_latent_size": ("MoE latent projections (their parameters)", _given),
    "moe_single_grouped_weight": ("one grouped weight for all local experts", _given),
    "moe_single_grouped_bias": ("one grouped bias for all local experts", _given),
    "use_grouped_gemm_for_shared_expert": ("the shared experts as a grouped GEMM", _given),
    "moe_use_upcycling": ("dense-to-MoE upcycling", _given),
    "expert_tensor_parallel_num_weight_shards": ("expert GTP weight sharding (it changes expert "
                                                 "DP)", _expert_weight_shards),
    "pipeline_model_parallel_layout": ("an explicit pipeline layout", _given),
    "hybrid_layer_pattern": (_HYBRID_REASON, _hybrid_not_modelled),
    "hybrid_override_pattern": (_HYBRID_REASON, _hybrid_not_modelled),
    "heterogeneous_layers_config_path": ("heterogeneous layers", _given),
    "heterogeneous_layers_config_encoded_json": ("heterogeneous layers", _given),
    "mtp_num_layers": ("multi-token prediction with a negative depth or inside a hybrid "
                       "(Mamba) layer pattern", _mtp_not_modelled),
    "mtp_detach_heads": ("MTP heads detached, their grads clipped as a group of their own",
                         _with_mtp),
    "multi_latent_attention": ("multi-latent attention's parameter shapes", _given),
    # hybrid_stack_spec's attention layer names no q/k layernorm module (hybrid_layer_specs.py
    # attention_layer), where the GPT spec's does: what Megatron builds there is not laid out.
    "qk_layernorm": ("--qk-layernorm in a hybrid pattern's attention layers (Megatron-Core's "
                     "hybrid_stack_spec gives them no q/k layernorm module)", _in_hybrid),
    "qk_clip": ("QK-clip: the query/key weights rescaled after each optimizer step "
                "(training.py train_step: clip_qk)", _given),
    "attention_output_gate": ("the gated attention output's wider QKV weight", _given),
    "quick_geglu": ("a gated (GeGLU) MLP", _given),
    "hierarchical_context_parallel_sizes": ("hierarchical context parallelism", _given),
    "hybrid_context_parallel": ("hybrid context parallelism", _given),
    "tensor_parallel_num_weight_shards": ("GTP weight sharding (it changes DP)", _weight_shards),
    "use_megatron_fsdp": ("Megatron-FSDP with experts (their params sharded over expert DP "
                          "by its own buffers)", _with_experts),
    "num_distributed_optimizer_instances": ("several distributed-optimizer instances",
                                            _above_one),
    "ddp_num_buckets": ("a bucket count in place of a bucket size", _given),
    "ddp_param_name_patterns_for_fp32_local_accumulation": ("fp32 local accumulation by name",
                                                            _given),
    "overlap_param_gather_with_optimizer_step": ("param gathers overlapped with the optimizer "
                                                 "step (every chunk one bucket)", _given),
    "delay_wgrad_compute": ("Transformer Engine's delayed wgrad", _given),
    "fp32_residual_connection": ("an fp32 residual stream (fp32 pipeline transfers)", _given),
    "fp4": ("FP4 (NVFP4) compute", _given),
    "fp4_param_gather": ("FP4 params", _given),
    "te_precision_config_file": ("a quantization recipe file", _given),
    "main_grads_dtype": ("a main-grad dtype other than fp32", _not("fp32")),
    "main_params_dtype": ("master params in another dtype than fp32", _not("fp32")),
    "exp_avg_dtype": ("Adam moments in another dtype than fp32", _not("fp32")),
    "exp_avg_sq_dtype": ("Adam moments in another dtype than fp32", _not("fp32")),
    "use_precision_aware_optimizer": ("the precision-aware optimizer", _given),
    "optimizer": ("an optimizer other than Adam or SGD", lambda value, values: value not in
                  ("adam", "sgd")),
    "optimizer_cpu_offload": ("the CPU-offloaded optimizer", _given),
    "freeze_all_layers": ("frozen layers (no distributed optimizer, no param gather)", _given),
    "pad_vocab_size": ("an unpadded vocabulary", _given),
}

# Megatron-LM 0.19 parses these and then ignores them: preflight lists them with the reason.
IGNORED_BY_MEGATRON = {
    "rampup_batch_size": "deprecated and ignored by Megatron-LM 0.19's microbatch calculator "
                         "(megatron/core/num_microbatches_calculator.py "
                         "init_num_microbatches_calculator): the batch stays constant",
}


@dataclass
class ParsedFlags:
    """A launch line, as Megatron-LM reads it: the values preflight models (by Megatron's
    attribute name), the flag spelled for each, the flags it ignores, the launcher."""

    values: dict[str, object] = field(default_factory=dict)
    spelling: dict[str, str] = field(default_factory=dict)  # dest -> flag as written
    unknown: list[str] = field(default_factory=list)  # Megatron flags preflight ignores (text)
    positional: list[str] = field(default_factory=list)  # the launcher and the script
    launcher_world_size: int | None = None  # torchrun's --nproc-per-node x --nnodes
    notes: list[str] = field(default_factory=list)

    def flag(self, dest: str) -> str:
        """The flag the user wrote for ``dest`` (Megatron's first spelling when not given)."""
        return self.spelling.get(dest) or _FLAG_OF_DEST[dest]


def flag_of(dest: str, spelling: Mapping[str, str]) -> str:
    """The flag written for Megatron attribute ``dest``, else Megatron's own spelling."""
    return spelling.get(dest) or _FLAG_OF_DEST[dest]


_CONTINUATION = re.compile(r"\\[ \t]*(#.*)?$")


def tokenize_args_text(text: str) -> list[str]:
    """Split a launcher's flags as a shell would: ``\\`` continuations, ``#`` comments, quotes."""
    tokens: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        # A continuation (the next line goes on), forgiving a comment after the backslash.
        stripped = _CONTINUATION.sub("", line)
        try:
            tokens.extend(shlex.split(stripped, comments=True))
        except ValueError as exc:
            raise FlagError(f"--args-file line {number}: {exc}: {line.strip()!r}") from None
    return tokens


def read_args_file(path: str | Path) -> list[str]:
    """The tokens of an args file (see :func:`tokenize_args_text`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise FlagError(f"--args-file {path}: cannot be read ({exc.strerror or exc})") from None
    return tokenize_args_text(text)


class _MegatronParser(argparse.ArgumentParser):
    """Megatron-LM's parser rebuilt from its flag table; refuses with FlagError, not exit."""

    def error(self, message: str):
        raise FlagError(f"{message} (Megatron-LM's parse_args refuses it: {MEGATRON_LM})")


_TYPES: dict[str, Callable[[str], object]] = {"int": int, "float": float}


def _megatron_parser() -> _MegatronParser:
    parser = _MegatronParser(prog="pretrain_gpt.py", allow_abbrev=False, add_help=False)
    for a in MEGATRON_ACTIONS:
        kwargs: dict = {"dest": a.dest, "default": argparse.SUPPRESS}
        if a.action == "boolean_optional":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif a.action != "store":
            kwargs["action"] = a.action
        else:
            kwargs["nargs"] = a.nargs
            convert = _TYPES.get(a.type)
            if convert is not None:
                kwargs["type"] = convert
            if a.choices is not None:
                kwargs["choices"] = [convert(c) for c in a.choices] if convert else list(a.choices)
        parser.add_argument(*a.flags, **kwargs)
    return parser


# How alike an unknown flag and a known one must be to be named as the likely meaning.
NEAR_MISS_RATIO = 0.85


def _unknown_flag(name: str, own_options: frozenset[str]) -> str:
    """Why ``name`` is refused: a renamed flag, preflight's own option, or a near miss."""
    if name in RENAMED:
        return f"{name} is not a flag of {MEGATRON_LM}: {RENAMED[name]}"
    if name in own_options:
        return (f"{name} is an option of verify preflight, not a Megatron-LM flag: put "
                "it on the command line before `--` (the launch's flags, in --args-file "
                "or after `--`, are Megatron-LM's)")
    candidates = [*MEGATRON_FLAGS, *own_options]
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=NEAR_MISS_RATIO)
    hint = ""
    if match:
        hint = f"; did you mean {match[0]}{' (an option of verify preflight)' if match[0] in own_options else ''}?"
    return f"{name} is not a flag of {MEGATRON_LM}, whose parse_args refuses it{hint}"


def _split_launcher(tokens: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher and training script, the script's flags): everything up to a ``*.py``
    script that follows a launcher (``torchrun ... pretrain_gpt.py``) is the launcher's."""
    if not tokens or tokens[0].startswith("-"):
        return [], tokens
    for index, token in enumerate(tokens):
        if token.endswith(".py") and not token.startswith("-"):
            return tokens[:index + 1], tokens[index + 1:]
    return [], tokens


def _launcher_world_size(launcher: list[str]) -> int | None:
    """torchrun's ``--nproc-per-node N [--nnodes M]`` as N x M (None when not both integers)."""
    found: dict[str, str] = {}
    for index, token in enumerate(launcher):
        name, has_value, value = token.partition("=")
        key = name.replace("_", "-")
        if key in ("--nproc-per-node", "--nnodes"):
            if not has_value and index + 1 < len(launcher):
                value = launcher[index + 1]
            found[key] = value
    try:
        nproc = int(found["--nproc-per-node"])
        nnodes = int(found.get("--nnodes", "1"))
    except (KeyError, ValueError):
        return None
    return nproc * nnodes


def _flag_groups(tokens: list[str]) -> list[list[str]]:
    """Each Megatron flag with the tokens after it up to the next flag, as argparse reads
    them (tokens before the first flag form a group of their own)."""
    groups: list[list[str]] = []
    for token in tokens:
        if token.partition("=")[0] in MEGATRON_FLAGS or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    return groups


def _flag_texts(tokens: list[str]) -> list[tuple[str, str]]:
    """(flag, the flag with its values as written) for each flag of already-valid tokens."""
    return [(group[0].partition("=")[0], " ".join(group)) for group in _flag_groups(tokens)
            if group[0].partition("=")[0] in MEGATRON_FLAGS]


# Why no rule of the configuration is checked while a flag cannot be read.
RULES_NOT_CHECKED = ("the configuration's rules (validate_args onwards): checked once every flag "
                     "above is read; preflight does not guess what such a flag would change")


def _without_unknown(tokens: list[str]) -> list[str]:
    """The tokens less every unknown ``--flag`` and the values that follow it."""
    kept, skipping = [], False
    for token in tokens:
        name = token.partition("=")[0]
        if name.startswith("--") and len(name) > 2:
            skipping = name not in MEGATRON_FLAGS
        if not skipping:
            kept.append(token)
    return kept


def _parse_all(parser: _MegatronParser, flags: list[str]) -> tuple[list[str], dict, list[str]]:
    """(the flags argparse reads, its namespace of them, every error argparse stops at): a
    flag whose value it refuses does not hide the next one (each flag's group is then read on
    its own, and the groups it refuses are left out of the namespace)."""
    try:
        return flags, vars(parser.parse_args(flags)), []
    except FlagError as first:
        errors, readable = [], []
        for group in _flag_groups(flags):
            try:
                parser.parse_args(group)
                readable += group
            except FlagError as exc:
                errors.extend(exc.messages)
        if not errors:  # only the whole line is refused: say what argparse said
            return [], {}, list(first.messages)
        return readable, vars(parser.parse_args(readable)), errors


def parse_megatron_flags(tokens: list[str], own_options: frozenset[str] = frozenset()) -> ParsedFlags:
    """Read a launch as Megatron-LM's parse_args does (later occurrences win). Raises
    FlagError listing every flag it cannot read (unknown, a value argparse refuses), then
    every flag preflight does not model, in the launch's order; ``own_options``: verify
    preflight's, refused here."""
    launcher, flags = _split_launcher(list(tokens))
    unread: list[str] = []
    for token in flags:
        name = token.partition("=")[0]
        if name.startswith("--") and len(name) > 2 and name not in MEGATRON_FLAGS:
            message = _unknown_flag(name, own_options)
            if message not in unread:
                unread.append(message)
    known, namespace, errors = _parse_all(_megatron_parser(), _without_unknown(flags))
    unread += errors
    parsed = ParsedFlags(positional=launcher, launcher_world_size=_launcher_world_size(launcher))
    texts = _flag_texts(known)
    for name, _ in texts:
        parsed.spelling[MEGATRON_FLAGS[name].dest] = name
    # The last occurrence of a flag is the value argparse keeps: name it as written there.
    last = {MEGATRON_FLAGS[name].dest: (index, text) for index, (name, text) in enumerate(texts)}
    not_modelled = sorted(
        (index, f"{text}: not modelled ({NOT_MODELLED[dest][0]}): preflight does not lay it "
                "out, and refuses it rather than check another configuration")
        for dest, (index, text) in last.items()
        if dest in NOT_MODELLED and NOT_MODELLED[dest][1](namespace[dest], namespace))
    if unread or not_modelled:
        raise FlagError([*unread, *(message for _, message in not_modelled)],
                        not_checked=[RULES_NOT_CHECKED])
    read = MODELLED if namespace.get("num_experts") else MODELLED - MOE_ONLY
    if namespace.get("hybrid_layer_pattern") is None and namespace.get("hybrid_override_pattern") is None:
        read -= HYBRID_ONLY
    if namespace.get("optimizer") != "sgd":
        read = read - SGD_ONLY
    if not (namespace.get("use_megatron_fsdp") or namespace.get("use_torch_fsdp2")):
        read -= FSDP_ONLY
    read = read if namespace.get("mtp_num_layers") else read - MTP_ONLY
    for name, text in texts:
        dest = MEGATRON_FLAGS[name].dest
        if dest not in read and text not in parsed.unknown:
            parsed.unknown.append(text)
            if dest in IGNORED_BY_MEGATRON:
                parsed.notes.append(f"{name}: {IGNORED_BY_MEGATRON[dest]}")
    parsed.values = {dest: value for dest, value in namespace.items() if dest in read}
    return parsed


def split_preflight_argv(argv: list[str], own: Mapping[str, bool]) -> tuple[list[str], list[str]]:
    """``verify preflight``'s argv as (its own options with their values, the launch's tokens).
    ``own``: each own option and whether it takes a value. Before ``--`` a token that is not
    an own option (or its value) belongs to the launch; after ``--`` every token does, and an
    own option there is refused."""
    head, tail = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    misplaced = [t for t in tail if t.partition("=")[0] in own]
    if misplaced:
        raise FlagError(f"{misplaced[0]} is an option of verify preflight, not a Megatron-LM "
                        "flag: put it before `--` (everything after `--` is the launch's flags)")
    kept, launch = [], []
    index = 0
    while index < len(head):
        token = head[index]
        index += 1
        name, has_value, _ = token.partition("=")
        if name in own:
            kept.append(token)
            if own[name] and not has_value and index < len(head):
                kept.append(head[index])
                index += 1
            continue
        launch.append(token)
    return kept, launch + tail

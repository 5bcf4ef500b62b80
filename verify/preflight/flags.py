"""Megatron-Core's command-line flags, read from argv tokens or from a launcher's args file.

Only the flags that decide the gradient buffers, the collectives and the
pipeline schedule are understood (:data:`FLAG_SPECS`); every other flag is
listed in :attr:`ParsedFlags.unknown` and ignored, so a user can hand over the
exact flags of their launch script. ``--flag value`` and ``--flag=value`` are
both accepted, as Megatron's argparse accepts them.
"""

from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


class FlagError(ValueError):
    """A flag gradverify understands was given a bad value (exit code 2)."""


# flag -> (attribute name, kind). Kinds: "int", "float", "str", "true" (a store_true
# switch), "false" (a switch that turns the attribute off). Two spellings of one
# setting share an attribute; ParsedFlags.spelling records which one was used.
FLAG_SPECS: dict[str, tuple[str, str]] = {
    "--tensor-model-parallel-size": ("tensor_model_parallel_size", "int"),
    "--pipeline-model-parallel-size": ("pipeline_model_parallel_size", "int"),
    "--num-virtual-stages-per-pipeline-rank": ("virtual_pipeline_model_parallel_size", "int"),
    "--virtual-pipeline-model-parallel-size": ("virtual_pipeline_model_parallel_size", "int"),
    "--num-layers-per-virtual-pipeline-stage": ("num_layers_per_virtual_pipeline_stage", "int"),
    "--data-parallel-size": ("data_parallel_size", "int"),
    "--world-size": ("world_size", "int"),
    "--micro-batch-size": ("micro_batch_size", "int"),
    "--global-batch-size": ("global_batch_size", "int"),
    "--num-layers": ("num_layers", "int"),
    "--hidden-size": ("hidden_size", "int"),
    "--ffn-hidden-size": ("ffn_hidden_size", "int"),
    "--num-attention-heads": ("num_attention_heads", "int"),
    "--group-query-attention": ("group_query_attention", "true"),
    "--num-query-groups": ("num_query_groups", "int"),
    "--kv-channels": ("kv_channels", "int"),
    "--seq-length": ("seq_length", "int"),
    "--max-position-embeddings": ("max_position_embeddings", "int"),
    "--position-embedding-type": ("position_embedding_type", "str"),
    "--padded-vocab-size": ("padded_vocab_size", "int"),
    "--vocab-size": ("vocab_size", "int"),
    "--make-vocab-size-divisible-by": ("make_vocab_size_divisible_by", "int"),
    "--untie-embeddings-and-output-weights": ("untie_embeddings_and_output_weights", "true"),
    "--swiglu": ("swiglu", "true"),
    "--disable-bias-linear": ("add_bias_linear", "false"),
    "--normalization": ("normalization", "str"),
    "--bf16": ("bf16", "true"),
    "--fp16": ("fp16", "true"),
    "--use-distributed-optimizer": ("use_distributed_optimizer", "true"),
    "--overlap-grad-reduce": ("overlap_grad_reduce", "true"),
    "--overlap-param-gather": ("overlap_param_gather", "true"),
    "--no-overlap-p2p-communication": ("overlap_p2p_comm", "false"),
    "--ddp-bucket-size": ("ddp_bucket_size", "int"),
    "--ddp-pad-buckets-for-high-nccl-busbw": ("ddp_pad_buckets_for_high_nccl_busbw", "true"),
    "--accumulate-allreduce-grads-in-fp32": ("accumulate_allreduce_grads_in_fp32", "true"),
    "--grad-reduce-in-bf16": ("grad_reduce_in_bf16", "true"),
    "--ddp-reduce-scatter-with-fp32-accumulation": (
        "ddp_reduce_scatter_with_fp32_accumulation", "true"),
    "--defer-embedding-wgrad-compute": ("defer_embedding_wgrad_compute", "true"),
    "--wgrad-deferral-limit": ("wgrad_deferral_limit", "int"),
    "--fp8-format": ("fp8_format", "str"),
    "--fp8-recipe": ("fp8_recipe", "str"),
    "--fp8-param-gather": ("fp8_param_gather", "true"),
    "--reuse-grad-buf-for-mxfp8-param-ag": ("reuse_grad_buf_for_mxfp8_param_ag", "true"),
    "--sequence-parallel": ("sequence_parallel", "true"),
    "--gradient-accumulation-fusion": ("gradient_accumulation_fusion", "true"),
    "--no-gradient-accumulation-fusion": ("gradient_accumulation_fusion", "false"),
    "--seed": ("seed", "int"),
    # optimizer: megatron/training/arguments.py (--clip-grad default 1.0; 0 turns clipping off)
    "--clip-grad": ("clip_grad", "float"),
    "--loss-scale": ("loss_scale", "float"),
    "--initial-loss-scale": ("initial_loss_scale", "float"),
    "--min-loss-scale": ("min_loss_scale", "float"),
    "--loss-scale-window": ("loss_scale_window", "float"),
    "--hysteresis": ("hysteresis", "int"),
}


@dataclass
class ParsedFlags:
    """What the tokens said: values by attribute, the flag spelled for each, and the rest."""

    values: dict[str, int | str | bool] = field(default_factory=dict)
    spelling: dict[str, str] = field(default_factory=dict)  # attribute -> flag as written
    unknown: list[str] = field(default_factory=list)  # unknown flags (with their values)
    positional: list[str] = field(default_factory=list)  # e.g. the launcher and the script

    def flag(self, attribute: str) -> str:
        """The flag the user wrote for ``attribute`` (its first spelling when not given)."""
        if attribute in self.spelling:
            return self.spelling[attribute]
        return next(f for f, (a, _) in FLAG_SPECS.items() if a == attribute)


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


def _is_flag(token: str) -> bool:
    return token.startswith("--") and len(token) > 2


def is_value(token: str) -> bool:
    """A token that can be a flag's value (negative numbers and ``-``, stdin, included)."""
    if not token.startswith("-") or token == "-":
        return True
    try:
        float(token)
    except ValueError:
        return False
    return True


# How alike an unknown flag and a known one must be to count as a misspelling of it: one or
# two characters off in a long flag (--use-distributed-optimiser) is; Megatron-Core's real
# flags that merely share words with a known one (--encoder-tensor-model-parallel-size,
# 0.875 to --tensor-model-parallel-size) are not.
NEAR_MISS_RATIO = 0.9


def _digits(flag: str) -> str:
    return "".join(c for c in flag if c.isdigit())


def _refuse_near_miss(name: str) -> None:
    """FlagError when ``name`` is a misspelling of a flag preflight models: Megatron-Core's
    argument parser would refuse it, and ignoring it would check another configuration.
    Flags that differ in their digits are different flags (``--fp4-param-gather`` is
    Megatron-Core's NVFP4 switch, not a misspelled ``--fp8-param-gather``)."""
    match = [m for m in difflib.get_close_matches(name, FLAG_SPECS, n=3, cutoff=NEAR_MISS_RATIO)
             if _digits(m) == _digits(name)]
    if match:
        raise FlagError(f"{name} is not a Megatron-Core flag; did you mean {match[0]}? (flags that "
                        "preflight does not model, such as --lr, are listed and ignored; a "
                        "misspelling of one it models is refused, as Megatron-Core refuses it)")


def parse_megatron_flags(tokens: list[str]) -> ParsedFlags:
    """Parse tokens; later occurrences win, as with argparse. Raises FlagError on bad values."""
    parsed = ParsedFlags()
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if not _is_flag(token):
            parsed.positional.append(token)
            continue
        name, has_inline, inline = token.partition("=")
        spec = FLAG_SPECS.get(name)
        if spec is None:
            _refuse_near_miss(name)
            parsed.unknown.append(token)
            # An unknown flag's values are the tokens up to the next flag.
            while index < len(tokens) and not has_inline and is_value(tokens[index]):
                parsed.unknown[-1] += f" {tokens[index]}"
                index += 1
            continue
        attribute, kind = spec
        parsed.spelling[attribute] = name
        if kind in ("true", "false"):
            if has_inline:
                raise FlagError(f"{name} is a switch and takes no value, got {token!r}")
            parsed.values[attribute] = kind == "true"
            continue
        if has_inline:
            raw = inline
        elif index < len(tokens) and is_value(tokens[index]):
            raw = tokens[index]
            index += 1
        else:
            raise FlagError(f"{name} expects a value")
        if kind == "int":
            try:
                parsed.values[attribute] = int(raw)
            except ValueError:
                raise FlagError(f"{name} expects an integer, got {raw!r}") from None
        elif kind == "float":
            try:
                parsed.values[attribute] = float(raw)
            except ValueError:
                raise FlagError(f"{name} expects a number, got {raw!r}") from None
        else:
            parsed.values[attribute] = raw
    return parsed


def launch_flags_last(argv: list[str], known: set[str], own: set[str]) -> list[str]:
    """``verify preflight``'s argv with every flag its parser does not ``known`` (a
    Megatron-Core flag preflight does not model, such as ``--lr``) moved, with its values
    and in order, behind ``--``: listed and ignored there, as in ``--args-file``, not an
    argparse error. Left for argparse: a near-miss of one of preflight's own options
    (``own``), which argparse then refuses (its parser allows no abbreviations, as
    Megatron-Core's). One of ``own`` after ``--`` is a FlagError."""
    head, tail = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    misplaced = [t for t in tail if t.partition("=")[0] in own]
    if misplaced:
        raise FlagError(f"{misplaced[0]} is an option of verify preflight, not a Megatron-Core "
                        "flag: put it before `--` (everything after `--` is read as the launch's "
                        "flags)")
    kept, moved = [], []
    index = 0
    while index < len(head):
        token = head[index]
        index += 1
        name = token.partition("=")[0]
        if (not token.startswith("--") or name in known
                or difflib.get_close_matches(name, own, n=1, cutoff=NEAR_MISS_RATIO)):
            kept.append(token)
            continue
        moved.append(token)
        while "=" not in token and index < len(head) and is_value(head[index]):
            moved.append(head[index])
            index += 1
    return kept + (["--", *moved, *tail] if moved or tail else [])

"""A launch's mixture-of-experts settings, and Megatron-LM's rules on them.

Megatron-LM core_r0.19.0 (megatron-core 0.19.2) reads the MoE flags in
``megatron/training/arguments.py`` (``moe_freq_type``, ``validate_args``), lays out the
expert grid in ``megatron/core/parallel_state.py initialize_model_parallel``
(expert DP = world / (ETP x EP x PP)), checks the MoE fields in
``megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__``, and
builds the layers in ``megatron/core/models/gpt/gpt_layer_specs.py`` (which layers are MoE)
and ``megatron/core/transformer/moe/`` (router, experts, shared experts). Each rule here
cites its line; :mod:`verify.preflight.config` runs them with the rest, in Megatron's order.

The expert grid has no CP (``RankGenerator(..., cp=1)``): the expert-data-parallel group
spans what the dense grid splits over TP, CP and DP, less ETP x EP.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

from verify.preflight.flags import Refusal

Name = Callable[[str], str]  # Megatron attribute -> the flag as the user wrote it
SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
TOKEN_DISPATCHERS = ("allgather", "alltoall", "flex")
# TransformerConfig:1644: the shared experts overlap the dispatch only with these.
OVERLAPPING_DISPATCHERS = ("alltoall", "flex")
# megatron/training/arguments.py _eval_pattern: "only allow comma, digits, [, ], (, ), +, and *".
_PATTERN_CHARACTERS = frozenset(",0123456789[]()+*")


class LayerFreqError(ValueError):
    """--moe-layer-freq cannot be read as Megatron-LM's ``moe_freq_type`` reads it."""


def _evaluate(node: ast.AST) -> int | list | tuple:
    """The value of a pattern expression of ints, lists, tuples, ``+`` and ``*`` (what
    ``_eval_pattern``'s character filter lets through to ``eval``)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_evaluate(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        try:
            return left + right if isinstance(node.op, ast.Add) else left * right
        except TypeError as exc:
            raise LayerFreqError(str(exc)) from None
    raise LayerFreqError(f"unsupported expression {ast.dump(node)}")


def parse_layer_freq(value: object) -> int | tuple[int, ...]:
    """``moe_freq_type`` (arguments.py:326): an int N (one MoE layer every N), or a Python list
    expression of 0/1 per layer ("([0]+[1]*23)"). Returns the int or the list as a tuple;
    LayerFreqError where Megatron's converter raises (argparse then refuses the flag)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value)
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise LayerFreqError(f"invalid moe_freq_type value: {text!r}") from None
    if set(text) - _PATTERN_CHARACTERS:
        raise LayerFreqError(f"Invalid pattern: {text}")
    try:
        result = _evaluate(ast.parse(text, mode="eval").body)
    except SyntaxError:
        raise LayerFreqError(f"invalid moe_freq_type value: {text!r}") from None
    if isinstance(result, list):
        return tuple(result)
    if isinstance(result, int):
        return result
    raise LayerFreqError(f"Invalid moe_layer_freq: {type(result).__name__}, {result}")


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts settings, resolved as Megatron-LM resolves them (Megatron's
    attribute names; ``expert_tensor_parallel_size`` defaults to TP and
    ``moe_ffn_hidden_size`` to the FFN size in validate_args:569 and :1595). Validates its
    types; Megatron's rules on the values are :func:`moe_refusals`'s."""

    num_experts: int
    moe_ffn_hidden_size: int
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    moe_router_topk: int = 2
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_shared_expert_overlap: bool = False
    moe_grouped_gemm: bool = False
    moe_router_pre_softmax: bool = False
    moe_router_score_function: str = "softmax"
    moe_router_load_balancing_type: str | tuple[str, ...] = "aux_loss"
    moe_aux_loss_coeff: float | tuple[float, ...] = 0.0
    moe_token_dispatcher_type: str = "allgather"
    transformer_impl: str = "transformer_engine"

    def __post_init__(self) -> None:
        ints = ("num_experts", "moe_ffn_hidden_size", "expert_model_parallel_size",
                "expert_tensor_parallel_size", "moe_router_topk")
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"MoEConfig.{name} must be an int, got {type(value).__name__}")
        for name in ("moe_shared_expert_gate", "moe_shared_expert_overlap", "moe_grouped_gemm",
                     "moe_router_pre_softmax"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MoEConfig.{name} must be a bool, got "
                                f"{type(getattr(self, name)).__name__}")
        freq = self.moe_layer_freq
        if isinstance(freq, bool) or not (isinstance(freq, int) or (
                isinstance(freq, tuple) and all(type(f) is int for f in freq))):
            raise TypeError("MoEConfig.moe_layer_freq must be an int or a tuple of ints, got "
                            f"{freq!r}")
        if self.moe_router_score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"MoEConfig.moe_router_score_function must be one of "
                             f"{SCORE_FUNCTIONS}, got {self.moe_router_score_function!r}")
        if self.moe_token_dispatcher_type not in TOKEN_DISPATCHERS:
            raise ValueError(f"MoEConfig.moe_token_dispatcher_type must be one of "
                             f"{TOKEN_DISPATCHERS}, got {self.moe_token_dispatcher_type!r}")

    @property
    def grouped_experts(self) -> bool:
        """Whether the experts are one grouped GEMM module (TEGroupedMLP): --moe-grouped-gemm,
        except under ``--transformer-impl local``, whose spec builds SequentialMLP whatever it
        says (models/backends.py LocalSpecProvider.grouped_mlp_modules)."""
        return self.moe_grouped_gemm and self.transformer_impl != "local"

    @property
    def num_local_experts(self) -> int:
        """Experts on each expert-parallel rank (moe_layer.py:186 ``num_moe_experts // ep``)."""
        return self.num_experts // self.expert_model_parallel_size

    def expert_params_in_own_buffer(self, tensor_parallel: int) -> bool:
        """Whether the experts' params are ``allreduce=False`` and so in DDP's expert buffers,
        reduced over expert DP: ``use_expert_pgs = is_expert and (EP > 1 or ETP != TP)``
        (tensor_parallel/layers.py:961, extensions/transformer_engine.py:982); otherwise they
        are ordinary params in the dense buffer, reduced over DP x CP."""
        return self.expert_model_parallel_size > 1 or self.expert_tensor_parallel_size != tensor_parallel

    def moe_layers(self, num_layers: int) -> tuple[bool, ...]:
        """Which layers are MoE (gpt_layer_specs.py:647-657): every ``freq``-th from layer 0,
        or the given 0/1 pattern."""
        if isinstance(self.moe_layer_freq, int):
            return tuple(i % self.moe_layer_freq == 0 for i in range(num_layers))
        return tuple(bool(f) for f in self.moe_layer_freq)

    def to_dict(self) -> dict:
        """JSON-ready settings."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def expert_data_parallel_size(world: int, moe: MoEConfig, pipeline_parallel: int) -> int:
    """parallel_state.py:874-880: world // (ETP x EP x PP)."""
    return world // (moe.expert_tensor_parallel_size * moe.expert_model_parallel_size
                     * pipeline_parallel)


def expert_grid_refusals(moe: MoEConfig, world: int, pipeline_parallel: int,
                         name: Name) -> Iterator[Refusal]:
    """parallel_state.py:881 initialize_model_parallel: the world over ETP x EP x PP."""
    etp, ep = moe.expert_tensor_parallel_size, moe.expert_model_parallel_size
    grid = etp * ep * pipeline_parallel
    if world % grid:
        yield Refusal(
            f"world size {world} must be divisible by {name('expert_tensor_parallel_size')} "
            f"({etp}) x {name('expert_model_parallel_size')} ({ep}) x "
            f"{name('pipeline_model_parallel_size')} ({pipeline_parallel}) = {grid}: the expert "
            "grid's data-parallel size is world / (ETP x EP x PP) "
            "(megatron/core/parallel_state.py initialize_model_parallel: 'world_size is not "
            "divisible by expert_tensor_model_pipeline_parallel size')",
            "initialize_model_parallel", 881)


def transformer_config_refusals(moe: MoEConfig, add_bias_linear: bool,
                                name: Name) -> Iterator[Refusal]:
    """TransformerConfig.__post_init__'s MoE rules (transformer_config.py, by line)."""
    if moe.num_experts <= 0:
        yield Refusal(f"{name('num_experts')} ({moe.num_experts}) must be positive "
                      "(TransformerConfig.__post_init__: 'num_moe_experts must be "
                      "non-negative.')", "TransformerConfig", 1531)
    shared = moe.moe_shared_expert_intermediate_size
    if shared is not None and shared <= 0:
        yield Refusal(f"{name('moe_shared_expert_intermediate_size')} ({shared}) must be > 0 "
                      "(num_shared_experts x each shared expert's FFN size; "
                      "TransformerConfig.__post_init__)", "TransformerConfig", 1638)
    if (shared is not None and moe.moe_shared_expert_overlap
            and moe.moe_token_dispatcher_type not in OVERLAPPING_DISPATCHERS):
        yield Refusal(f"{name('moe_shared_expert_overlap')} works only with "
                      f"{name('moe_token_dispatcher_type')} alltoall or flex, got "
                      f"{moe.moe_token_dispatcher_type} (TransformerConfig.__post_init__)",
                      "TransformerConfig", 1644)
    types, coeffs = moe.moe_router_load_balancing_type, moe.moe_aux_loss_coeff
    if isinstance(types, tuple) and not (isinstance(coeffs, tuple) and len(coeffs) == len(types)):
        yield Refusal(f"{name('moe_aux_loss_coeff')} must give one coefficient per "
                      f"{name('moe_router_load_balancing_type')} ({len(types)} types) "
                      "(TransformerConfig.__post_init__: 'moe_aux_loss_coeff must be a list of "
                      "the same length as moe_router_load_balancing_type')",
                      "TransformerConfig", 1653)
    if add_bias_linear and moe.expert_tensor_parallel_size != 1:
        yield Refusal(f"biases in the experts (Megatron's default; --disable-bias-linear turns "
                      f"them off) need {name('expert_tensor_parallel_size')} 1 (default "
                      f"{name('tensor_model_parallel_size')}), got "
                      f"{moe.expert_tensor_parallel_size} (TransformerConfig.__post_init__: "
                      "'Bias in Moe is only supported when ETP==1')", "TransformerConfig", 2280)
    if (moe.moe_router_topk == 1 and moe.moe_router_score_function == "softmax"
            and not moe.moe_router_pre_softmax and moe.moe_router_load_balancing_type != "sinkhorn"):
        yield Refusal(f"{name('moe_router_topk')} 1 with the softmax score function needs "
                      "--moe-router-pre-softmax (TransformerConfig.__post_init__: a softmax over "
                      "one selected expert has a zero gradient)", "TransformerConfig", 2329)


def model_build_refusals(moe: MoEConfig, num_layers: int, tensor_parallel: int, swiglu: bool,
                         add_bias_linear: bool, name: Name) -> Iterator[Refusal]:
    """What building the MoE layers refuses: the layer pattern (gpt_layer_specs.py:647-671),
    the experts' FFN over ETP and the shared experts' over TP
    (tensor_parallel/layers.py ``divide()``), the shared experts' bias
    (shared_experts.py:125)."""
    freq = moe.moe_layer_freq
    if isinstance(freq, int) and freq < 1:
        yield Refusal(f"{name('moe_layer_freq')} ({freq}) must be >= 1: one MoE layer every N "
                      "layers (gpt_layer_specs.py: i % moe_layer_freq)", "model build")
    elif isinstance(freq, tuple) and len(freq) != num_layers:
        yield Refusal(f"{name('moe_layer_freq')} gives {len(freq)} layers, expected "
                      f"{name('num_layers')} = {num_layers} (gpt_layer_specs.py: 'Invalid length "
                      "of moe_layer_pattern')", "model build")
    elif isinstance(freq, tuple) and set(freq) - {0, 1}:
        yield Refusal(f"{name('moe_layer_freq')}: a layer pattern is 0 (dense) or 1 (MoE) per "
                      f"layer, got {list(freq)} (gpt_layer_specs.py: 'Invalid layer pattern')",
                      "model build")
    etp, ffn = moe.expert_tensor_parallel_size, moe.moe_ffn_hidden_size
    for size, part in ((ffn * (2 if swiglu else 1), "the experts' fc1 output"),
                       (ffn, "the experts' fc2 input")):
        if size % etp:
            yield Refusal(f"{part} ({size}, from {name('moe_ffn_hidden_size')} {ffn}, default the "
                          f"FFN size) must be divisible by "
                          f"{name('expert_tensor_parallel_size')} ({etp}) "
                          "(megatron/core/tensor_parallel/layers.py divide())", "model build")
            break
    shared = moe.moe_shared_expert_intermediate_size
    if shared is not None and shared > 0:
        if add_bias_linear:
            yield Refusal(f"{name('moe_shared_expert_intermediate_size')}: the shared experts "
                          "have no bias; give --disable-bias-linear (shared_experts.py: 'bias "
                          "is not supported in the shared experts')", "model build")
        if shared % tensor_parallel:
            yield Refusal(f"{name('moe_shared_expert_intermediate_size')} ({shared}) must be "
                          f"divisible by {name('tensor_model_parallel_size')} ({tensor_parallel}) "
                          "(megatron/core/tensor_parallel/layers.py divide())", "model build")


__all__ = ["LayerFreqError", "MoEConfig", "expert_data_parallel_size", "expert_grid_refusals",
           "model_build_refusals", "parse_layer_freq", "transformer_config_refusals"]

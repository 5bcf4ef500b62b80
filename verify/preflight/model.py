"""The GPT model's parameters on one pipeline stage and model chunk, as shapes only.

Shapes and registration order follow Megatron-Core's GPT model with the local
layer spec (``megatron/core/models/gpt/gpt_layer_specs.py``
``get_gpt_layer_local_spec``), per tensor-parallel rank:

- ``GPTModel.__init__`` registers ``embedding`` (pre-process chunk), then
  ``decoder`` (its layers, then ``final_layernorm`` on the post-process chunk),
  then ``output_layer`` (post-process chunk).
- ``LanguageModelEmbedding``: ``word_embeddings`` ``[vocab/TP, h]``
  (VocabParallelEmbedding), then ``position_embeddings`` ``[max_pos, h]`` when
  ``--position-embedding-type learned_absolute`` (not sharded).
- ``TransformerLayer.__init__``: ``input_layernorm``, ``self_attention``,
  ``pre_mlp_layernorm``, ``mlp``. ``Attention.__init__`` builds ``linear_proj``
  before ``SelfAttention.__init__`` builds ``linear_qkv``, so the projection
  is registered first. Linear layers register ``weight`` then ``bias``.
- ``linear_qkv`` (ColumnParallel): ``[(q + 2 kv)/TP, h]`` with
  ``q = heads * kv_channels``, ``kv = groups * kv_channels``; bias ``[(q + 2 kv)/TP]``.
- ``linear_proj`` (RowParallel): ``[h, q/TP]``; bias ``[h]`` (not sharded).
- ``linear_fc1`` (ColumnParallel): ``[ffn'/TP, h]``, ``ffn' = 2 ffn`` with
  SwiGLU; bias ``[ffn'/TP]``. ``linear_fc2`` (RowParallel): ``[h, ffn/TP]``; bias ``[h]``.
- LayerNorm: weight and bias ``[h]``; RMSNorm: weight only (not sharded).
- ``output_layer`` (ColumnParallel, no bias): ``[vocab/TP, h]``. With tied
  embeddings it is allocated only where the chunk has no embedding
  (``skip_weight_param_allocation=pre_process and share_embeddings...``); that
  copy on the last stage and the first stage's word embedding are flagged
  ``shared_embedding`` when PP > 1 (``LanguageModule.setup_embeddings_and_output_layer``).

Mixture of experts (``--num-experts``; ``--moe-layer-freq`` decides which layers, see
:meth:`verify.preflight.moe.MoEConfig.moe_layers`): the layer's ``mlp`` is a ``MoELayer``
(``megatron/core/transformer/moe/moe_layer.py``), which registers

- ``router.weight`` ``[experts, h]`` (``TopKRouter``, not sharded; ``router.bias``
  ``[experts]`` with biases), then
- ``experts``: the local spec's ``SequentialMLP`` (experts.py), per local expert
  (``experts / EP`` of them) an ``MLP`` with ``is_expert=True`` split over ETP:
  ``local_experts.{i}.linear_fc1`` ``[moe_ffn'/ETP, h]`` and ``linear_fc2``
  ``[h, moe_ffn/ETP]`` (biases as the dense MLP's). Under ``--moe-grouped-gemm`` the
  Transformer Engine spec's ``TEGroupedMLP`` registers the same sizes as
  ``linear_fc1.weight0..N-1`` (then ``bias0..N-1``), then ``linear_fc2``'s: every fc1
  before every fc2, which is laid out here when the flag is given;
- ``shared_experts`` (``--moe-shared-expert-intermediate-size S``): a TP-split MLP of FFN
  ``S`` without biases, then ``gate_weight`` ``[1, h]`` with ``--moe-shared-expert-gate``.

The experts' params are ``allreduce=False`` (DDP's expert buffers, reduced over expert
DP) where EP > 1 or ETP != TP (``ParamSpec.expert``); the router and the shared experts
are ordinary params.

Hybrid Mamba models (``--hybrid-layer-pattern``): ``HybridModel`` registers the same
embedding and output layer around a ``HybridStack`` whose layers follow the pattern (the
parameters of each kind: :mod:`verify.preflight.hybrid`) and whose final norm is
``decoder.final_norm`` (hybrid_block.py, a TENorm).
Query/key layernorm (``--qk-layernorm``) adds ``self_attention.q_layernorm`` and
``k_layernorm`` over one head (kv_channels; weight, and bias under LayerNorm, not sharded)
after ``linear_qkv``. Multi-token prediction (``--mtp-num-layers``) puts on the last stage's
last chunk the word embeddings (``shared_embedding`` at PP > 1, tied or not), then after the
decoder ``mtp.layers.{i}`` (enorm, hnorm, ``eh_proj`` ``[h/TP, 2h]``, ``mtp_model_layer``: the
decoder's last layer's kind, ``final_layernorm``), then the output layer (allocated there at
PP > 1 even when tied, and then never the shared copy); the decoder's final layernorm goes
with the last decoder layer (:mod:`verify.preflight.mtp` cites the source).

The Transformer Engine spec fuses the layernorms into ``linear_qkv`` and
``linear_fc1``: the same sizes, in another order, which can move the
64-element start padding of the distributed optimizer by a few elements.
"""

from __future__ import annotations

from dataclasses import dataclass

from verify.preflight.config import PreflightConfig
from verify.preflight.hybrid import layer_shapes


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a tensor-parallel rank holds it."""

    name: str
    shape: tuple[int, ...]
    shared_embedding: bool = False
    expert: bool = False  # allreduce=False: in DDP's expert buffer, reduced over expert DP

    @property
    def numel(self) -> int:
        total = 1
        for dim in self.shape:
            total *= dim
        return total


def layers_of_chunk(config: PreflightConfig, stage: int, chunk: int) -> range:
    """Global layer indices of ``chunk`` on pipeline ``stage``, as Megatron splits them
    (:mod:`verify.preflight.pipeline_split`: uneven first/last stages, the embedding and the
    loss counted as layers)."""
    return config.layer_split.layer_range(stage, chunk)


def layer_parameters(config: PreflightConfig, index: int,
                     prefix: str | None = None) -> list[ParamSpec]:
    """Parameters of transformer layer ``index`` on one TP rank, in registration order, named
    under ``prefix`` (default the decoder's ``decoder.layers.{index}.``)."""
    h, tp = config.hidden_size, config.tensor_model_parallel_size
    q = config.num_attention_heads * config.kv_channels
    kv = config.num_query_groups * config.kv_channels
    fc1_out = config.ffn_hidden_size * (2 if config.swiglu else 1)
    bias = config.add_bias_linear
    prefix = f"decoder.layers.{index}." if prefix is None else prefix
    if config.hybrid is not None:
        symbol = config.hybrid.layer_types[index]
        return [ParamSpec(prefix + name, shape) for name, shape in layer_shapes(
            config.hybrid, symbol, h, tp, (q, kv), (fc1_out, config.ffn_hidden_size),
            config.normalization == "LayerNorm", bias, config.add_qkv_bias)]

    def norm(name: str) -> list[ParamSpec]:
        specs = [ParamSpec(prefix + name + ".weight", (h,))]
        if config.normalization == "LayerNorm":
            specs.append(ParamSpec(prefix + name + ".bias", (h,)))
        return specs

    def linear(name: str, out_features: int, in_features: int, bias_features: int,
               with_bias: bool = bias) -> list[ParamSpec]:
        specs = [ParamSpec(prefix + name + ".weight", (out_features, in_features))]
        if with_bias:
            specs.append(ParamSpec(prefix + name + ".bias", (bias_features,)))
        return specs

    moe = config.moe
    if moe is not None and moe.moe_layers(config.num_layers)[index]:
        mlp = moe_parameters(config, prefix + "mlp.")
    else:
        mlp = [*linear("mlp.linear_fc1", fc1_out // tp, h, fc1_out // tp),
               *linear("mlp.linear_fc2", h, config.ffn_hidden_size // tp, h)]
    return [
        *norm("input_layernorm"),
        *linear("self_attention.linear_proj", h, q // tp, h),
        # attention.py SelfAttention: bias=add_bias_linear or add_qkv_bias.
        *linear("self_attention.linear_qkv", (q + 2 * kv) // tp, h, (q + 2 * kv) // tp,
                bias or config.add_qkv_bias),
        *(qk_norms(config, prefix) if config.qk_norm_params else []),
        *norm("pre_mlp_layernorm"),
        *mlp,
    ]


def qk_norms(config: PreflightConfig, prefix: str) -> list[ParamSpec]:
    """``q_layernorm`` then ``k_layernorm`` over one head (attention.py:1722-1740)."""
    d = config.kv_channels
    bias = config.normalization == "LayerNorm"
    return [ParamSpec(f"{prefix}self_attention.{name}.{part}", (d,))
            for name in ("q_layernorm", "k_layernorm")
            for part in (("weight", "bias") if bias else ("weight",))]


def norm_parameters(config: PreflightConfig, name: str) -> list[ParamSpec]:
    """A layernorm over h: weight, and bias under LayerNorm (RMSNorm has none)."""
    h = config.hidden_size
    return [ParamSpec(f"{name}.weight", (h,)),
            *([ParamSpec(f"{name}.bias", (h,))] if config.normalization == "LayerNorm" else [])]


def mtp_parameters(config: PreflightConfig) -> list[ParamSpec]:
    """The MTP block on one TP rank, in registration order (multi_token_prediction.py:983-1053):
    per layer built, enorm, hnorm, eh_proj (ColumnParallelLinear 2h -> h, no bias), a
    transformer layer of the decoder's last layer's kind, final_layernorm."""
    if config.mtp is None:
        return []
    h, tp = config.hidden_size, config.tensor_model_parallel_size
    params: list[ParamSpec] = []
    for i in range(config.mtp.layers_built):
        base = f"mtp.layers.{i}."
        params += [*norm_parameters(config, base + "enorm"), *norm_parameters(config, base + "hnorm"),
                   ParamSpec(base + "eh_proj.weight", (h // tp, 2 * h)),
                   *layer_parameters(config, config.num_layers - 1, base + "mtp_model_layer."),
                   *norm_parameters(config, base + "final_layernorm")]
    return params


def moe_parameters(config: PreflightConfig, prefix: str) -> list[ParamSpec]:
    """A MoE layer's ``mlp`` on one TP (and ETP) rank, in registration order (module doc)."""
    moe = config.moe
    if moe is None:
        raise ValueError("moe_parameters needs a configuration with experts (config.moe)")
    h, tp, bias = config.hidden_size, config.tensor_model_parallel_size, config.add_bias_linear
    etp, n_local = moe.expert_tensor_parallel_size, moe.num_local_experts
    expert = config.expert_buffers
    glu = 2 if config.swiglu else 1
    fc1_rows, fc2_cols = moe.moe_ffn_hidden_size * glu // etp, moe.moe_ffn_hidden_size // etp
    # router.py:61-66: fp32 at creation, cast to the params dtype (:81); not sharded.
    params = [ParamSpec(prefix + "router.weight", (moe.num_experts, h))]
    if bias:
        params.append(ParamSpec(prefix + "router.bias", (moe.num_experts,)))
    if moe.grouped_experts:  # TEGroupedMLP: each GroupedLinear's weight{i}, then bias{i}
        for name, shape, bias_shape in (("linear_fc1", (fc1_rows, h), (fc1_rows,)),
                                        ("linear_fc2", (h, fc2_cols), (h,))):
            base = f"{prefix}experts.{name}."
            params += [ParamSpec(f"{base}weight{i}", shape, expert=expert) for i in range(n_local)]
            if bias:
                params += [ParamSpec(f"{base}bias{i}", bias_shape, expert=expert)
                           for i in range(n_local)]
    else:  # SequentialMLP: local_experts.{i}, an MLP each
        for i in range(n_local):
            base = f"{prefix}experts.local_experts.{i}."
            params.append(ParamSpec(base + "linear_fc1.weight", (fc1_rows, h), expert=expert))
            if bias:
                params.append(ParamSpec(base + "linear_fc1.bias", (fc1_rows,), expert=expert))
            params.append(ParamSpec(base + "linear_fc2.weight", (h, fc2_cols), expert=expert))
            if bias:
                params.append(ParamSpec(base + "linear_fc2.bias", (h,), expert=expert))
    shared = moe.moe_shared_expert_intermediate_size
    if shared is not None:  # shared_experts.py: no bias (asserted), split over TP
        params.append(ParamSpec(prefix + "shared_experts.linear_fc1.weight",
                                (shared * glu // tp, h)))
        params.append(ParamSpec(prefix + "shared_experts.linear_fc2.weight", (h, shared // tp)))
        if moe.moe_shared_expert_gate:
            params.append(ParamSpec(prefix + "shared_experts.gate_weight", (1, h)))
    return params


def chunk_parameters(config: PreflightConfig, stage: int, chunk: int) -> list[ParamSpec]:
    """Every parameter of one model chunk on one TP rank, in registration order."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    h, tp = config.hidden_size, config.tensor_model_parallel_size
    pre_process = stage == 0 and chunk == 0
    post_process = stage == pp - 1 and chunk == vpp - 1
    mtp_process = post_process and config.mtp is not None
    # The word embeddings' shared copy (shared_embedding: own bucket under the distributed
    # optimizer) sits on the output layer, or with MTP on the last chunk's embedding.
    shared = config.word_embedding_all_reduce
    vocab_rows = config.padded_vocab_size // tp
    params: list[ParamSpec] = []
    if pre_process or mtp_process:
        params.append(ParamSpec("embedding.word_embeddings.weight", (vocab_rows, h),
                                shared_embedding=shared))
        if config.position_embedding_type == "learned_absolute":
            params.append(ParamSpec("embedding.position_embeddings.weight",
                                    (config.max_position_embeddings, h)))
    layers = layers_of_chunk(config, stage, chunk)
    for index in layers:
        params.extend(layer_parameters(config, index))
    # transformer_block.py:387-414: with MTP the final layernorm goes with the last layer.
    if (config.num_layers - 1 in layers) if config.mtp is not None else post_process:
        # a hybrid stack's is its final_norm (hybrid_block.py)
        params += norm_parameters(config, "decoder.final_layernorm" if config.hybrid is None
                                  else "decoder.final_norm")
    if mtp_process:
        params += mtp_parameters(config)
    if post_process and (config.untie_embeddings_and_output_weights or not pre_process):
        params.append(ParamSpec("output_layer.weight", (vocab_rows, h),
                                shared_embedding=shared and not mtp_process))
    return params

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

The Transformer Engine spec fuses the layernorms into ``linear_qkv`` and
``linear_fc1``: the same sizes, in another order, which can move the
64-element start padding of the distributed optimizer by a few elements.
"""

from __future__ import annotations

from dataclasses import dataclass

from verify.preflight.config import PreflightConfig


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a tensor-parallel rank holds it."""

    name: str
    shape: tuple[int, ...]
    shared_embedding: bool = False

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


def layer_parameters(config: PreflightConfig, index: int) -> list[ParamSpec]:
    """Parameters of transformer layer ``index`` on one TP rank, in registration order."""
    h, tp = config.hidden_size, config.tensor_model_parallel_size
    q = config.num_attention_heads * config.kv_channels
    kv = config.num_query_groups * config.kv_channels
    fc1_out = config.ffn_hidden_size * (2 if config.swiglu else 1)
    bias = config.add_bias_linear
    prefix = f"decoder.layers.{index}."

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

    return [
        *norm("input_layernorm"),
        *linear("self_attention.linear_proj", h, q // tp, h),
        # attention.py SelfAttention: bias=add_bias_linear or add_qkv_bias.
        *linear("self_attention.linear_qkv", (q + 2 * kv) // tp, h, (q + 2 * kv) // tp,
                bias or config.add_qkv_bias),
        *norm("pre_mlp_layernorm"),
        *linear("mlp.linear_fc1", fc1_out // tp, h, fc1_out // tp),
        *linear("mlp.linear_fc2", h, config.ffn_hidden_size // tp, h),
    ]


def chunk_parameters(config: PreflightConfig, stage: int, chunk: int) -> list[ParamSpec]:
    """Every parameter of one model chunk on one TP rank, in registration order."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    h, tp = config.hidden_size, config.tensor_model_parallel_size
    pre_process = stage == 0 and chunk == 0
    post_process = stage == pp - 1 and chunk == vpp - 1
    shared = config.tied_embeddings and pp > 1
    vocab_rows = config.padded_vocab_size // tp
    params: list[ParamSpec] = []
    if pre_process:
        params.append(ParamSpec("embedding.word_embeddings.weight", (vocab_rows, h),
                                shared_embedding=shared))
        if config.position_embedding_type == "learned_absolute":
            params.append(ParamSpec("embedding.position_embeddings.weight",
                                    (config.max_position_embeddings, h)))
    for index in layers_of_chunk(config, stage, chunk):
        params.extend(layer_parameters(config, index))
    if post_process:
        params.append(ParamSpec("decoder.final_layernorm.weight", (h,)))
        if config.normalization == "LayerNorm":
            params.append(ParamSpec("decoder.final_layernorm.bias", (h,)))
        if config.untie_embeddings_and_output_weights or not pre_process:
            params.append(ParamSpec("output_layer.weight", (vocab_rows, h),
                                    shared_embedding=shared))
    return params

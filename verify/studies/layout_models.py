"""The decoder-only transformers ``verify layout`` lays out: their parameter sizes in
registration order (``ModelSpec``) and the built-in shapes (``MODELS``), shared by the report
(``verify.studies.layout``) and the user's own model (``verify.studies.layout_input``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, enough to list its parameter sizes in registration order."""

    name: str
    hidden: int
    layers: int
    vocab: int
    ffn_hidden: int
    kv_channels_total: int  # width of K (and of V): hidden for MHA, less for GQA
    gated_mlp: bool  # SwiGLU: fc1 holds gate and up projections
    biases: bool
    layernorm_bias: bool
    learned_positions: int  # rows of a learned position embedding (0 = rotary)
    tied_embeddings: bool

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "vocab", "ffn_hidden", "kv_channels_total"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.learned_positions, bool) or not isinstance(self.learned_positions, int) \
                or self.learned_positions < 0:
            raise ValueError(
                f"ModelSpec.learned_positions must be an int >= 0, got {self.learned_positions!r}"
            )

    def param_numels(self) -> tuple[list[int], list[int], list[str]]:
        """(numels, shared-embedding indices, names), registration order."""
        h = self.hidden
        numels: list[int] = []
        names: list[str] = []

        def add(name: str, numel: int) -> None:
            names.append(name)
            numels.append(numel)

        add("embedding.word_embeddings.weight", self.vocab * h)
        if self.learned_positions:
            add("embedding.position_embeddings.weight", self.learned_positions * h)
        qkv_out = h + 2 * self.kv_channels_total
        fc1_out = 2 * self.ffn_hidden if self.gated_mlp else self.ffn_hidden
        for i in range(self.layers):
            p = f"decoder.layers.{i}."
            add(p + "input_layernorm.weight", h)
            if self.layernorm_bias:
                add(p + "input_layernorm.bias", h)
            add(p + "self_attention.linear_qkv.weight", qkv_out * h)
            if self.biases:
                add(p + "self_attention.linear_qkv.bias", qkv_out)
            add(p + "self_attention.linear_proj.weight", h * h)
            if self.biases:
                add(p + "self_attention.linear_proj.bias", h)
            add(p + "pre_mlp_layernorm.weight", h)
            if self.layernorm_bias:
                add(p + "pre_mlp_layernorm.bias", h)
            add(p + "mlp.linear_fc1.weight", fc1_out * h)
            if self.biases:
                add(p + "mlp.linear_fc1.bias", fc1_out)
            add(p + "mlp.linear_fc2.weight", h * self.ffn_hidden)
            if self.biases:
                add(p + "mlp.linear_fc2.bias", h)
        add("decoder.final_layernorm.weight", h)
        if self.layernorm_bias:
            add("decoder.final_layernorm.bias", h)
        shared: list[int] = []
        if self.tied_embeddings:
            shared.append(0)  # the word embedding doubles as the output layer
        else:
            add("output_layer.weight", self.vocab * h)
        return numels, shared, names


MODELS: dict[str, ModelSpec] = {
    # GPT-3 Small: 12 x 768, learned positions, tied embeddings, biases everywhere.
    "gpt-125m": ModelSpec("gpt-125m", 768, 12, 50304, 3072, 768, False, True, True, 2048, True),
    # Llama-2-7B shape: RMSNorm (no bias), SwiGLU, untied output layer, rotary.
    "llama-7b": ModelSpec("llama-7b", 4096, 32, 32000, 11008, 4096, True, False, False, 0, False),
    # Llama-2-70B shape: GQA with 8 KV heads of 128 channels.
    "llama-70b": ModelSpec("llama-70b", 8192, 80, 32000, 28672, 1024, True, False, False, 0, False),
}

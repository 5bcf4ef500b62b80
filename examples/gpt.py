"""A small GPT-like language model and its split into pipeline stages.

The model: token embedding + learned positions, ``num_layers`` pre-LayerNorm
transformer blocks (causal self-attention through
``scaled_dot_product_attention(is_causal=True)``, a GELU MLP), a final
LayerNorm and an output layer that is tied to the token embedding (the
default) or a separate weight.

:func:`build_stage` cuts the model into ``pp_size`` pipeline stages with
contiguous blocks: the first stage holds the embeddings, the last the final
norm and the output layer. With tying and ``pp_size > 1`` the last stage holds
its own copy of the embedding weight; both copies are marked
``shared_embedding = True`` so that ``fastgrad`` gives them their own bucket
(same bucket-relative offsets under the distributed optimizer) and
``fastgrad.pipeline.finalize_grads`` sums their gradients over the embedding
group, which keeps the copies identical after every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02  # GPT-2 / Megatron-Core's default init_method_std


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model; validates itself."""

    vocab_size: int
    seq_length: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_length", "hidden_size", "num_layers", "num_attention_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an int >= 1, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"GPTConfig.num_attention_heads={self.num_attention_heads} must divide "
                f"hidden_size={self.hidden_size}"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (batch, seq, hidden) -> (batch, seq, hidden)."""
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=-1)
        shape = (batch, seq, self.num_heads, hidden // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_size)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, 4 * config.hidden_size),
            nn.GELU(),
            nn.Linear(4 * config.hidden_size, config.hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block (same shape in and out)."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The whole model in one module (the source that :func:`build_stage` cuts)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.seq_length, config.hidden_size)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size)
        self.output = (
            None
            if config.tie_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._init_weights()

    def _init_weights(self) -> None:
        # Normal(0, 0.02) everywhere; residual output projections scaled by
        # 1/sqrt(2 * layers) as in GPT-2, so the residual stream does not grow with depth.
        residual_std = INIT_STD / math.sqrt(2 * self.config.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(("attn.proj", "mlp.2")) else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def output_weight(self) -> nn.Parameter:
        """The output layer's weight (the embedding weight when tied)."""
        return self.embedding.weight if self.output is None else self.output.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: (batch, seq) int64 -> logits (batch, seq, vocab)."""
        return build_stage(self, 0, 1)(tokens)


class GPTStage(nn.Module):
    """One pipeline stage: embeddings (first stage), blocks, norm + output (last stage).

    ``forward`` takes token ids on the first stage and the previous stage's
    hidden states (batch, seq, hidden) otherwise; it returns logits on the last
    stage and hidden states otherwise.
    """

    def __init__(
        self,
        blocks: list[TransformerBlock],
        *,
        embedding: nn.Embedding | None,
        position: nn.Embedding | None,
        final_norm: nn.LayerNorm | None,
        output_weight: nn.Parameter | None,
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self.position = position
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm
        if output_weight is not None and embedding is not None and (
            output_weight is embedding.weight
        ):
            self.output_weight = None  # tied inside this stage: reuse the embedding weight
            self._tied_locally = True
        else:
            self.output_weight = output_weight
            self._tied_locally = False

    @property
    def is_first(self) -> bool:
        """True when this stage embeds token ids."""
        return self.embedding is not None

    @property
    def is_last(self) -> bool:
        """True when this stage produces logits."""
        return self.final_norm is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run this stage's part of the model."""
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.embedding(x) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            weight = self.embedding.weight if self._tied_locally else self.output_weight
            x = F.linear(self.final_norm(x), weight)
        return x


def build_stage(model: GPT, stage: int, pp_size: int) -> GPTStage:
    """Stage ``stage`` of ``pp_size``: its modules are ``model``'s own (shared, not copied).

    Exception: with tied embeddings and ``pp_size > 1`` the last stage gets a
    fresh parameter holding a copy of the embedding weight; it and the first
    stage's embedding weight are marked ``shared_embedding = True``.
    """
    if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"pp_size must be an int >= 1, got {pp_size!r}")
    if not 0 <= stage < pp_size:
        raise ValueError(f"stage must be in [0, {pp_size}), got {stage!r}")
    layers = model.config.num_layers
    if layers % pp_size:
        raise ValueError(f"num_layers={layers} must be divisible by pp_size={pp_size}")
    per_stage = layers // pp_size
    first, last = stage == 0, stage == pp_size - 1
    output_weight: nn.Parameter | None = None
    if last:
        output_weight = model.output_weight()
        if model.config.tie_embeddings and pp_size > 1:
            output_weight = nn.Parameter(model.embedding.weight.detach().clone())
            output_weight.shared_embedding = True
            model.embedding.weight.shared_embedding = True
    if first and model.config.tie_embeddings and pp_size > 1:
        model.embedding.weight.shared_embedding = True
    return GPTStage(
        list(model.blocks[stage * per_stage : (stage + 1) * per_stage]),
        embedding=model.embedding if first else None,
        position=model.position if first else None,
        final_norm=model.final_norm if last else None,
        output_weight=output_weight,
    )


def shared_embedding_params(stage_module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``stage_module`` marked ``shared_embedding`` (tied across stages)."""
    return [p for p in stage_module.parameters() if getattr(p, "shared_embedding", False)]

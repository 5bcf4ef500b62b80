"""A launch's multi-token prediction (MTP) and query/key layernorm settings, and Megatron-LM's
rules on them.

Megatron-LM core_r0.19.0 (megatron-core 0.19.2):

- ``--mtp-num-layers N`` (``megatron/training/arguments.py`` validate_args:855-860: only with
  ``--position-embedding-type rope`` or ``none``). Without ``--pipeline-model-parallel-layout``
  (not modelled) every MTP layer sits on the last pipeline stage's last model chunk
  (``megatron/core/transformer/multi_token_prediction.py`` ``mtp_on_this_rank``:692-710
  ``get_mtp_num_layers_to_build``; the block asserts the last virtual stage, :1671). That chunk
  then holds the word embeddings too (``gpt_model.py``:167 ``if self.pre_process or
  self.mtp_process``), a copy flagged ``shared_embedding`` and all-reduced with the first
  stage's over the embedding group at every step, tied or not
  (``language_module.py``:247-284, ``finalize_model_grads.py``:132-147
  ``_get_shared_word_embedding_weight``: ``share_embeddings_and_output_weights or
  mtp_num_layers``). The decoder's final layernorm moves to the chunk that holds the last
  decoder layer (``transformer_block.py``:387-414).
- Each MTP layer (``MultiTokenPredictionLayer.__init__``:983-1053) registers ``enorm``,
  ``hnorm`` (the backend's layernorm over h), ``eh_proj`` (a ColumnParallelLinear 2h -> h,
  no bias: weight ``[h/TP, 2h]``), ``mtp_model_layer`` (a transformer layer of the decoder's
  last layer's spec: ``megatron/training/models/gpt.py``:401-416, ``gpt_layer_specs.py``:769)
  and ``final_layernorm``. ``--mtp-use-repeated-layer`` builds one such layer and applies it N
  times (``multi_token_prediction.py``:1766-1776, ``gpt_layer_specs.py``:779-782).
- ``--qk-layernorm``: every attention layer's ``q_layernorm`` and ``k_layernorm`` over one
  head (``attention.py``:1697-1740 ``hidden_size=self.hidden_size_per_attention_head`` =
  kv_channels, :350), registered after ``linear_qkv``; LayerNorm weight and bias, RMSNorm
  weight only; replicated over TP, their grads summed over TP after the DP reduction
  (``finalize_model_grads.py``:451-454 ``_allreduce_non_tensor_model_parallel_grads``:
  ``config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)``). With
  ``--qk-l2-norm`` the norms are ``L2Norm``, which has no parameters (``gpt_layer_specs.py``:328,
  ``torch_norm.py`` L2Norm).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

from verify.preflight.flags import Refusal

Name = Callable[[str], str]  # Megatron attribute -> the flag as the user wrote it
# validate_args:856: "The supported position embedding types are rope and none."
MTP_POSITION_EMBEDDINGS = ("rope", "none")
# TransformerConfig.mtp_loss_scaling_factor's default (transformer_config.py:75).
DEFAULT_MTP_LOSS_SCALING_FACTOR = 0.1


@dataclass(frozen=True)
class MTPConfig:
    """The multi-token prediction settings (Megatron's attribute names; validates its types).

    ``mtp_num_layers``: the prediction depths (>= 1: ``--mtp-num-layers 0`` is no MTP, as in
    Megatron, where every use tests it for truth)."""

    mtp_num_layers: int
    mtp_use_repeated_layer: bool = False
    mtp_loss_scaling_factor: float = DEFAULT_MTP_LOSS_SCALING_FACTOR

    def __post_init__(self) -> None:
        depth = self.mtp_num_layers
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise TypeError(f"MTPConfig.mtp_num_layers must be an int, got {type(depth).__name__}")
        if depth < 1:
            raise ValueError(f"MTPConfig.mtp_num_layers must be >= 1 (0 is no MTP), got {depth}")
        if not isinstance(self.mtp_use_repeated_layer, bool):
            raise TypeError("MTPConfig.mtp_use_repeated_layer must be a bool, got "
                            f"{type(self.mtp_use_repeated_layer).__name__}")
        factor = self.mtp_loss_scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError("MTPConfig.mtp_loss_scaling_factor must be a number, got "
                            f"{type(factor).__name__}")

    @property
    def layers_built(self) -> int:
        """The MTP layers the last chunk builds: one under --mtp-use-repeated-layer, else N."""
        return 1 if self.mtp_use_repeated_layer else self.mtp_num_layers

    def to_dict(self) -> dict:
        """JSON-ready settings."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {
            "layers_built": self.layers_built}


def mtp_from_flags(num_layers: object, repeated: object, factor: object) -> MTPConfig | None:
    """The MTP settings of a launch's values, None without MTP (absent or 0)."""
    if not num_layers:
        return None
    return MTPConfig(num_layers, bool(repeated),
                     DEFAULT_MTP_LOSS_SCALING_FACTOR if factor is None else factor)


def validate_args_refusals(mtp: MTPConfig, position_embedding_type: str,
                           name: Name) -> Iterator[Refusal]:
    """megatron/training/arguments.py:855-860 validate_args ("MTP validation"); its second
    check (:1861, learned_absolute and mrope allowed too) is met whenever the first is."""
    if position_embedding_type not in MTP_POSITION_EMBEDDINGS:
        yield Refusal(f"{name('mtp_num_layers')} ({mtp.mtp_num_layers}) needs "
                      f"{name('position_embedding_type')} rope or none, got "
                      f"{position_embedding_type} (validate_args: 'Multi-Token Prediction (MTP) "
                      "is not supported with ... position embedding type')", "validate_args", 856)


def model_build_refusals(mtp: MTPConfig, hidden_size: int, tensor_parallel: int,
                         name: Name) -> Iterator[Refusal]:
    """Building the MTP layers: ``eh_proj``, a ColumnParallelLinear of output h, divides h over
    TP (multi_token_prediction.py:1000; tensor_parallel/layers.py ColumnParallelLinear
    ``divide(output_size, world_size)``)."""
    if hidden_size % tensor_parallel:
        yield Refusal(f"{name('mtp_num_layers')}: the MTP projection eh_proj's output "
                      f"{name('hidden_size')} ({hidden_size}) must be divisible by "
                      f"{name('tensor_model_parallel_size')} ({tensor_parallel}) "
                      "(multi_token_prediction.py eh_proj, a ColumnParallelLinear 2h -> h; "
                      "megatron/core/tensor_parallel/layers.py divide())", "model build")


def qk_norm_params(qk_layernorm: bool, qk_l2_norm: bool) -> bool:
    """Whether attention has q/k layernorm parameters: --qk-layernorm, unless --qk-l2-norm
    makes them L2Norm (no parameters; gpt_layer_specs.py:328, attention.py:1697)."""
    return qk_layernorm and not qk_l2_norm


__all__ = ["DEFAULT_MTP_LOSS_SCALING_FACTOR", "MTPConfig", "MTP_POSITION_EMBEDDINGS",
           "model_build_refusals", "mtp_from_flags", "qk_norm_params", "validate_args_refusals"]

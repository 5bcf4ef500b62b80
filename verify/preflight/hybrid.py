"""A launch's hybrid (Mamba) layer pattern, and Megatron-LM's rules on it.

Megatron-LM core_r0.19.0 (megatron-core 0.19.2) reads ``--hybrid-layer-pattern`` (or its
deprecated spelling ``--hybrid-override-pattern``) in ``megatron/training/arguments.py
validate_args:717-891``: the pattern's main part (before the first ``/``) derives
``num_layers`` (its symbols less the ``|`` pipeline separators) and, where it has ``|``
separators, the virtual pipeline size (segments / PP); the interleaving and accounting
flags are refused beside it. ``megatron/core/models/hybrid/hybrid_layer_allocation.py``
checks the symbols (``Symbols.VALID_LAYERS``) and gives each (pipeline rank, virtual stage)
its segment (``select_pipeline_segment``: segment ``vp_stage x PP + pp_rank`` with ``|``;
without, the layers split evenly over PP, or by the uneven first/last stage flags).
``HybridModel`` (``hybrid_model.py``) builds the ``HybridStack`` of the spec
``hybrid_layer_specs.hybrid_stack_spec`` (Transformer Engine modules), whose Mamba mixer
(``megatron/core/ssm/mamba_mixer.py``) asserts its head and group counts over TP.

Modelled here: the Mamba ``M``, attention ``*`` and MLP ``-`` layers, with ``|`` stage
separators. Not modelled (refused by :mod:`verify.preflight.flags`): GDN ``G``, MLA ``+``,
DeepSeek sparse attention ``D``, MoE ``E`` layers, MTP depths after ``/``, and a pattern with
``--num-experts``.

The parameters of one layer on one TP rank, in ``named_parameters`` order (a module's own
parameters before its children's, children in registration order), with ``h`` the hidden
size, ``T`` TP, ``d_inner = heads x head dim`` (heads default ``2 h / head dim``,
``expand=2``), ``n`` Mamba heads, ``g`` groups, ``s`` state dim:

- ``M`` (``MambaLayer``: its ``norm`` is IdentityOp, the norm is fused into ``in_proj``):
  ``mixer.conv1d_weight [d_inner/T + 2 g/T s, 1, 4]``, ``conv1d_bias [same]``, ``dt_bias
  [n/T]``, ``A_log [n/T]``, ``D [n/T]`` (mamba_mixer.py:321-414, every one TP-sharded on dim
  0), then ``in_proj`` (TELayerNormColumnParallelLinear, no bias, mamba_mixer.py:279):
  ``layer_norm_weight [h]`` (and ``layer_norm_bias`` under LayerNorm), ``weight [(2 d_inner
  + 2 g s + n)/T, h]``; ``norm.weight [d_inner/T]`` (the gated RMSNorm, :417); ``out_proj``
  (TERowParallelLinear, no bias): ``weight [h, d_inner/T]``. A_log and D are made in fp32 and
  cast with the rest by Float16Module (megatron/core/transformer/module.py:464): one buffer.
  They are 1-D, so Megatron-Core's default no-weight-decay rule (1-D params and biases,
  megatron/core/optimizer/__init__.py:108) already exempts them, as it does dt_bias, the
  conv1d bias and the norms. No mixer param is ``allreduce=False``: all are in the dense
  buffer, reduced over DP x CP like the rest.
- ``*`` (TransformerLayer with only ``self_attention``; the input norm fused into
  ``linear_qkv``): ``linear_proj.weight [h, q/T]`` (``bias [h]``), ``linear_qkv
  .layer_norm_weight [h]`` (``layer_norm_bias``), ``linear_qkv.weight [(q + 2 kv)/T, h]``
  (``bias``), as the GPT layer's attention.
- ``-`` (MLPLayer: only ``mlp``, its norm fused into ``linear_fc1``): ``linear_fc1
  .layer_norm_weight [h]`` (``layer_norm_bias``), ``linear_fc1.weight [ffn'/T, h]``
  (``bias``), ``linear_fc2.weight [h, ffn/T]`` (``bias [h]``).

Transformer Engine's LayerNormLinear registers ``layer_norm_weight`` and
``layer_norm_bias`` before its ``weight`` and ``bias`` (transformer_engine/pytorch/module/
layernorm_linear.py ``LayerNormLinear.__init__``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields

from verify.preflight.flags import Refusal, not_modelled_parts

Name = Callable[[str], str]  # Megatron attribute -> the flag as the user wrote it
MAMBA, ATTENTION, MLP, PIPE, MTP_SEPARATOR = "M", "*", "-", "|", "/"
# hybrid_layer_allocation.py:26 Symbols.VALID_LAYERS.
VALID_LAYERS = frozenset("MG*D+-E")
MODELLED_LAYERS = frozenset((MAMBA, ATTENTION, MLP))
# mamba_mixer.py MambaMixer.__init__ defaults the hybrid spec keeps.
D_CONV, EXPAND = 4, 2
# transformer_config.py:1179-1188 defaults.
DEFAULT_STATE_DIM, DEFAULT_HEAD_DIM, DEFAULT_NUM_GROUPS = 128, 64, 8


@dataclass(frozen=True)
class HybridConfig:
    """The hybrid model's settings as Megatron-LM resolves them: the pattern's main part as
    given (``|`` separators kept) and the ``--mamba-*`` sizes (Megatron's attribute names;
    ``mamba_num_heads`` None: ``2 h / head dim``). Validates its types; Megatron's rules on
    the values are :func:`pattern_refusals`' and :func:`mixer_refusals`'."""

    pattern: str
    mamba_state_dim: int = DEFAULT_STATE_DIM
    mamba_head_dim: int = DEFAULT_HEAD_DIM
    mamba_num_groups: int = DEFAULT_NUM_GROUPS
    mamba_num_heads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise TypeError(f"HybridConfig.pattern must be a str, got {type(self.pattern).__name__}")
        for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads"):
            value = getattr(self, name)
            if value is None and name == "mamba_num_heads":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"HybridConfig.{name} must be an int, got {type(value).__name__}")
        unknown = set(self.pattern) - MODELLED_LAYERS - {PIPE}
        if unknown:
            raise ValueError(f"HybridConfig.pattern holds symbols preflight does not model: "
                             f"{sorted(unknown)} (M, *, - and | only)")

    @property
    def layer_types(self) -> str:
        """One symbol per layer, the separators taken out."""
        return self.pattern.replace(PIPE, "")

    @property
    def num_layers(self) -> int:
        """get_hybrid_total_layer_count (hybrid_layer_allocation.py:141)."""
        return len(self.layer_types)

    @property
    def segments(self) -> tuple[str, ...]:
        """The ``|``-separated pipeline segments (one without separators)."""
        return tuple(self.pattern.split(PIPE))

    @property
    def has_pipes(self) -> bool:
        return len(self.segments) > 1

    def builds(self, symbol: str) -> bool:
        """Whether some layer of the model is of kind ``symbol``."""
        return symbol in self.layer_types

    def d_inner(self, hidden_size: int) -> int:
        """The mixer's inner width: heads x head dim, or ``expand x h`` (mamba_mixer.py:216-249)."""
        if self.mamba_num_heads is not None:
            return self.mamba_num_heads * self.mamba_head_dim
        return EXPAND * hidden_size

    def mamba_heads(self, hidden_size: int) -> int:
        """Mamba heads: --mamba-num-heads, or ``d_inner // head dim`` (mamba_mixer.py:243-249)."""
        if self.mamba_num_heads is not None:
            return self.mamba_num_heads
        return self.d_inner(hidden_size) // self.mamba_head_dim

    def stage_layers(self, pipeline_parallel: int, virtual: int) -> tuple[tuple[str, ...], ...]:
        """With ``|``: each (pipeline rank, virtual stage)'s segment, segment ``vp x PP + pp``
        (select_pipeline_segment, hybrid_layer_allocation.py:452-470)."""
        segments = self.segments
        return tuple(tuple(segments[chunk * pipeline_parallel + stage] for chunk in range(virtual))
                     for stage in range(pipeline_parallel))

    def to_dict(self, hidden_size: int) -> dict:
        """JSON-ready settings, with the layers of each kind and the mixer's heads and inner
        width at ``hidden_size``."""
        types = self.layer_types
        return {f.name: getattr(self, f.name) for f in fields(self)} | {
            "layer_counts": {symbol: types.count(symbol) for symbol in (MAMBA, ATTENTION, MLP)},
            "mamba_heads": self.mamba_heads(hidden_size), "mamba_d_inner": self.d_inner(hidden_size)}


@dataclass(frozen=True)
class HybridReading:
    """What validate_args' hybrid section makes of a launch: the settings (None where the
    pattern cannot be read), the layer count and virtual pipeline size it derives, the
    refusals in validate_args' order, the values they leave undefined, notes."""

    config: HybridConfig | None
    num_layers: int | None
    virtual_pipeline_size: int | None
    refusals: tuple[Refusal, ...]
    undefined: frozenset[str]
    notes: tuple[str, ...]


def read_hybrid(values: Mapping[str, object], pipeline_parallel: int | None,
                name: Name) -> HybridReading:
    """validate_args:717-891 on the parsed flags (``values``, Megatron's attribute names):
    the pattern from --hybrid-layer-pattern or --hybrid-override-pattern, the layers it
    derives (overriding --num-layers), the refusals and the virtual pipeline size."""
    refusals: list[Refusal] = []
    notes: list[str] = []
    undefined: set[str] = set()
    given, legacy = values.get("hybrid_layer_pattern"), values.get("hybrid_override_pattern")
    if legacy is not None and given is not None:
        refusals.append(Refusal(
            f"{name('hybrid_override_pattern')} and {name('hybrid_layer_pattern')} cannot both be "
            "given (validate_args: '--hybrid-override-pattern is deprecated; use "
            "--hybrid-layer-pattern instead')", "validate_args", 722))
    text = str(given if given is not None else legacy)
    main = text.split(MTP_SEPARATOR)[0]
    bad = sorted(set(main) - VALID_LAYERS - {PIPE})
    if bad:  # get_hybrid_total_layer_count -> _validate_pattern (hybrid_layer_allocation.py:306)
        refusals.append(Refusal(
            f"{name('hybrid_layer_pattern' if given is not None else 'hybrid_override_pattern')} "
            f"{text!r}: {', '.join(repr(b) for b in bad)} not a valid layer symbol (M Mamba, * "
            "attention, - MLP, | pipeline stage; hybrid_layer_allocation.py _validate_pattern)",
            "validate_args", 764))
        undefined.update(("num_layers", "virtual_pipeline_model_parallel_size"))
        return HybridReading(None, None, None, tuple(refusals), frozenset(undefined), ())
    config = HybridConfig(
        pattern=main,
        mamba_state_dim=values.get("mamba_state_dim", DEFAULT_STATE_DIM),
        mamba_head_dim=values.get("mamba_head_dim", DEFAULT_HEAD_DIM),
        mamba_num_groups=values.get("mamba_num_groups", DEFAULT_NUM_GROUPS),
        mamba_num_heads=values.get("mamba_num_heads"))
    num_layers = values.get("num_layers")
    if num_layers is not None and num_layers != config.num_layers:
        notes.append(f"{name('num_layers')} {num_layers} ignored: the hybrid pattern gives "
                     f"{config.num_layers} layers (validate_args, as Megatron warns)")
    if config.has_pipes:
        for dest, line in (("decoder_first_pipeline_num_layers", 778),
                           ("decoder_last_pipeline_num_layers", 783)):
            if values.get(dest) is not None:
                refusals.append(Refusal(
                    f"{name(dest)} cannot be given with '|' in the hybrid pattern, which lays "
                    "out the pipeline stages (validate_args)", "validate_args", line))
    for dest, line in (("num_layers_per_virtual_pipeline_stage", 788),
                       ("num_virtual_stages_per_pipeline_rank", 793),
                       ("account_for_embedding_in_pipeline_split", 803),
                       ("account_for_loss_in_pipeline_split", 808)):
        if values.get(dest) not in (None, False):
            refusals.append(Refusal(
                f"{name(dest)} cannot be given with a hybrid pattern: its '|' segments lay out "
                "the pipeline (and virtual) stages (validate_args)", "validate_args", line))
            if dest.startswith("num_"):
                undefined.add("virtual_pipeline_model_parallel_size")
    vpp = _virtual_size(config, pipeline_parallel, name, refusals, undefined)
    return HybridReading(config, config.num_layers, vpp, tuple(refusals), frozenset(undefined),
                         tuple(notes))


def _virtual_size(config: HybridConfig, pp: int | None, name: Name, refusals: list[Refusal],
                  undefined: set[str]) -> int | None:
    """validate_args:815-836: one segment at PP > 1 splits at model build (no VPP); else the
    segments must divide over PP, and more segments than PP are virtual stages."""
    if pp is None or "virtual_pipeline_model_parallel_size" in undefined:
        undefined.add("virtual_pipeline_model_parallel_size")
        return None
    segments = len(config.segments)
    if segments == 1 and pp > 1:
        return 1
    if segments % pp:
        refusals.append(Refusal(
            f"the hybrid pattern's {segments} '|' segments must divide evenly over "
            f"{name('pipeline_model_parallel_size')} ({pp}) (validate_args)", "validate_args", 823))
        undefined.add("virtual_pipeline_model_parallel_size")
        return None
    return segments // pp if segments > pp else 1


def mixer_refusals(config: HybridConfig, hidden_size: int, tensor_parallel: int, fp8: bool,
                   name: Name) -> Iterator[Refusal]:
    """MambaMixer.__init__'s asserts (megatron/core/ssm/mamba_mixer.py, by line), met at
    model build where the pattern has a Mamba layer."""
    if not config.builds(MAMBA):
        return

    def refuse(text: str, line: int) -> Refusal:
        return Refusal(f"{text} (megatron/core/ssm/mamba_mixer.py:{line} MambaMixer)", "model build")

    sizes = (("mamba_state_dim", 239), ("mamba_head_dim", 240), ("mamba_num_groups", 241))
    for dest, line in sizes:
        if getattr(config, dest) <= 0:
            yield refuse(f"{name(dest)} must be > 0, got {getattr(config, dest)}", line)
            return
    heads, groups, head_dim = config.mamba_num_heads, config.mamba_num_groups, config.mamba_head_dim
    if heads is not None and heads <= 0:
        yield refuse(f"{name('mamba_num_heads')} must be > 0, got {heads}", 245)
        return
    d_inner = config.d_inner(hidden_size)
    if heads is None and d_inner % head_dim:
        yield refuse(f"the Mamba inner width 2 x {name('hidden_size')} = {d_inner} must be "
                     f"divisible by {name('mamba_head_dim')} ({head_dim}), or give "
                     f"{name('mamba_num_heads')}", 248)
        return
    heads = config.mamba_heads(hidden_size)
    width = 2 * d_inner + 2 * groups * config.mamba_state_dim + heads
    if fp8 and width % 16:
        yield refuse(f"under FP8 the Mamba in_proj's output 2 x {d_inner} + 2 x {groups} x "
                     f"{config.mamba_state_dim} + {heads} = {width} must be a multiple of 16", 252)
    tp = name("tensor_model_parallel_size")
    if heads % tensor_parallel:
        yield refuse(f"the Mamba heads ({heads}) must be divisible by {tp} ({tensor_parallel})", 260)
    if groups % tensor_parallel:
        yield refuse(f"{name('mamba_num_groups')} ({groups}) must be divisible by {tp} "
                     f"({tensor_parallel})", 268)
    if heads % groups:
        yield refuse(f"the Mamba heads ({heads}) must be divisible by {name('mamba_num_groups')} "
                     f"({groups})", 272)


Shape = tuple[str, tuple[int, ...]]


def layer_shapes(config: HybridConfig, symbol: str, hidden_size: int, tensor_parallel: int,
                 attention: tuple[int, int], ffn: tuple[int, int], layer_norm: bool,
                 bias: bool, qkv_bias: bool) -> list[Shape]:
    """One layer's (name under the layer, shape on one TP rank), in ``named_parameters``
    order (module doc). ``attention``: (q, kv) widths; ``ffn``: (fc1 outputs, fc2 inputs)."""
    h, tp = hidden_size, tensor_parallel

    def fused_norm(module: str) -> list[Shape]:
        return [(f"{module}.layer_norm_weight", (h,))] + (
            [(f"{module}.layer_norm_bias", (h,))] if layer_norm else [])

    def linear(module: str, rows: int, cols: int, bias_size: int, with_bias: bool) -> list[Shape]:
        return [(f"{module}.weight", (rows, cols))] + (
            [(f"{module}.bias", (bias_size,))] if with_bias else [])

    if symbol == MAMBA:
        d_inner, heads = config.d_inner(h), config.mamba_heads(h)
        groups, state = config.mamba_num_groups, config.mamba_state_dim
        conv = d_inner // tp + 2 * (groups // tp) * state
        local_heads = heads // tp
        return [("mixer.conv1d_weight", (conv, 1, D_CONV)), ("mixer.conv1d_bias", (conv,)),
                ("mixer.dt_bias", (local_heads,)), ("mixer.A_log", (local_heads,)),
                ("mixer.D", (local_heads,)), *fused_norm("mixer.in_proj"),
                ("mixer.in_proj.weight", ((2 * d_inner + 2 * groups * state + heads) // tp, h)),
                ("mixer.norm.weight", (d_inner // tp,)),
                ("mixer.out_proj.weight", (h, d_inner // tp))]
    if symbol == ATTENTION:
        q, kv = attention
        return [*linear("self_attention.linear_proj", h, q // tp, h, bias),
                *fused_norm("self_attention.linear_qkv"),
                *linear("self_attention.linear_qkv", (q + 2 * kv) // tp, h, (q + 2 * kv) // tp,
                        bias or qkv_bias)]
    if symbol == MLP:
        fc1, fc2 = ffn
        return [*fused_norm("mlp.linear_fc1"),
                *linear("mlp.linear_fc1", fc1 // tp, h, fc1 // tp, bias),
                *linear("mlp.linear_fc2", h, fc2 // tp, h, bias)]
    raise ValueError(f"layer_shapes: symbol must be one of M, *, -, got {symbol!r}")


__all__ = ["HybridConfig", "HybridReading", "layer_shapes", "mixer_refusals",
           "not_modelled_parts", "read_hybrid"]

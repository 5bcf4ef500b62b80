"""Hybrid Mamba launches (--hybrid-layer-pattern): read, checked and laid out as Megatron-LM
core_r0.19.0 does.

Expected values are derived by hand from megatron-core 0.19.2's source, cited per test:
megatron/training/arguments.py validate_args:717-891 (the pattern derives num_layers and,
from its '|' segments, the virtual pipeline size; the refusals beside it),
core/models/hybrid/hybrid_layer_allocation.py (Symbols, _validate_pattern,
select_pipeline_segment: segment vp x PP + pp), hybrid_layer_specs.py hybrid_stack_spec and
hybrid_block.py (which modules each symbol builds, ``final_norm``), core/ssm/mamba_mixer.py
(the mixer's params and asserts).
"""

from __future__ import annotations

import pytest

from tests.verify.preflight_launch import parsed_launch, preflight_config
from verify.preflight.config import ConfigError
from verify.preflight.flags import FlagError
from verify.preflight.hybrid import HybridConfig
from verify.preflight.model import chunk_parameters
from verify.preflight.paper import chunk_layouts, wire_rows
from verify.preflight.twin import TwinOptions, plan_twin

# Megatron-LM core_r0.19.0 examples/mamba/train.sh, MODEL_SCALE=800M (TP 1), the flags it
# hands pretrain_hybrid.py (the tokenizer's vocabulary given as --padded-vocab-size).
PATTERN_800M = "M-M-M--M-*M-M-M-M--*M-M-M-M-*M--M-M-M-*M-M--M-M-"
EXAMPLE_800M = [
    "--tensor-model-parallel-size", "1", "--sequence-parallel", "--pipeline-model-parallel-size",
    "1", "--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce",
    "--untie-embeddings-and-output-weights", "--init-method-std", "0.02",
    "--position-embedding-type", "none", "--hybrid-layer-pattern", PATTERN_800M,
    "--hidden-size", "1024", "--num-attention-heads", "16", "--group-query-attention",
    "--num-query-groups", "8", "--seq-length", "4096", "--max-position-embeddings", "4096",
    "--micro-batch-size", "4", "--global-batch-size", "32", "--lr", "2.5e-4",
    "--disable-bias-linear", "--normalization", "RMSNorm", "--bf16", "--use-mcore-models",
    "--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec",
    "--padded-vocab-size", "50304",
]

# A small hybrid launch: world 4, TP 2 -> DP 2; hidden 64, 4 heads; the mixer with head dim
# 32 (d_inner = 2 x 64 = 128, so 4 Mamba heads), 2 groups, state 16.
SMALL = ["--world-size", "4", "--tensor-model-parallel-size", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
         "--padded-vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--bf16", "--disable-bias-linear", "--normalization", "RMSNorm",
         "--mamba-head-dim", "32", "--mamba-num-groups", "2", "--mamba-state-dim", "16"]


def _refusals(*argv: str) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        preflight_config(list(argv))
    return [(r.message, r.stage) for r in err.value.refusals]


def test_the_800m_example_is_accepted_with_its_layers_and_parameters():
    config = preflight_config(["--world-size", "8", *EXAMPLE_800M])
    # validate_args:764: num_layers = len(pattern) = 48; DP = 8 / (1 x 1 x 1); M = 32 / (4 x 8).
    assert config.num_layers == 48 and config.data_parallel_size == 8
    assert config.num_microbatches == 1 and config.virtual_pipeline_model_parallel_size == 1
    (chunk,) = chunk_layouts(config)
    # Per Mamba layer (h 1024; d_inner = 2 h = 2048, heads 2048 / 64 = 32, groups 8, state
    # 128; mamba_mixer.py:279-430): conv1d [2048 + 2 x 8 x 128 = 4096, 1, 4] = 16,384 and bias
    # 4,096; dt_bias, A_log, D 32 each; in_proj's fused RMSNorm 1,024 and weight
    # [2 x 2048 + 2 x 8 x 128 + 32 = 6176, 1024] = 6,324,224; the gated norm 2,048; out_proj
    # [1024, 2048] = 2,097,152: 8,445,024.
    mamba = 16_384 + 4_096 + 3 * 32 + 1_024 + 6_324_224 + 2_048 + 2_097_152
    # Attention (q = 16 x 64 = 1024, kv = 8 x 64 = 512): linear_proj [1024, 1024], the fused
    # norm 1,024, linear_qkv [1024 + 2 x 512, 1024]: 3,146,752. MLP (ffn 4 h = 4096): the fused
    # norm 1,024, fc1 [4096, 1024], fc2 [1024, 4096]: 8,389,632.
    attention = 1_048_576 + 1_024 + 2_097_152
    mlp = 1_024 + 2 * 4_194_304
    # Untied: the word embedding and the output layer [50304, 1024] each, the final norm 1,024.
    embeddings = 2 * 50_304 * 1_024 + 1_024
    assert PATTERN_800M.count("M") == 20 and PATTERN_800M.count("*") == 4
    assert PATTERN_800M.count("-") == 24
    assert chunk.param_elements == 20 * mamba + 4 * attention + 24 * mlp + embeddings
    assert chunk.param_elements == 485_862_272
    # Params: 9 per Mamba layer, 3 per attention layer, 3 per MLP layer, the embedding, the
    # final norm and the output layer.
    assert len(chunk.params) == 20 * 9 + 4 * 3 + 24 * 3 + 3
    hybrid = config.to_dict()["hybrid"]
    assert hybrid["pattern"] == PATTERN_800M and hybrid["mamba_heads"] == 32
    assert hybrid["layer_counts"] == {"M": 20, "*": 4, "-": 24}


def test_a_mamba_layers_params_are_in_megatrons_named_parameters_order_and_sharded_over_tp():
    config = preflight_config([*SMALL, "--hybrid-layer-pattern", "M*-"])
    params = chunk_parameters(config, 0, 0)
    layer0 = [(p.name.removeprefix("decoder.layers.0."), p.shape) for p in params
              if p.name.startswith("decoder.layers.0.")]
    # TP 2: d_inner 128 / 2 = 64, groups 2 / 2 = 1, heads 4 / 2 = 2; conv 64 + 2 x 1 x 16 = 96;
    # in_proj rows (2 x 128 + 2 x 2 x 16 + 4) / 2 = 162. The mixer's own params first
    # (mamba_mixer.py:321-414), then its children in registration order: in_proj (:279, TE's
    # LayerNormLinear: the norm's weight before its own), norm (:417), out_proj (:430).
    assert layer0 == [
        ("mixer.conv1d_weight", (96, 1, 4)), ("mixer.conv1d_bias", (96,)),
        ("mixer.dt_bias", (2,)), ("mixer.A_log", (2,)), ("mixer.D", (2,)),
        ("mixer.in_proj.layer_norm_weight", (64,)), ("mixer.in_proj.weight", (162, 64)),
        ("mixer.norm.weight", (64,)), ("mixer.out_proj.weight", (64, 64)),
    ]
    names = [p.name for p in params]
    # '*' (attention.py: linear_proj before linear_qkv) and '-' (mlp.py: fc1 then fc2), norms
    # fused; the stack's final norm is hybrid_block.py's final_norm.
    assert [n for n in names if n.startswith("decoder.layers.1.")] == [
        "decoder.layers.1.self_attention.linear_proj.weight",
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.1.self_attention.linear_qkv.weight"]
    assert [n for n in names if n.startswith("decoder.layers.2.")] == [
        "decoder.layers.2.mlp.linear_fc1.layer_norm_weight", "decoder.layers.2.mlp.linear_fc1.weight",
        "decoder.layers.2.mlp.linear_fc2.weight"]
    assert "decoder.final_norm.weight" in names and "decoder.final_layernorm.weight" not in names


def test_layernorm_adds_a_bias_to_each_fused_norm():
    argv = [t for t in SMALL if t not in ("--normalization", "RMSNorm")]
    config = preflight_config([*argv, "--hybrid-layer-pattern", "M"])
    names = [p.name for p in chunk_parameters(config, 0, 0)]
    # TE LayerNormLinear registers layer_norm_bias after layer_norm_weight under LayerNorm.
    assert [n for n in names if ".in_proj." in n] == ["decoder.layers.0.mixer.in_proj.layer_norm_weight",
                          "decoder.layers.0.mixer.in_proj.layer_norm_bias",
                          "decoder.layers.0.mixer.in_proj.weight"]


def test_pipe_segments_lay_out_the_pipeline_and_virtual_stages():
    # 4 segments over PP 2: VPP 2 (validate_args:829-834); segment vp x 2 + pp
    # (select_pipeline_segment): stage 0 holds segments 0 and 2, stage 1 segments 1 and 3.
    config = preflight_config([*SMALL, "--world-size", "8", "--pipeline-model-parallel-size", "2",
                               "--global-batch-size", "4", "--hybrid-layer-pattern",
                               "M*M-|MM-|M*|--"])
    assert config.num_layers == 11 and config.virtual_pipeline_model_parallel_size == 2
    split = config.layer_split
    assert split.layers == ((4, 2), (3, 2))
    assert split.offsets == ((0, 7), (4, 9))  # the layers of the segments before each
    assert [p.name for p in chunk_parameters(config, 1, 1) if p.name.endswith("linear_fc2.weight")] \
        == ["decoder.layers.9.mlp.linear_fc2.weight", "decoder.layers.10.mlp.linear_fc2.weight"]


def test_as_many_segments_as_pipeline_ranks_is_no_interleaving():
    config = preflight_config([*SMALL, "--world-size", "8", "--pipeline-model-parallel-size", "2",
                               "--hybrid-layer-pattern", "M-M|*M-M-"])
    assert config.virtual_pipeline_model_parallel_size == 1
    assert config.layer_split.layers == ((3,), (5,))


def test_a_pattern_without_pipes_splits_evenly_or_by_the_first_and_last_stage_flags():
    base = [*SMALL, "--world-size", "8", "--pipeline-model-parallel-size", "2"]
    assert preflight_config([*base, "--hybrid-layer-pattern", "M*M-M-"]).layer_split.layers \
        == ((3,), (3,))
    uneven = preflight_config([*base, "--hybrid-layer-pattern", "M*M-M-",
                               "--decoder-first-pipeline-num-layers", "2"])
    assert uneven.layer_split.layers == ((2,), (4,)) and uneven.layer_split.offsets == ((0,), (2,))
    # select_pipeline_segment: 5 layers over PP 2 without pipes is refused at model build.
    found = _refusals(*base, "--hybrid-layer-pattern", "M*M-M")
    assert [s for _, s in found] == ["model build"]


def test_the_pattern_overrides_num_layers_with_a_note():
    config = preflight_config([*SMALL, "--num-layers", "7", "--hybrid-layer-pattern", "M-"])
    assert config.num_layers == 2
    assert any("--num-layers 7 ignored" in note for note in config.notes)


@pytest.mark.parametrize("extra, message, stage", [
    (["--hybrid-override-pattern", "M-"], "--hybrid-override-pattern and --hybrid-layer-pattern "
     "cannot both be given", "validate_args"),
    (["--decoder-first-pipeline-num-layers", "1", "--pipeline-model-parallel-size", "2",
      "--world-size", "8"], "--decoder-first-pipeline-num-layers cannot be given with '|'",
     "validate_args"),
    (["--num-virtual-stages-per-pipeline-rank", "2"], "--num-virtual-stages-per-pipeline-rank "
     "cannot be given with a hybrid pattern", "validate_args"),
    (["--account-for-loss-in-pipeline-split"], "--account-for-loss-in-pipeline-split cannot be "
     "given with a hybrid pattern", "validate_args"),
    (["--pipeline-model-parallel-size", "3", "--world-size", "12"], "the hybrid pattern's 2 '|' "
     "segments must divide evenly over --pipeline-model-parallel-size (3)", "validate_args"),
])
def test_each_validate_args_hybrid_rule_is_refused_naming_its_flags(extra, message, stage):
    found = _refusals(*SMALL, "--hybrid-layer-pattern", "M-|M*", *extra)
    assert any(m.startswith(message) and s == stage for m, s in found), found


def test_an_invalid_symbol_is_refused_and_the_layer_count_left_undefined():
    # hybrid_layer_allocation.py _validate_pattern via get_hybrid_total_layer_count
    # (validate_args:764); nothing that reads the layers is checked after it.
    found = _refusals(*SMALL, "--hybrid-layer-pattern", "M-X")
    assert len(found) == 1 and found[0][1] == "validate_args"
    assert "'X' not a valid layer symbol" in found[0][0]


def test_pipes_at_pp_1_make_an_interleaved_schedule_that_needs_pp_above_1():
    # validate_args:829-834: 2 segments > PP 1 -> VPP 2; then :967 refuses VPP at PP 1.
    found = _refusals(*SMALL, "--hybrid-layer-pattern", "M-|M*")
    assert [s for _, s in found] == ["validate_args"]
    assert "requires --pipeline-model-parallel-size >= 2" in found[0][0]


@pytest.mark.parametrize("extra, messages", [
    # d_inner 128, head dim 64: 2 heads; 2 groups; TP 4: heads % TP (:260), groups % TP (:268).
    (["--tensor-model-parallel-size", "4", "--world-size", "4", "--global-batch-size", "1",
      "--mamba-head-dim", "64"],
     ["the Mamba heads (2) must be divisible by --tensor-model-parallel-size (4)",
      "--mamba-num-groups (2) must be divisible by --tensor-model-parallel-size (4)"]),
    # heads 4 % groups 3 (:272).
    (["--mamba-num-groups", "3", "--tensor-model-parallel-size", "1", "--world-size", "2"],
     ["the Mamba heads (4) must be divisible by --mamba-num-groups (3)"]),
    # d_inner 128 % head dim 48 (:248).
    (["--mamba-head-dim", "48"], ["the Mamba inner width 2 x --hidden-size = 128 must be "
                                  "divisible by --mamba-head-dim (48)"]),
    (["--mamba-state-dim", "0"], ["--mamba-state-dim must be > 0"]),
])
def test_each_mamba_mixer_assert_is_refused_at_model_build(extra, messages):
    found = _refusals(*SMALL, "--hybrid-layer-pattern", "M*", *extra)
    mixer = [m for m, s in found if s == "model build" and "mamba_mixer.py" in m]
    assert len(mixer) == len(messages), found
    for text, expected in zip(mixer, messages):
        assert text.startswith(expected), (text, expected)


def test_mamba_heads_given_set_the_inner_width():
    # mamba_mixer.py:243-246: d_inner = heads x head dim = 6 x 32 = 192; 6 % TP 2, 6 % 2 groups.
    config = preflight_config([*SMALL, "--mamba-num-heads", "6", "--hybrid-layer-pattern", "M"])
    out_proj = [p for p in chunk_parameters(config, 0, 0) if p.name.endswith("out_proj.weight")]
    assert out_proj[0].shape == (64, 96)


def test_attention_and_mlp_build_rules_apply_only_where_the_pattern_has_such_layers():
    # 129 FFN over TP 2 (RowParallelLinear divide) is refused only with an MLP layer '-'.
    ffn = [*SMALL, "--ffn-hidden-size", "129"]
    preflight_config([*ffn, "--hybrid-layer-pattern", "M*M*"])
    assert [s for _, s in _refusals(*ffn, "--hybrid-layer-pattern", "M*M-")] == ["model build"]
    # The Mamba rules only with an 'M': 2 groups over TP 4 is no refusal for "*-".
    tp4 = [*SMALL, "--tensor-model-parallel-size", "4", "--global-batch-size", "1"]
    preflight_config([*tp4, "--hybrid-layer-pattern", "*-"])


@pytest.mark.parametrize("pattern", ["M-E-", "M*M*/MM/MM", "MGM-", "M+M-"])
def test_symbols_and_mtp_depths_preflight_does_not_lay_out_stay_refused_as_not_modelled(pattern):
    with pytest.raises(FlagError, match="not modelled"):
        preflight_config([*SMALL, "--hybrid-layer-pattern", pattern])


def test_a_pattern_with_experts_is_not_modelled():
    with pytest.raises(FlagError, match="not modelled"):
        preflight_config([*SMALL, "--hybrid-layer-pattern", "M-", "--num-experts", "2"])


def test_qk_layernorm_in_a_hybrid_pattern_is_not_modelled():
    """hybrid_stack_spec's attention layer names no q/k layernorm module (hybrid_layer_specs.py
    attention_layer, where the GPT spec names one): what --qk-layernorm builds there is not
    laid out, so it is refused with that reason; a GPT launch with it is modelled."""
    with pytest.raises(FlagError, match="--qk-layernorm.*not modelled.*hybrid_stack_spec"):
        preflight_config([*SMALL, "--hybrid-layer-pattern", "M*M-", "--qk-layernorm"])
    assert preflight_config([*SMALL, "--num-layers", "2", "--qk-layernorm"]).qk_norm_params


def test_mamba_sizes_without_a_pattern_are_listed_as_ignored():
    parsed = parsed_launch(["--num-layers", "2", *SMALL])
    assert "--mamba-head-dim 32" in parsed.unknown
    assert "mamba_head_dim" not in parsed.values


def test_tensor_parallel_bytes_count_one_block_per_hybrid_layer():
    config = preflight_config([*SMALL, "--hybrid-layer-pattern", "M*-"])
    (row,) = wire_rows(config, chunk_layouts(config))
    # Each hybrid layer is one TP block (in_proj/out_proj, linear_qkv/linear_proj, fc1/fc2):
    # 3 layers x M 1 x 4 x (2-1)/2 x mbs 1 x seq 16 x h 64 x 2 B (bf16) = 12,288.
    assert row["tensor_parallel_bytes"] == 3 * 1 * 4 * 0.5 * 1 * 16 * 64 * 2 == 12_288


def test_the_twin_lists_the_mamba_mixers_as_not_twinned():
    config = preflight_config([*SMALL, "--hybrid-layer-pattern", "M*-"])
    plan = plan_twin(config, TwinOptions())
    assert any(item.startswith("Mamba mixers of the hybrid pattern") for item in plan.not_twinned)
    (row,) = [r for r in plan.mapping if r[0] == "hybrid layers"]
    assert row[1] == "'M*-': 1 Mamba, 1 attention, 1 MLP layers"
    # Without a Mamba layer nothing is left untwinned for it.
    plain = plan_twin(preflight_config([*SMALL, "--hybrid-layer-pattern", "*-"]), TwinOptions())
    assert not any(item.startswith("Mamba mixers") for item in plain.not_twinned)


def test_hybrid_config_refuses_what_it_cannot_lay_out_and_wrong_types():
    with pytest.raises(ValueError, match="HybridConfig.pattern holds symbols"):
        HybridConfig(pattern="M-E")
    with pytest.raises(TypeError, match="HybridConfig.mamba_state_dim must be an int"):
        HybridConfig(pattern="M-", mamba_state_dim="128")
    with pytest.raises(TypeError, match="HybridConfig.mamba_num_heads must be an int"):
        HybridConfig(pattern="M-", mamba_num_heads=True)

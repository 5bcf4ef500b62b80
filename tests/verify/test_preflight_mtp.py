"""Query/key layernorm and multi-token prediction: read, checked and laid out as Megatron-LM
core_r0.19.0 does.

Expected values are derived by hand from megatron-core 0.19.2's source, cited per test:
attention.py:350 (one head's width: query projection / heads = kv_channels) and :1697-1740
(q_layernorm, k_layernorm after linear_qkv), finalize_model_grads.py:132-147 (the word
embeddings all-reduced between the first and last stage with tied embeddings *or* MTP) and
:451-454 (the q/k layernorm grads summed over TP), gpt_model.py:167 (the MTP stage builds the
embedding), :236-282 (decoder, mtp, then the output layer, allocated unless pre_process and
tied), language_module.py:264-284 (the shared_embedding flags), transformer_block.py:387-414
(with MTP the final layernorm goes with the last decoder layer), multi_token_prediction.py
:983-1053 (enorm, hnorm, eh_proj 2h -> h without bias, the transformer layer, final_layernorm)
and :1766-1776 (one repeated layer), arguments.py:855-860 (rope or none).
"""

from __future__ import annotations

import pytest

from tests.verify.preflight_launch import preflight_config
from verify.preflight.cli import build_report
from verify.preflight.config import ConfigError
from verify.preflight.flags import FlagError, parse_megatron_flags
from verify.preflight.model import chunk_parameters
from verify.preflight.paper import chunk_layouts, expert_chunk_layouts, wire_rows
from verify.preflight.render import report_tables
from verify.preflight.timing import CostInputs
from verify.preflight.twin import TwinOptions, plan_twin

# World 4 = TP 2 x PP 2 (DP 1); 4 layers, 2 per stage; h 64, 4 heads (kv channels 16), FFN
# 4h = 256, vocabulary 128 (64 rows per TP rank); LayerNorm and biases (Megatron's defaults).
BASE = ["--world-size", "4", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
        "--padded-vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--position-embedding-type", "rope"]
UNTIED = [*BASE, "--untie-embeddings-and-output-weights"]
MTP = [*UNTIED, "--mtp-num-layers", "1"]  # untied: MTP alone makes the embedding shared
# One decoder layer on one TP rank of BASE: input_layernorm 64 + 64, linear_proj [64, 32] +
# [64], linear_qkv [(64 + 2 x 64) / 2 = 96, 64] + [96], pre_mlp_layernorm 64 + 64,
# linear_fc1 [128, 64] + [128], linear_fc2 [64, 128] + [64].
LAYER = 128 + 64 * 32 + 64 + 96 * 64 + 96 + 128 + 128 * 64 + 128 + 64 * 128 + 64
EMBEDDING = 64 * 64  # [vocab / TP, h]


def _params(argv: list[str], stage: int) -> dict[str, tuple]:
    config = preflight_config(argv)
    return {p.name: (p.shape, p.shared_embedding) for p in chunk_parameters(config, stage, 0)}


def test_qk_layernorm_adds_weight_and_bias_over_one_head_after_linear_qkv():
    # --kv-channels 8 (not h / heads = 16): the norms are one head wide (attention.py:350).
    config = preflight_config([*BASE, "--qk-layernorm", "--kv-channels", "8"])
    names = [p.name for p in chunk_parameters(config, 0, 0) if p.name.startswith("decoder.layers.0.")]
    at = names.index("decoder.layers.0.self_attention.linear_qkv.bias")
    assert names[at + 1:at + 6] == [
        "decoder.layers.0.self_attention.q_layernorm.weight",
        "decoder.layers.0.self_attention.q_layernorm.bias",
        "decoder.layers.0.self_attention.k_layernorm.weight",
        "decoder.layers.0.self_attention.k_layernorm.bias",
        "decoder.layers.0.pre_mlp_layernorm.weight"]
    shapes = {p.name: p.shape for p in chunk_parameters(config, 0, 0)}
    assert shapes["decoder.layers.1.self_attention.k_layernorm.bias"] == (8,)


def test_qk_rmsnorm_has_weights_only_and_qk_l2_norm_no_params():
    rms = _params([*BASE, "--qk-layernorm", "--normalization", "RMSNorm"], 0)
    assert [n for n in rms if "_layernorm." in n and "layers.0." in n and "self_attention" in n] == [
        "decoder.layers.0.self_attention.q_layernorm.weight",
        "decoder.layers.0.self_attention.k_layernorm.weight"]
    # --qk-l2-norm: L2Norm, no parameters (gpt_layer_specs.py:328, torch_norm.py L2Norm).
    l2 = _params([*BASE, "--qk-layernorm", "--qk-l2-norm"], 0)
    assert not [n for n in l2 if "q_layernorm" in n or "k_layernorm" in n]
    assert sum(s[0][0] * (s[0][1] if len(s[0]) > 1 else 1) for s in l2.values()) == \
        EMBEDDING + 2 * LAYER


def test_qk_layernorm_grads_are_all_reduced_over_tp():
    # Stage 0: 2 layers x (q, k) x (weight, bias) x 16 = 128 fp32 grads; a ring all-reduce over
    # TP 2 sends 2 (2-1)/2 x 128 x 4 B = 512 B. At TP 1 nothing.
    config = preflight_config([*BASE, "--qk-layernorm"])
    rows = wire_rows(config, chunk_layouts(config))
    assert [r["qk_layernorm_tp_all_reduce_bytes"] for r in rows] == [512.0, 512.0]
    tp1 = preflight_config([*BASE, "--qk-layernorm", "--world-size", "2",
                            "--tensor-model-parallel-size", "1"])
    assert {r["qk_layernorm_tp_all_reduce_bytes"] for r in wire_rows(tp1, chunk_layouts(tp1))} == {0.0}


def test_mtp_untied_puts_an_embedding_copy_and_the_mtp_block_on_the_last_stage():
    first, last = _params(MTP, 0), _params(MTP, 1)
    # language_module.py:264-270: the first stage's embedding is shared even untied.
    assert first["embedding.word_embeddings.weight"] == ((64, 64), True)
    assert "decoder.final_layernorm.weight" not in first
    names = list(last)
    assert names[0] == "embedding.word_embeddings.weight" and last[names[0]] == ((64, 64), True)
    assert names[-1] == "output_layer.weight" and last[names[-1]] == ((64, 64), False)
    mtp = [n for n in names if n.startswith("mtp.")]
    assert mtp[:5] == ["mtp.layers.0.enorm.weight", "mtp.layers.0.enorm.bias",
                       "mtp.layers.0.hnorm.weight", "mtp.layers.0.hnorm.bias",
                       "mtp.layers.0.eh_proj.weight"]
    assert last["mtp.layers.0.eh_proj.weight"] == ((32, 128), False)  # [h / TP, 2h], no bias
    assert mtp[-2:] == ["mtp.layers.0.final_layernorm.weight", "mtp.layers.0.final_layernorm.bias"]
    assert names.index("decoder.final_layernorm.bias") < names.index(mtp[0])
    config = preflight_config(MTP)
    (_, stage1) = chunk_layouts(config)
    # embedding + 2 layers + final LN (2 x 64) + MTP (enorm, hnorm 4 x 64; eh_proj 32 x 128;
    # a layer; final LN 2 x 64) + output layer.
    assert stage1.param_elements == (EMBEDDING + 2 * LAYER + 128
                                     + 256 + 32 * 128 + LAYER + 128 + EMBEDDING)


def test_mtp_all_reduces_the_word_embeddings_between_first_and_last_stage_even_untied():
    untied = preflight_config(UNTIED)
    assert not untied.word_embedding_all_reduce
    assert [r["embedding_all_reduce_bytes"] for r in wire_rows(untied, chunk_layouts(untied))] == [0, 0]
    config = preflight_config(MTP)
    assert config.word_embedding_all_reduce
    # [64, 64] fp32 grads over the embedding group of 2: 2 (2-1)/2 x 4096 x 4 B.
    assert [r["embedding_all_reduce_bytes"] for r in wire_rows(config, chunk_layouts(config))] == \
        [16384, 16384]


def test_mtp_tied_still_allocates_the_last_stages_output_layer_and_shares_the_embedding():
    # gpt_model.py:281: skip_weight_param_allocation only where pre_process, so tied or not
    # the last stage allocates the output layer; language_module.py:346-354: the MTP stage's
    # shared weight is its embedding, not the output layer. Without MTP the tied last stage's
    # output layer is the shared copy.
    tied = _params([*BASE, "--mtp-num-layers", "1"], 1)
    assert tied == _params(MTP, 1)
    assert tied["embedding.word_embeddings.weight"][1] is True
    assert tied["output_layer.weight"] == ((64, 64), False)
    assert _params(BASE, 1)["output_layer.weight"] == ((64, 64), True)
    assert "embedding.word_embeddings.weight" not in _params(BASE, 1)


def test_mtp_at_pp1_shares_one_embedding_without_flags_and_without_an_output_layer():
    argv = [*BASE, "--mtp-num-layers", "1", "--world-size", "2",
            "--pipeline-model-parallel-size", "1"]
    params = _params(argv, 0)
    assert params["embedding.word_embeddings.weight"] == ((64, 64), False)
    assert "output_layer.weight" not in params  # tied, pre_process (gpt_model.py:281)
    names = list(params)
    assert names.index("decoder.final_layernorm.bias") + 1 == names.index("mtp.layers.0.enorm.weight")
    assert not preflight_config(argv).word_embedding_all_reduce


def test_repeated_mtp_layer_is_built_once_and_run_n_times():
    config = preflight_config([*BASE, "--mtp-num-layers", "3", "--mtp-use-repeated-layer"])
    names = [p.name for p in chunk_parameters(config, 1, 0) if p.name.startswith("mtp.")]
    assert {n.split(".")[2] for n in names} == {"0"}
    three = preflight_config([*BASE, "--mtp-num-layers", "3"])
    assert {p.name.split(".")[2] for p in chunk_parameters(three, 1, 0)
            if p.name.startswith("mtp.")} == {"0", "1", "2"}
    assert [r["mtp_layer_runs"] for r in wire_rows(config, chunk_layouts(config))] == [0, 3]


def test_mtp_shared_embedding_gets_its_own_bucket_under_the_distributed_optimizer():
    # param_and_grad_buffer.py _does_param_require_new_bucket: a shared_embedding param opens a
    # bucket of its own with the distributed optimizer: 2 buckets on each stage (PP > 0: one
    # by the size rule, + 1).
    plain = preflight_config([*BASE, "--untie-embeddings-and-output-weights",
                              "--use-distributed-optimizer"])
    assert [c.layout.num_buckets for c in chunk_layouts(plain)] == [1, 1]
    config = preflight_config([*MTP, "--untie-embeddings-and-output-weights",
                               "--use-distributed-optimizer"])
    assert [c.layout.num_buckets for c in chunk_layouts(config)] == [2, 2]


@pytest.mark.parametrize("argv, message, stage", [
    ([*BASE[:-2], "--mtp-num-layers", "2"],
     "--mtp-num-layers (2) needs --position-embedding-type rope or none, got learned_absolute",
     "validate_args"),
    ([*BASE, "--mtp-num-layers", "1", "--hidden-size", "65", "--num-attention-heads", "2",
      "--kv-channels", "32", "--ffn-hidden-size", "128"],
     "--mtp-num-layers: the MTP projection eh_proj's output --hidden-size (65) must be divisible "
     "by --tensor-model-parallel-size (2)", "model build"),
])
def test_each_mtp_rule_is_refused_naming_its_flags(argv, message, stage):
    with pytest.raises(ConfigError) as caught:
        preflight_config(argv)
    found = [(r.message, r.stage) for r in caught.value.refusals]
    assert [s for _, s in found] == [stage], found
    assert found[0][0].startswith(message), found


def test_mtp_zero_is_no_mtp_and_negative_hybrid_detached_mtp_or_qk_clip_not_modelled():
    assert preflight_config([*BASE[:-2], "--mtp-num-layers", "0"]).mtp is None
    for extra in (["--mtp-num-layers", "-1"],
                  ["--mtp-num-layers", "1", "--mtp-detach-heads"],
                  ["--mtp-num-layers", "1", "--hybrid-layer-pattern", "M*M*"],
                  ["--qk-clip", "--qk-layernorm"]):
        with pytest.raises(FlagError) as caught:
            preflight_config([*BASE, *extra])
        assert any(f"{extra[0]} {extra[1]}: not modelled" in m or "--mtp-detach-heads: not "
                   "modelled" in m or "--qk-clip: not modelled" in m
                   for m in caught.value.messages), caught.value.messages
    # Without MTP its other flags change nothing: listed as ignored.
    parsed = parse_megatron_flags(["--mtp-detach-heads", "--mtp-use-repeated-layer"])
    assert parsed.unknown == ["--mtp-detach-heads", "--mtp-use-repeated-layer"]


def test_the_twin_lists_mtp_and_qk_layernorm_as_not_twinned():
    config = preflight_config([*MTP, "--qk-layernorm", "--untie-embeddings-and-output-weights"])
    plan = plan_twin(config, TwinOptions())
    text = "\n".join(plan.not_twinned)
    assert ("--qk-layernorm: the q/k layernorm params of every attention layer and the TP "
            "all-reduce of their grads are laid out on paper only") in text
    tp1 = preflight_config([*UNTIED, "--qk-layernorm", "--world-size", "2",
                            "--tensor-model-parallel-size", "1"])
    assert ("--qk-layernorm: the q/k layernorm params of every attention layer are laid out on "
            "paper only (the twin's blocks have no attention)") in plan_twin(tp1, TwinOptions()).not_twinned
    assert ("--mtp-num-layers 1: the MTP layers, their loss and the last stage's word-embedding "
            "copy are laid out on paper only; the twin is untied and all-reduces no embedding"
            ) in text
    # finalize_model_grads.py:146: MTP makes production all-reduce the untied embeddings.
    assert dict((m[0], m[1]) for m in plan.mapping)["tied embedding all-reduce"] == (
        "untied, but MTP all-reduces the word embeddings' grads between the first stage and the "
        "last stage's copy")
    settings = config.to_dict()
    assert settings["mtp"] == {"mtp_num_layers": 1, "mtp_use_repeated_layer": False,
                               "mtp_loss_scaling_factor": 0.1, "layers_built": 1}
    assert settings["qk_norm_params"] and settings["word_embedding_all_reduce"]


def test_mtp_names_the_embedding_copy_and_its_all_reduce_only_across_stages():
    """At PP 1 the one stage builds the one word embedding its MTP layers read (gpt_model.py:167:
    pre_process or mtp_process) and the one-rank embedding group skips the all-reduce
    (finalize_model_grads.py:229): no copy and no all-reduce, tied or not. At PP 2 the last
    stage builds a copy that is all-reduced with the first stage's (:132-147)."""
    def mtp_entries(argv: list[str]) -> list[str]:
        plan = plan_twin(preflight_config(argv), TwinOptions())
        return [g for g in plan.not_twinned if g.startswith("--mtp-num-layers")]

    pp1 = ["--pipeline-model-parallel-size", "1", "--mtp-num-layers", "1"]
    for argv in ([*BASE, *pp1], [*UNTIED, *pp1]):
        assert mtp_entries(argv) == [
            "--mtp-num-layers 1: the MTP layers and their loss are laid out on paper only"]
    (tied,) = mtp_entries([*BASE, "--mtp-num-layers", "1"])
    assert tied == ("--mtp-num-layers 1: the MTP layers, their loss and the last stage's "
                    "word-embedding copy are laid out on paper only; its all-reduce stands for "
                    "production's between the first stage's embedding and the last stage's "
                    "copy, but no MTP gradient reaches it")


def test_with_mtp_the_final_layernorm_goes_with_the_last_decoder_layer():
    # 2 layers + embedding + loss over PP 2 x VPP 2: one each per virtual stage (virtual stage v
    # = chunk x PP + stage), so the last chunk (stage 1, chunk 1) holds the loss and MTP but no
    # decoder layer; layer 2 of 2 (layer_number == num_layers, transformer_block.py:404-409) is
    # on stage 0, chunk 1, which builds the final layernorm.
    argv = [*MTP, "--num-layers", "2", "--num-virtual-stages-per-pipeline-rank", "2",
            "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    config = preflight_config(argv)
    assert [list(row) for row in config.layer_split.layers] == [[0, 1], [1, 0]]
    where = {(s, c): [p.name for p in chunk_parameters(config, s, c)]
             for s in range(2) for c in range(2)}
    assert [k for k, names in where.items() if "decoder.final_layernorm.weight" in names] == [(0, 1)]
    assert where[(1, 1)][0] == "embedding.word_embeddings.weight"
    assert where[(1, 1)][1] == "mtp.layers.0.enorm.weight"
    assert where[(1, 1)][-1] == "output_layer.weight"
    # Without MTP it stays with the post-process chunk.
    plain = preflight_config([*UNTIED, *argv[len(MTP):]])
    assert "decoder.final_layernorm.weight" in [p.name for p in chunk_parameters(plain, 1, 1)]


def test_an_mtp_layer_is_of_the_decoders_last_layers_kind_moe_or_dense():
    # megatron/training/models/gpt.py:401-416 mtp_block_spec: the decoder's last layer spec
    # (decoder_specs[-1]). World 4 = PP 2 x DP 2 at TP 1; 2 experts over EP 2 (one local each,
    # expert buffers: EP > 1, layers.py:961); expert FFN 32: fc1 [32, 64] + fc2 [64, 32] =
    # 4096 elements per MoE layer (no biases).
    moe = ["--world-size", "4", "--tensor-model-parallel-size", "1", "--num-experts", "2",
           "--expert-model-parallel-size", "2", "--moe-ffn-hidden-size", "32",
           "--disable-bias-linear"]
    every = preflight_config([*MTP, *moe])
    experts = expert_chunk_layouts(every)
    # stage 0: layers 0, 1; stage 1: layers 2, 3 and the MTP layer, all MoE.
    assert [c.param_elements for c in experts] == [2 * 4096, 3 * 4096]
    assert any(p.name.startswith("mtp.layers.0.mtp_model_layer.mlp.experts.")
               for p in experts[1].params)
    last_dense = preflight_config([*MTP, *moe, "--moe-layer-freq", "[1,1,1,0]"])
    experts = expert_chunk_layouts(last_dense)
    assert [c.param_elements for c in experts] == [2 * 4096, 4096]
    names = [p.name for p in chunk_parameters(last_dense, 1, 0)]
    assert "mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight" in names


def test_the_wire_table_shows_the_qk_norms_tp_all_reduce_only_where_it_sends_bytes():
    def wire_table(argv: list[str]) -> tuple[list[str], list[list[str]]]:
        config = preflight_config(argv)
        report = build_report(config, parse_megatron_flags([]), CostInputs())
        ((_, headers, rows),) = [t for t in report_tables(report)
                                 if t[0] == "Bytes sent per step by one rank of each stage"]
        return headers, rows

    headers, rows = wire_table([*BASE, "--qk-layernorm"])
    assert headers[-1] == "q/k norm TP all-reduce"
    assert [row[-1] for row in rows] == ["512 B"]  # both stages 512 B: collapsed to one row
    tp1, _ = wire_table([*BASE, "--qk-layernorm", "--world-size", "2",
                         "--tensor-model-parallel-size", "1"])
    assert "q/k norm TP all-reduce" not in tp1

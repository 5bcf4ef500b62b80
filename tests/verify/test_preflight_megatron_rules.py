"""Each rule of Megatron-LM core_r0.19.0's launch path: a launch it accepts, one it refuses.

Expected figures (DP, microbatches, VPP, layers and first layer per pipeline stage and model
chunk, bucket sizes) are derived by hand from Megatron-LM's source, cited per test:
megatron/training/arguments.py validate_args, megatron/core/num_microbatches_calculator.py,
megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__,
megatron/core/transformer/transformer_block.py get_num_layers_to_build,
megatron/core/transformer/transformer_layer.py get_transformer_layer_offset,
megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving,
megatron/training/training.py resolve_ddp_bucket_size and get_model.
"""

from __future__ import annotations

import pytest

from tests.verify.preflight_launch import parsed_launch, preflight_config
from verify.preflight.cli import build_report
from verify.preflight.config import ConfigError
from verify.preflight.flags import FlagError
from verify.preflight.paper import activation_bytes, chunk_layouts
from verify.preflight.timing import CostInputs
from verify.preflight.twin import MAX_EXTRA_TWIN_LAYERS, TwinOptions, plan_twin

MODEL = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--padded-vocab-size", "128",
         "--micro-batch-size", "1"]


def _config(*flags: str):
    return preflight_config([*MODEL, *flags])


def _refused(*flags: str, error=ConfigError) -> str:
    with pytest.raises(error) as exc:
        _config(*flags)
    return str(exc.value)


def _layers(config) -> tuple[list[list[int]], list[list[int]]]:
    split = config.layer_split
    return [list(r) for r in split.layers], [list(r) for r in split.offsets]


# ---------------------------------------------------------------- world, CP, DP, microbatches


def test_context_parallelism_divides_the_world_before_dp():
    # validate_args: world 40 % (TP 2 x PP 5 x CP 2 = 20) == 0; DP = 40 // 20 = 2.
    # num_microbatches_calculator.py ConstantNumMicroBatchesCalculator: M = 8 // (1 x DP 2) = 4
    # (the case: without CP it would read DP 4, M 2).
    config = _config("--world-size", "40", "--tensor-model-parallel-size", "2",
                     "--pipeline-model-parallel-size", "5", "--context-parallel-size", "2",
                     "--num-layers", "5", "--global-batch-size", "8")
    assert (config.data_parallel_size, config.num_microbatches) == (2, 4)
    assert config.data_context_parallel_size == 4
    # validate_args: 'world size (30) is not divisible by total_model_size (20)'.
    message = _refused("--world-size", "30", "--tensor-model-parallel-size", "2",
                       "--pipeline-model-parallel-size", "5", "--context-parallel-size", "2",
                       "--num-layers", "5")
    assert "world size 30" in message and "= 20" in message


def test_the_sequence_splits_over_twice_cp():
    # validate_args: seq_length % (2 x CP) == 0: 16 % 4 == 0; 18 % 4 == 2.
    assert _config("--world-size", "2", "--context-parallel-size", "2",
                   "--num-layers", "2").context_parallel_size == 2
    message = _refused("--world-size", "2", "--context-parallel-size", "2", "--num-layers", "2",
                       "--seq-length", "18", "--max-position-embeddings", "18")
    assert "--seq-length (18)" in message and "2 x --context-parallel-size = 4" in message


def test_context_parallel_ranks_reduce_grads_and_set_the_default_bucket_size():
    # training.py resolve_ddp_bucket_size: max(40_000_000, 1_000_000 x dp_cp size): DP 32 x CP 2
    # = 64 -> 64,000,000; DP 32 alone -> 40,000,000. get_model: only pipeline rank 0's first
    # chunk is bucketed.
    flags = ["--num-layers", "2", "--overlap-grad-reduce", "--global-batch-size", "32"]
    with_cp = _config("--world-size", "64", "--context-parallel-size", "2", *flags)
    without = _config("--world-size", "32", *flags)
    assert [c.bucket_size for c in chunk_layouts(with_cp)] == [64_000_000]
    assert [c.bucket_size for c in chunk_layouts(without)] == [40_000_000]
    # schedules.py: the p2p tensor is [seq / CP, micro batch, hidden]: 16 / 2 x 1 x 64 x 4 B.
    assert activation_bytes(with_cp) == 8 * 64 * 4


@pytest.mark.parametrize(("flags", "m"), [
    (["--global-batch-size", "8"], 4),
    # --decrease-batch-size-if-needed rounds 7 down to 6; validate_args first checks the
    # evaluation batch (default: the global batch), so a divisible one must be given.
    (["--global-batch-size", "7", "--decrease-batch-size-if-needed", "--eval-global-batch-size", "8"], 3),
])
def test_microbatches_and_the_decreased_batch(flags, m):
    # ConstantNumMicroBatchesCalculator: M = global // (micro 1 x DP 2).
    assert _config("--world-size", "2", "--num-layers", "2", *flags).num_microbatches == m


def test_microbatch_refusals():
    # 'global batch size (7) is not divisible by micro batch size (1) times data parallel size (2)'.
    assert "--global-batch-size (7)" in _refused("--world-size", "2", "--num-layers", "2",
                                                 "--global-batch-size", "7")
    # validate_args: 'eval_global_batch_size (7) must be divisible by eval_micro_batch_size (1)
    # * data_parallel_size (2)', checked before the calculator could round the batch down.
    assert "the evaluation batch 7" in _refused("--world-size", "2", "--num-layers", "2",
                                                "--global-batch-size", "7",
                                                "--decrease-batch-size-if-needed")
    # Rounded down to 0: 'number of microbatches should be at least 1'.
    assert "leaves no microbatch" in _refused("--world-size", "4", "--num-layers", "2",
                                              "--global-batch-size", "3",
                                              "--decrease-batch-size-if-needed",
                                              "--eval-global-batch-size", "4")
    # validate_args: 'Cannot specify both --step-batch-size-schedule and --global-batch-size'.
    assert "cannot both be given" in _refused("--world-size", "2", "--num-layers", "2",
                                              "--global-batch-size", "4",
                                              "--step-batch-size-schedule", "0:2 100:4")
    # Alone the schedule changes M during training: not modelled, named.
    assert "not modelled" in _refused("--world-size", "2", "--num-layers", "2",
                                      "--step-batch-size-schedule", "0:2 100:4")


def test_required_flags_and_position_embeddings():
    # validate_args _check_arg_is_not_none: max_position_embeddings is required, and must
    # be >= seq_length.
    flags = ["--world-size", "1", "--num-layers", "2"]
    i = MODEL.index("--max-position-embeddings")
    base = MODEL[:i] + MODEL[i + 2:]
    with pytest.raises(ConfigError, match="--max-position-embeddings is required"):
        preflight_config(base + flags)
    with pytest.raises(ConfigError, match=r"--max-position-embeddings \(8\) must be >= --seq-length \(16\)"):
        preflight_config(base + flags + ["--max-position-embeddings", "8"])
    assert preflight_config(base + flags + ["--max-position-embeddings", "16"]).seq_length == 16
    # validate_args: --batch-size is 'no longer valid, use --micro-batch-size instead'.
    assert "use --micro-batch-size" in _refused(*flags, "--batch-size", "4")


# --------------------------------------------------------------------------- layer split


def test_embedding_and_loss_counted_as_layers():
    # get_num_layers_to_build: (7 + 1) / PP 4 = 2 per rank, the first rank builds 2 - 1 = 1.
    # get_transformer_layer_offset: rank x 2, less 1 after the embedding: 0, 1, 3, 5.
    config = _config("--world-size", "4", "--pipeline-model-parallel-size", "4",
                     "--num-layers", "7", "--account-for-embedding-in-pipeline-split")
    assert _layers(config) == ([[1], [2], [2], [2]], [[0], [1], [3], [5]])
    first = chunk_layouts(config)[0]
    assert {p.name.split(".")[2] for p in first.params if p.name.startswith("decoder.layers")} == {"0"}
    assert first.params[0].name == "embedding.word_embeddings.weight"
    # Both: (6 + 2) / 4 = 2 per rank; the first and the last build one fewer.
    both = _config("--world-size", "4", "--pipeline-model-parallel-size", "4", "--num-layers", "6",
                   "--account-for-embedding-in-pipeline-split",
                   "--account-for-loss-in-pipeline-split")
    assert _layers(both) == ([[1], [2], [2], [1]], [[0], [1], [3], [5]])
    # validate_args: (8 + 1) % 4 != 0: 'Number of layers should be divisible by the
    # pipeline-model-parallel size'.
    message = _refused("--world-size", "4", "--pipeline-model-parallel-size", "4",
                       "--num-layers", "8", "--account-for-embedding-in-pipeline-split")
    assert "--num-layers (8) + 1" in message and "= 9" in message


def test_accounted_split_with_interleaving():
    # PP 2, VPP 2, 14 layers + embedding + loss = 16: 8 per rank, 4 per chunk; (stage 0,
    # chunk 0) and (stage 1, chunk 1) build 3. Offsets: chunk x 16/2 + stage x 8/2, less 1
    # after the embedding: (0,0) 0, (0,1) 7, (1,0) 3, (1,1) 11.
    config = _config("--world-size", "2", "--pipeline-model-parallel-size", "2",
                     "--num-layers", "14", "--num-virtual-stages-per-pipeline-rank", "2",
                     "--account-for-embedding-in-pipeline-split",
                     "--account-for-loss-in-pipeline-split", "--global-batch-size", "2")
    assert _layers(config) == ([[3, 4], [4, 3]], [[0, 7], [3, 11]])
    # validate_args counts both in --num-layers-per-virtual-pipeline-stage: (6 + 2) / PP 2 = 4
    # per stage, 2 per virtual stage: VPP 2.
    per_stage = _config("--world-size", "2", "--pipeline-model-parallel-size", "2",
                        "--num-layers", "6", "--num-layers-per-virtual-pipeline-stage", "2",
                        "--account-for-embedding-in-pipeline-split",
                        "--account-for-loss-in-pipeline-split", "--global-batch-size", "2")
    assert per_stage.virtual_pipeline_model_parallel_size == 2
    assert _layers(per_stage)[0] == [[1, 2], [2, 1]]
    # TransformerConfig: (12 + 2) / 2 = 7 per rank, not a multiple of VPP 2.
    message = _refused("--world-size", "2", "--pipeline-model-parallel-size", "2",
                       "--num-layers", "12", "--num-virtual-stages-per-pipeline-rank", "2",
                       "--account-for-embedding-in-pipeline-split",
                       "--account-for-loss-in-pipeline-split", "--global-batch-size", "2")
    assert "= 7" in message and "--num-virtual-stages-per-pipeline-rank (2)" in message


def test_uneven_first_and_last_stages():
    # TransformerConfig / get_num_layers_to_build: 10 - 1 - 3 = 6 middle layers over 2 middle
    # stages = 3 each. Offsets (get_transformer_layer_offset): 0; middle rank r: r x 3 + 1.
    uneven = ["--world-size", "4", "--pipeline-model-parallel-size", "4", "--num-layers", "10"]
    config = _config(*uneven, "--decoder-first-pipeline-num-layers", "1",
                     "--decoder-last-pipeline-num-layers", "3")
    assert _layers(config) == ([[1], [3], [3], [3]], [[0], [1], [4], [7]])
    # Only the last given: 10 - 4 = 6 over 3 stages: 2 each; the last stage at 3 x 2.
    last = _config(*uneven, "--decoder-last-pipeline-num-layers", "4")
    assert _layers(last) == ([[2], [2], [2], [4]], [[0], [2], [4], [6]])
    # 10 - 2 - 3 = 5 middle layers over 2 stages.
    assert "must be divisible by their number, 2" in _refused(
        *uneven, "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "3")
    assert "must be larger than 0" in _refused(*uneven, "--decoder-first-pipeline-num-layers", "0")
    # TransformerConfig: not together with the accounted split.
    assert "cannot be combined" in _refused(*uneven, "--decoder-first-pipeline-num-layers", "1",
                                            "--account-for-loss-in-pipeline-split")


def test_uneven_stages_with_interleaving():
    # PP 4 VPP 2, 12 layers, first 2, last 2: middle 8 / 2 = 4 per rank, 2 per chunk; first and
    # last 1 per chunk. Offsets: total per chunk 1 + 8/2 + 1 = 6; stage 0: chunk x 6; middle
    # rank r: chunk x 6 + 1 + r x (4 // 2); last: chunk x 6 + 1 + 2 x 2.
    flags = ["--world-size", "4", "--pipeline-model-parallel-size", "4", "--num-layers", "12",
             "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "4"]
    config = _config(*flags, "--decoder-first-pipeline-num-layers", "2",
                     "--decoder-last-pipeline-num-layers", "2")
    assert _layers(config) == ([[1, 1], [2, 2], [2, 2], [1, 1]],
                               [[0, 6], [1, 7], [3, 9], [5, 11]])
    # TransformerConfig: the first stage's 3 layers do not split over VPP 2.
    assert "(3) must be divisible by the virtual pipeline size 2" in _refused(
        *flags, "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "1")
    # validate_args: uneven stages need --num-virtual-stages-per-pipeline-rank.
    assert "need --num-virtual-stages-per-pipeline-rank" in _refused(
        "--world-size", "4", "--pipeline-model-parallel-size", "4", "--num-layers", "12",
        "--num-layers-per-virtual-pipeline-stage", "1", "--decoder-first-pipeline-num-layers", "2")


# ------------------------------------------------------------------- interleaved schedule


@pytest.mark.parametrize(("flags", "accepted"), [
    # Group = PP 2 by default (model_parallel_config.py): M 4 in [2, 4], 4 % 2 == 0.
    (["--global-batch-size", "4"], True),
    # M 3: 3 % 2 = 1, neither 0 nor >= PP.
    (["--global-batch-size", "3"], False),
    # Group 3 in [PP 2, M 5]; 5 % 3 = 2 >= PP.
    (["--global-batch-size", "5", "--microbatch-group-size-per-virtual-pipeline-stage", "3"], True),
    # Group 3, M 4: 4 % 3 = 1 < PP.
    (["--global-batch-size", "4", "--microbatch-group-size-per-virtual-pipeline-stage", "3"], False),
    # Group 6 > M 4.
    (["--global-batch-size", "4", "--microbatch-group-size-per-virtual-pipeline-stage", "6"], False),
])
def test_the_interleaved_schedules_checks_on_m(flags, accepted):
    base = ["--world-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
            "--num-virtual-stages-per-pipeline-rank", "2"]
    if accepted:
        assert _config(*base, *flags).virtual_pipeline_model_parallel_size == 2
    else:
        assert "interleaved schedule" in _refused(*base, *flags)


def test_interleaving_needs_a_pipeline():
    # validate_args: PP > 1 with p2p overlap (the default), PP > 2 without.
    assert "requires --pipeline-model-parallel-size >= 2" in _refused(
        "--world-size", "1", "--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2")
    assert "requires --pipeline-model-parallel-size >= 3" in _refused(
        "--world-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
        "--num-virtual-stages-per-pipeline-rank", "2", "--no-overlap-p2p-communication",
        "--global-batch-size", "4")
    ok = _config("--world-size", "3", "--pipeline-model-parallel-size", "3", "--num-layers", "6",
                 "--num-virtual-stages-per-pipeline-rank", "2", "--no-overlap-p2p-communication",
                 "--global-batch-size", "3")
    assert ok.virtual_pipeline_model_parallel_size == 2 and not ok.overlap_p2p_comm
    # A virtual pipeline size of 1 is none (validate_args sets it to None): fine at PP 1.
    assert _config("--world-size", "1", "--num-layers", "2",
                   "--num-virtual-stages-per-pipeline-rank", "1").virtual_pipeline_model_parallel_size == 1


# --------------------------------------------------------------- TransformerConfig, model build


def test_fp8_params_need_fp8():
    # TransformerConfig: 'fp8_param must be used together with fp8 mode'; args.fp8 is
    # --fp8-format (the recipe alone does not turn FP8 on).
    flags = ["--world-size", "1", "--num-layers", "2", "--use-distributed-optimizer",
             "--fp8-recipe", "mxfp8", "--fp8-param-gather"]
    assert "--fp8-param-gather requires FP8, --fp8-format" in _refused(*flags)
    config = _config(*flags, "--fp8-format", "e4m3")
    assert (config.fp8_format, config.fp8_recipe) == ("e4m3", "mxfp8")
    # --fp8-format alone: Megatron's default recipe, delayed.
    assert _config("--world-size", "1", "--num-layers", "2", "--fp8-format", "hybrid").fp8_recipe == "delayed"


def test_query_groups_are_a_multiple_or_a_divisor_of_tp():
    # TransformerConfig: groups % TP == 0 or TP % groups == 0. TP 4, 2 groups (a divisor):
    # attention.py divides heads 8 by groups 2; QKV out (8 + 2 x 2) x 8 = 96, 96 % 4 == 0.
    flags = ["--world-size", "4", "--tensor-model-parallel-size", "4", "--num-layers", "2",
             "--num-attention-heads", "8", "--group-query-attention"]
    assert _config(*flags, "--num-query-groups", "2").num_query_groups == 2
    # --num-query-groups defaults to 1 (arguments.py) under --group-query-attention.
    assert _config(*flags).num_query_groups == 1
    assert "multiple or a divisor" in _refused(*flags, "--num-attention-heads", "12",
                                               "--num-query-groups", "3", "--hidden-size", "96")
    # Transformer Engine's DotProductAttention: heads 12 % groups 8 != 0.
    assert "--num-attention-heads (12) must be a multiple of --num-query-groups (8)" in _refused(
        "--world-size", "1", "--num-layers", "2", "--num-attention-heads", "12",
        "--hidden-size", "96", "--group-query-attention", "--num-query-groups", "8")


def test_swiglu_default_ffn_is_named_as_derived():
    # validate_args: --swiglu without --ffn-hidden-size: int(4 h x 2/3 / 64) x 64; h 64 -> 128,
    # which splits over TP 2; h 96 -> int(4.0) x 64 = 256, which does not split over TP 3
    # (layers.py divide()).
    flags = ["--num-layers", "2", "--swiglu"]
    assert _config("--world-size", "2", "--tensor-model-parallel-size", "2", *flags).ffn_hidden_size == 128
    message = _refused("--world-size", "3", "--tensor-model-parallel-size", "3", *flags,
                       "--hidden-size", "96", "--num-attention-heads", "3",
                       "--padded-vocab-size", "384")
    assert "Megatron's default for --hidden-size 96 under --swiglu" in message
    assert "--ffn-hidden-size not given" in message and "(256)" in message


def test_tp_comm_overlap_needs_sequence_parallelism():
    # validate_args: 'Tensor parallel communication/GEMM overlap can happen only when sequence
    # parallelism is enabled'.
    flags = ["--world-size", "2", "--tensor-model-parallel-size", "2", "--num-layers", "2",
             "--tp-comm-overlap"]
    assert "requires --sequence-parallel" in _refused(*flags)
    assert _config(*flags, "--sequence-parallel").sequence_parallel


# -------------------------------------------------------------------------------- the twin


def test_the_twin_keeps_an_uneven_splits_differences():
    # Production [1, 3, 3, 3] (first stage 1 layer): the twin adds each stage's surplus over
    # the lightest to --twin-layers 1: [1, 3, 3, 3].
    config = _config("--world-size", "4", "--pipeline-model-parallel-size", "4", "--num-layers", "10",
                     "--decoder-first-pipeline-num-layers", "1", "--global-batch-size", "4")
    assert _layers(config)[0] == [[1], [3], [3], [3]]
    plan = plan_twin(config, TwinOptions(max_world_size=8))
    assert plan.case.spec.stage_layers == (1, 3, 3, 3)
    assert dict((m[0], m[1:]) for m in plan.mapping)["layers per virtual stage"] == (
        "[1, 3, 3, 3] (= 10)", "[1, 3, 3, 3] (= 10)")
    # The embedding and the loss as layers: production [0, 1, 1, 0] -> twin [1, 2, 2, 1], the
    # empty stages named.
    empty = _config("--world-size", "4", "--pipeline-model-parallel-size", "4", "--num-layers", "2",
                    "--account-for-embedding-in-pipeline-split",
                    "--account-for-loss-in-pipeline-split", "--global-batch-size", "4")
    plan = plan_twin(empty, TwinOptions(max_world_size=8))
    assert plan.case.spec.stage_layers == (1, 2, 2, 1)
    assert any("no transformer layer" in g for g in plan.not_twinned)
    # Differences beyond MAX_EXTRA_TWIN_LAYERS are capped, and said so.
    big = _config("--world-size", "3", "--pipeline-model-parallel-size", "3", "--num-layers", "20",
                  "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1",
                  "--global-batch-size", "3")
    plan = plan_twin(big, TwinOptions())
    assert plan.case.spec.stage_layers == (1, 1 + MAX_EXTRA_TWIN_LAYERS, 1)
    assert any("production's layers per virtual stage [1, 18, 1]" in g for g in plan.not_twinned)
    # An even split keeps --twin-layers on every stage.
    even = _config("--world-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4")
    assert plan_twin(even, TwinOptions(layers=2)).case.spec.stage_layers == ()


def test_the_twin_stands_dp_replicas_for_the_dp_cp_group_and_says_so():
    # CP 2 x DP 2: grads are pre-scaled by 1/4 and summed over the dp_cp group of 4
    # (distributed_data_parallel.py); the twin runs 4 DP replicas (PP 1: 4 ranks).
    config = _config("--world-size", "4", "--context-parallel-size", "2", "--num-layers", "2",
                     "--global-batch-size", "4")
    plan = plan_twin(config, TwinOptions())
    assert plan.case.dp_size == 4 and plan.world_size == 4
    rows = dict((m[0], m[1:]) for m in plan.mapping)
    assert rows["TP x PP x VPP x DP"] == ("1 x 1 x 1 x 2 (x CP 2)", "1 x 1 x 1 x 4")
    assert "x 1/4 then summed over DP x CP = 4 ranks" in rows["context parallelism"][0]
    assert any(g.startswith("context parallelism CP 2 scaled away") for g in plan.not_twinned)


def test_not_modelled_flags_are_refused_naming_them():
    with pytest.raises(FlagError, match=r"--pipeline-model-parallel-layout .*: not modelled"):
        _config("--world-size", "2", "--num-layers", "2", "--pipeline-model-parallel-layout",
                "Et|tL")


def test_a_microbatch_group_other_than_pp_gets_its_paper_figures():
    # schedules.py accepts group 3 at PP 2 with M 5 (5 % 3 = 2 >= PP); the bubble simulator
    # runs groups of PP, so it simulates 4 microbatches and says so; the twin lists the group.
    argv = [*MODEL, "--world-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4",
            "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "5",
            "--microbatch-group-size-per-virtual-pipeline-stage", "3"]
    config = preflight_config(argv)
    report = build_report(config, parsed_launch(argv), CostInputs())
    assert "M = 5 simulated as 4" in " ".join(report["pipeline"]["assumptions"])
    plan = plan_twin(config, TwinOptions())
    assert any("--microbatch-group-size-per-virtual-pipeline-stage 3" in g for g in plan.not_twinned)


def test_buffers_are_padded_over_the_dp_cp_group():
    # distributed_data_parallel.py shards the buffer over intra_dp_cp_group (DP x CP ranks);
    # optimizer/param_layout.py pad_bucket_end: a multiple of lcm(DP x CP, 128). DP 1 x CP 3,
    # one layer at h 64 (49,984 elements, every size a multiple of 64: no start gaps, as in
    # test_preflight_paper.py), word embedding 256 x 64 = 16,384, positions 18 x 64 = 1,152,
    # final LayerNorm 128: 67,648 -> lcm(3, 128) = 384: ceil(67648 / 384) = 177 -> 67,968
    # (over DP 1 alone it would be 529 x 128 = 67,712).
    config = preflight_config(["--world-size", "3", "--context-parallel-size", "3",
                               "--num-layers", "1", "--hidden-size", "64",
                               "--num-attention-heads", "4", "--seq-length", "18",
                               "--max-position-embeddings", "18", "--padded-vocab-size", "256",
                               "--micro-batch-size", "1", "--use-distributed-optimizer"])
    (chunk,) = chunk_layouts(config)
    assert chunk.param_elements == 67_648
    assert chunk.layout.numel == 67_968

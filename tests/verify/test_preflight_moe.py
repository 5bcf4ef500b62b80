"""Mixture-of-experts launches: read, checked and laid out as Megatron-LM core_r0.19.0 does.

Expected values are derived by hand from megatron-core 0.19.2's source, cited per test:
parallel_state.py:874-883 (expert DP = world // (ETP x EP x PP), refused when it does not
divide), tensor_parallel/layers.py:961 (experts' params ``allreduce=False`` where EP > 1 or
ETP != TP), param_and_grad_buffer.py:882 group_params_for_buffers (their own buffer),
distrib_optimizer.py:619 (padded with the expert DP size: bucket ends to lcm(EDP, 128)),
distributed_data_parallel.py:185-216 (the expert gradient scaling factor), moe_layer.py and
experts.py SequentialMLP (the experts' shapes), validate_args / TransformerConfig /
gpt_layer_specs.py (the refusals).
"""

from __future__ import annotations

import pytest

from tests.verify.preflight_launch import parsed_launch, preflight_config
from verify.preflight.cli import build_report, expert_figures
from verify.preflight.config import ConfigError
from verify.preflight.flags import FlagError
from verify.preflight.model import chunk_parameters
from verify.preflight.paper import chunk_layouts, expert_chunk_layouts
from verify.preflight.timing import CostInputs
from verify.preflight.twin import TwinOptions, plan_twin

# Megatron-LM core_r0.19.0 examples/mixtral/train_mixtral_8x7b_distributed.sh, the flags it
# hands pretrain_gpt.py (the tokenizer's vocabulary given as --padded-vocab-size).
MIXTRAL = [
    "--use-mcore-models", "--disable-bias-linear", "--seq-length", "4096",
    "--max-position-embeddings", "32768", "--num-layers", "32", "--hidden-size", "4096",
    "--ffn-hidden-size", "14336", "--num-attention-heads", "32", "--init-method-std", "0.01",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "8", "--no-masked-softmax-fusion",
    "--no-position-embedding", "--rotary-base", "1000000",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
    "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm",
    "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather", "--overlap-grad-reduce",
    "--micro-batch-size", "1", "--global-batch-size", "256", "--lr", "1e-4", "--clip-grad", "1.0",
    "--bf16", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
    "--expert-model-parallel-size", "8", "--use-distributed-optimizer", "--sequence-parallel",
    "--padded-vocab-size", "32000",
]

# A small MoE launch: world 18, PP 2, EP 3 -> DP 18 / 2 = 9, expert DP 18 / (1 x 3 x 2) = 3;
# 3 experts, one per EP rank; 4 layers, 2 per stage; expert FFN 41 (no bias, no SwiGLU).
SMALL = ["--world-size", "18", "--pipeline-model-parallel-size", "2",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--padded-vocab-size", "128",
         "--micro-batch-size", "1", "--global-batch-size", "18", "--bf16",
         "--disable-bias-linear", "--use-distributed-optimizer",
         "--num-experts", "3", "--expert-model-parallel-size", "3", "--moe-ffn-hidden-size", "41"]
# The same with Megatron's default biases.
WITH_BIAS = [t for t in SMALL if t != "--disable-bias-linear"]


def test_mixtral_example_is_accepted_with_megatrons_expert_grid_buffers_and_averaging():
    config = preflight_config(["--world-size", "64", *MIXTRAL])
    # parallel_state.py:874-880: 64 // (ETP 1 (= TP, validate_args:569) x EP 8 x PP 4) = 2.
    assert config.data_parallel_size == 16
    assert config.expert_data_parallel_size == 2
    assert config.expert_buffers  # EP 8 > 1 (layers.py:961)
    # distributed_data_parallel.py:213-215: both buffers x 1/dp_cp before a SUM.
    assert config.expert_gradient_scaling_factor == 1 / 16
    # Per stage: 8 layers, each 8 / 8 = 1 local expert; SwiGLU fc1 [2 x 14336, 4096] =
    # 117,440,512 and fc2 [4096, 14336] = 58,720,256 elements (experts.py TEGroupedMLP:
    # moe_ffn x 2 under gated_linear_unit), both multiples of 64 and of lcm(2, 128).
    experts = expert_chunk_layouts(config)
    assert [(c.stage, c.chunk) for c in experts] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    for c in experts:
        assert c.param_elements == 8 * (117_440_512 + 58_720_256) == 1_409_286_144
        assert c.layout.numel == 1_409_286_144 and c.layout.dp_size == 2
    # The bucket size is the dense buffer's (distributed_data_parallel.py: self.bucket_size):
    # 40M on pipeline rank 0, every expert param above it, so one bucket each (16); one
    # bucket on the other stages.
    assert [c.layout.num_buckets for c in experts] == [16, 1, 1, 1]
    # The router [8, 4096] is an ordinary param: in the dense buffer.
    dense = {p.name for c in chunk_layouts(config) for p in c.params}
    assert "decoder.layers.0.mlp.router.weight" in dense
    assert not any("experts" in name for name in dense)
    figures = expert_figures(config)
    # Reduce-scatter over expert DP 2: (2-1)/2 x 1,409,286,144 x 4 B (fp32 grads under --bf16).
    assert figures["expert_wire"][1]["grad_sync_bytes"] == 0.5 * 1_409_286_144 * 4


def test_small_moe_launch_pads_the_expert_buffer_with_the_expert_dp_size():
    config = preflight_config(SMALL)
    assert (config.data_parallel_size, config.expert_data_parallel_size) == (9, 3)
    # Per stage 2 MoE layers x 1 local expert x (fc1 [41, 64] + fc2 [64, 41]) = 4 x 2,624
    # = 10,496 elements; one bucket (no --overlap-grad-reduce) padded to a multiple of
    # lcm(3, 128) = 384: 28 x 384 = 10,752 (lcm(9, 128) = 1,152 would give 11,520).
    for c in expert_chunk_layouts(config):
        assert c.param_elements == 10_496
        assert c.layout.numel == 10_752
    params = chunk_parameters(config, 0, 0)
    expert = [p.name for p in params if p.expert]
    assert expert[:2] == ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
                          "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert [p.shape for p in params if p.name.endswith("mlp.router.weight")] == [(3, 64)] * 2


@pytest.mark.parametrize(("flags", "factor", "op"), [
    ((), 1 / 9, "SUM"),  # distributed_data_parallel.py:213-215: 1 / dp_cp
    (("--ddp-average-in-collective",), 3 / 9, "AVG"),  # :208: expt_dp / dp_cp, then AVG over EDP
    (("--calculate-per-token-loss",), 1.0, "SUM"),  # :186-187
])
def test_expert_gradient_scaling_factor_is_megatrons(flags, factor, op):
    config = preflight_config([*SMALL, *flags])
    assert config.expert_gradient_scaling_factor == factor
    assert config.grad_reduce_op == op
    error = expert_figures(config)["expert_reduction_error"]
    assert (error["gradient_scaling_factor"], error["reduce_op"], error["dp"]) == (factor, op, 3)


def test_experts_stay_in_the_dense_buffer_at_ep_1_with_etp_equal_to_tp():
    # layers.py:961: use_expert_pgs is False at EP 1 with ETP = TP: allreduce stays True.
    config = preflight_config(["--world-size", "4", *SMALL[2:], "--expert-model-parallel-size",
                               "1", "--pipeline-model-parallel-size", "1",
                               "--global-batch-size", "4"])
    assert not config.expert_buffers and config.expert_gradient_scaling_factor is None
    assert expert_chunk_layouts(config) == [] and expert_figures(config) == {}
    names = [p.name for c in chunk_layouts(config) for p in c.params]
    assert sum("local_experts" in n for n in names) == 4 * 3 * 2  # 4 layers x 3 experts x 2
    # ETP 1 != TP 2 at EP 1: an expert buffer over world // (ETP 1 x EP 1 x PP 1) = 4.
    config = preflight_config(["--world-size", "4", *SMALL[2:], "--expert-model-parallel-size",
                               "1", "--pipeline-model-parallel-size", "1",
                               "--tensor-model-parallel-size", "2",
                               "--expert-tensor-parallel-size", "1", "--global-batch-size", "4"])
    assert config.expert_buffers and config.expert_data_parallel_size == 4
    assert config.data_parallel_size == 2


def test_moe_layer_freq_decides_which_layers_have_experts():
    # gpt_layer_specs.py:647-650: an int N makes layers 0, N, 2N, ... MoE.
    config = preflight_config([*SMALL, "--moe-layer-freq", "2"])
    assert config.to_dict()["moe"]["moe_layers"] == [0, 2]
    config = preflight_config([*SMALL, "--moe-layer-freq", "([0]+[1]*3)"])
    assert config.to_dict()["moe"]["moe_layers"] == [1, 2, 3]
    stage0 = [p.name for p in chunk_parameters(config, 0, 0)]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in stage0
    assert "decoder.layers.1.mlp.router.weight" in stage0


def test_grouped_gemm_lays_every_fc1_before_every_fc2():
    config = preflight_config([*SMALL, "--num-experts", "6", "--moe-grouped-gemm"])
    names = [p.name for p in chunk_parameters(config, 0, 0) if p.expert][:4]
    assert names == ["decoder.layers.0.mlp.experts.linear_fc1.weight0",
                     "decoder.layers.0.mlp.experts.linear_fc1.weight1",
                     "decoder.layers.0.mlp.experts.linear_fc2.weight0",
                     "decoder.layers.0.mlp.experts.linear_fc2.weight1"]
    # backends.py LocalSpecProvider.grouped_mlp_modules: SequentialMLP whatever the flag says.
    config = preflight_config([*SMALL, "--num-experts", "6", "--moe-grouped-gemm",
                               "--transformer-impl", "local"])
    names = [p.name for p in chunk_parameters(config, 0, 0) if p.expert][:2]
    assert names == ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
                     "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]


def _refusals(*argv: str) -> list[tuple[str, str]]:
    with pytest.raises((ConfigError, FlagError)) as exc:
        preflight_config(list(argv))
    return [(r.message, r.stage) for r in exc.value.refusals]


@pytest.mark.parametrize(("argv", "message", "stage"), [
    (["--world-size", "8", *MIXTRAL],
     "world size 8 must be divisible by --expert-tensor-parallel-size (1) x "
     "--expert-model-parallel-size (8) x --pipeline-model-parallel-size (4) = 32",
     "initialize_model_parallel"),
    ([*SMALL, "--num-experts", "4"], "--num-experts (4) must be a multiple of "
     "--expert-model-parallel-size (3) (validate_args: 'Number of experts should be a multiple",
     "validate_args"),
    ([*SMALL, "--moe-router-topk", "1"], "--moe-router-topk 1 with the softmax score function "
     "needs --moe-router-pre-softmax", "TransformerConfig"),
    ([*SMALL[:-6], "--moe-ffn-hidden-size", "41"], "--moe-ffn-hidden-size is given without "
     "--num-experts", "TransformerConfig"),
    ([*SMALL[:-6], "--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs "
     "--num-experts", "validate_args"),
    ([*SMALL, "--moe-layer-freq", "[1,1]"], "--moe-layer-freq gives 2 layers, expected "
     "--num-layers = 4", "model build"),
    ([*SMALL, "--moe-layer-freq", "x"], "argument --moe-layer-freq: invalid moe_freq_type value",
     "parse_args"),
    ([*SMALL, "--world-size", "36", "--tensor-model-parallel-size", "2",
      "--expert-tensor-parallel-size", "2"],
     "the experts' fc1 output (41, from --moe-ffn-hidden-size 41, default the FFN size) must be "
     "divisible by --expert-tensor-parallel-size (2)", "model build"),
    ([*WITH_BIAS, "--moe-shared-expert-intermediate-size", "64"],
     "--moe-shared-expert-intermediate-size: the shared experts have no bias", "model build"),
])
def test_each_moe_rule_is_refused_naming_its_flags(argv, message, stage):
    found = _refusals(*argv)
    assert any(m.startswith(message) and s == stage for m, s in found), found


def test_bias_in_the_experts_needs_etp_1():
    # transformer_config.py:2279: biases (Megatron's default) with ETP = TP 2.
    found = _refusals("--world-size", "4", *WITH_BIAS[2:-6],
                      "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                      "--num-experts", "2")
    assert [s for _, s in found] == ["TransformerConfig"]
    assert found[0][0].startswith("biases in the experts")


def test_an_moe_launch_breaking_two_rules_lists_both_in_megatrons_order():
    # The expert grid (parallel_state.py, at initialize_megatron) before TransformerConfig's
    # top-k rule, whatever order the flags come in.
    found = _refusals(*SMALL, "--moe-router-topk", "1", "--world-size", "16",
                      "--global-batch-size", "16")
    assert [s for _, s in found] == ["initialize_model_parallel", "TransformerConfig"]
    assert found[0][0].startswith("world size 16 must be divisible by")


def test_the_twin_lists_the_experts_as_not_twinned():
    config = preflight_config(SMALL)
    plan = plan_twin(config, TwinOptions())
    assert ("mixture-of-experts layers (the experts, the router and the expert-data-parallel "
            "reduction are laid out on paper only)") in plan.not_twinned
    (row,) = [r for r in plan.mapping if r[0] == "mixture of experts"]
    assert row[2].startswith("none: each MoE layer's FFN trained as a dense block")


# TP 2 with the experts at ETP 1, EP 1, on 2 ranks: DP = 2 // (TP 2 x PP 1) = 1, so the dense
# buffers send nothing, and expert DP = 2 // (ETP 1 x EP 1 x PP 1) = 2 (parallel_state.py:
# 874-880), an expert buffer of its own as ETP != TP (layers.py:961). M = 2 // (1 x 1) = 2.
EXPERTS_ONLY_SYNC = ["--world-size", "2", "--tensor-model-parallel-size", "2",
                     "--expert-tensor-parallel-size", "1", "--num-layers", "4",
                     "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
                     "--max-position-embeddings", "16", "--padded-vocab-size", "128",
                     "--micro-batch-size", "1", "--global-batch-size", "2", "--bf16",
                     "--disable-bias-linear", "--use-distributed-optimizer",
                     "--num-experts", "3", "--moe-ffn-hidden-size", "41"]
# Given compute costs, the grad sync estimated from the wire at 1 GB/s = 1e6 bytes per ms.
COSTS = CostInputs(forward_ms=1.0, backward_ms=2.0, p2p_ms=0.0, assumed_bus_gbps=1.0)


def _pipeline(argv):
    config = preflight_config(argv)
    return build_report(config, parsed_launch(argv), COSTS)["pipeline"]


def test_the_pipeline_step_includes_the_expert_buffers_sync_and_reports_their_gather():
    """distributed_data_parallel.py:578-595: start/finish_grad_sync run ``self.bucket_groups +
    self.expert_parallel_bucket_groups``, so the step waits for the expert reduction too.

    By hand: 4 layers x 3 local experts (EP 1) x (fc1 [41, 64] + fc2 [64, 41]) = 62,976
    elements (a multiple of lcm(2, 128) = 128: no padding), fp32 grads under --bf16. Over
    expert DP 2 the reduce-scatter sends 1/2 x 62,976 x 4 = 125,952 bytes = 0.125952 ms, the
    param all-gather 1/2 x 62,976 x 2 (bf16) = 62,976 bytes = 0.062976 ms; the dense buffer
    at DP 1 sends 0."""
    pipe = _pipeline(EXPERTS_ONLY_SYNC)
    costs = pipe["costs_ms"]
    assert costs["grad_sync"] == costs["last_stage_grad_sync"] == pytest.approx(0.125952)
    assert costs["expert_grad_sync"] == pytest.approx(0.125952)
    assert costs["param_all_gather"] == pytest.approx(0.062976)
    # No --overlap-grad-reduce: the sync follows the compute's M (f + b) = 6 ms, all exposed.
    assert pipe["sync_mode"] == "after-compute"
    assert pipe["compute_end_ms"] == pytest.approx(6.0)
    assert pipe["exposed_grad_sync_ms"] == pytest.approx(0.125952)
    assert pipe["step_time_ms"] == pytest.approx(6.125952)


def test_the_first_chunks_expert_buckets_are_reduced_with_its_dense_ones():
    """With --overlap-grad-reduce the expert buffer takes the dense buffer's bucket size
    (40M: one bucket each here), so pipeline rank 0's first chunk reduces 2 buckets, equal
    shares of the 0.125952 ms (the stated model). By hand: the last backward starts at
    M (f + b) - b = 4 ms; bucket k is ready at 4 + 2 (k + 1) / 2 = 5, 6 ms and takes
    0.062976 ms, so the sync ends 0.062976 ms after the compute's 6 ms."""
    pipe = _pipeline([*EXPERTS_ONLY_SYNC, "--overlap-grad-reduce"])
    assert pipe["first_chunk_buckets"] == 2
    assert pipe["exposed_grad_sync_ms"] == pytest.approx(0.125952 / 2)


def test_each_stage_adds_its_own_expert_sync():
    """SMALL (PP 2, DP 9, expert DP 3): each stage's expert buffer is 10,752 elements
    (test_small_moe_launch_pads_the_expert_buffer_with_the_expert_dp_size), its fp32
    reduce-scatter 2/3 x 10,752 x 4 = 28,672 bytes = 0.028672 ms at 1 GB/s, added to the
    stage's dense sync; the all-gather 2/3 x 10,752 x 2 = 14,336 bytes to the dense one's."""
    argv = [*SMALL, "--overlap-grad-reduce"]
    config = preflight_config(argv)
    report = build_report(config, parsed_launch(argv), COSTS)
    costs = report["pipeline"]["costs_ms"]
    dense = [row["grad_sync_bytes"] / 1e6 for row in report["wire"]]
    assert costs["grad_sync"] == pytest.approx(dense[0] + 0.028672)
    assert costs["last_stage_grad_sync"] == pytest.approx(dense[1] + 0.028672)
    assert costs["expert_grad_sync"] == pytest.approx(0.028672)
    gather = max(row["param_all_gather_bytes"] for row in report["wire"]) / 1e6
    assert costs["param_all_gather"] == pytest.approx(gather + 0.014336)

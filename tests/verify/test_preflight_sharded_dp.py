"""Fully-sharded data parallelism (--use-megatron-fsdp, --use-torch-fsdp2): read, checked and laid
out on paper as Megatron-LM core_r0.19.0 does.

Expected values are derived by hand from megatron-core 0.19.2's source, cited per test:
megatron/training/arguments.py validate_args (the rules, by line), training.py get_model
(:1837-1849, which wrapper, no bucket size for torch FSDP2),
core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py (:113-121 what each strategy shards,
:370-384 the gradient scaling factor, :755-761 grads reduced every backward when sharded),
param_and_grad_buffer.py:4733-4753 (gradient_reduce_preprocessing: the op),
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py _get_gradient_divide_factors (torch
FSDP2's ReduceOp.AVG).
"""

from __future__ import annotations

import pytest

from tests.verify.preflight_launch import parsed_launch, preflight_config
from verify.preflight.config import ConfigError
from verify.preflight.findings import launch_settings, reached
from verify.preflight.flags import FlagError
from verify.preflight.paper import chunk_layouts, sharded_rows
from verify.preflight.render import sharded_tables
from verify.preflight.twin import TwinOptions, plan_twin
from verify.preflight.twin.verdict import write_sections

# Megatron-LM core_r0.19.0 examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh, the flags it
# hands pretrain_gpt.py with its defaults (8 GPUs, optim_grads_params), the mock tokenizer's
# vocabulary given as --padded-vocab-size.
LLAMA3_FSDP = [
    "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size",
    "14336", "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--kv-channels", "128", "--seq-length", "8192", "--max-position-embeddings", "8192",
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu", "--normalization",
    "RMSNorm", "--init-method-std", "0.0134", "--attention-backend", "fused",
    "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "1", "--global-batch-size", "128", "--bf16",
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
    "--no-gradient-accumulation-fusion", "--calculate-per-token-loss",
    "--init-model-with-meta-device", "--ckpt-format", "fsdp_dtensor", "--use-nccl-ub",
    "--fsdp-double-buffer", "--fsdp-manual-registration",
    "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
    "--fp8-param-gather", "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
    "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
    "--overlap-param-gather", "--padded-vocab-size", "128256",
]

# A small launch: world 4 -> DP 4; M = 8 / (1 x 4) = 2. Elements, by hand (no biases, RMSNorm,
# no SwiGLU, kv channels 64 / 4 = 16): per layer norm 64 + QKV (4 + 2 x 4) x 16 x 64 = 12288 +
# proj 64 x 64 = 4096 + norm 64 + fc1 128 x 64 = 8192 + fc2 8192 = 32896; two layers 65792,
# final norm 64, embedding 128 x 64 = 8192, untied output layer 8192: 82240.
ELEMENTS = 82240
SMALL = ["--world-size", "4", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--ffn-hidden-size", "128", "--seq-length", "16",
         "--max-position-embeddings", "16", "--padded-vocab-size", "128",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16"]
MEGATRON_FSDP = [*SMALL, "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
TORCH_FSDP2 = [*SMALL, "--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]


def _refusals(*argv: str) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as exc:
        preflight_config(list(argv))
    return [(r.message, r.stage) for r in exc.value.refusals]


def test_the_megatron_fsdp_example_is_accepted_with_its_companions_read():
    config = preflight_config(["--world-size", "8", *LLAMA3_FSDP])
    sharded = config.sharded_dp
    assert sharded.implementation == "megatron_fsdp"
    assert sharded.data_parallel_sharding_strategy == "optim_grads_params"
    # validate_args:1149: --use-nccl-ub turns on manual registration and the double buffer.
    assert sharded.nccl_ub and sharded.fsdp_manual_registration and sharded.fsdp_double_buffer
    assert sharded.init_model_with_meta_device
    assert sharded.shards == {"optimizer_state": True, "grads": True, "params": True}
    # Per-token loss under Megatron-FSDP: no factor, ReduceOp.SUM (megatron_fsdp.py:370-373,
    # param_and_grad_buffer.py:4741-4742); M = 128 / (1 x 8) = 16.
    assert (config.gradient_scaling_factor, config.grad_reduce_op) == (1.0, "SUM")
    assert config.num_microbatches == 16
    # Megatron-FSDP's main grads default to the compute params' dtype (mixed_precision.py:389).
    assert config.grad_dtype == "bf16"
    read = {text.split()[0] for text in parsed_launch(["--world-size", "8", *LLAMA3_FSDP]).unknown}
    companions = {"--init-model-with-meta-device", "--ckpt-format", "--use-nccl-ub",
                  "--fsdp-double-buffer", "--fsdp-manual-registration",
                  "--data-parallel-sharding-strategy", "--use-megatron-fsdp",
                  "--no-gradient-accumulation-fusion"}
    assert not companions & read, companions & read


def test_the_fsdp_flags_are_listed_as_ignored_without_fsdp():
    unknown = parsed_launch([*SMALL, "--data-parallel-sharding-strategy", "optim",
                             "--fsdp-double-buffer"]).unknown
    assert unknown == ["--data-parallel-sharding-strategy optim", "--fsdp-double-buffer"]
    assert preflight_config(SMALL).sharded_dp is None


@pytest.mark.parametrize(("extra", "factor", "op"), [
    # bf16 grads: multiplied by 1/(DP x CP) = 1/4, then SUM (param_and_grad_buffer.py:4750-4752).
    ([], 0.25, "SUM"),
    # fp32 grads: NCCL PREMUL_SUM(1/4) (gradient_reduce_div_fusion, default True; :4748-4749).
    (["--megatron-fsdp-main-grads-dtype", "fp32"], 0.25, "PREMUL_SUM"),
    # megatron_fsdp.py:375-376: 1.0 and ReduceOp.AVG (:4743-4745).
    (["--ddp-average-in-collective"], 1.0, "AVG"),
    # No DDP assert against both (distributed_data_parallel.py's): per-token wins, SUM.
    (["--calculate-per-token-loss", "--ddp-average-in-collective"], 1.0, "SUM"),
])
def test_megatron_fsdp_gradient_scaling_is_megatrons(extra, factor, op):
    config = preflight_config([*MEGATRON_FSDP, *extra])
    assert (config.gradient_scaling_factor, config.grad_reduce_op) == (factor, op)


def test_per_token_loss_with_averaging_in_the_collective_is_refused_under_ddp_only():
    found = _refusals(*SMALL, "--calculate-per-token-loss", "--ddp-average-in-collective")
    assert [s for _, s in found] == ["DDP wrap"]


def test_torch_fsdp2_averages_in_the_collective_and_skips_the_per_token_division():
    config = preflight_config(TORCH_FSDP2)
    # _get_gradient_divide_factors: bf16, 4 ranks, no factor -> ReduceOp.AVG, no pre-scale.
    assert (config.gradient_scaling_factor, config.grad_reduce_op) == (1.0, "AVG")
    assert config.grad_dtype == "bf16"
    assert config.first_stage_bucket_size is None  # get_model:1848: none resolved
    one = preflight_config([*TORCH_FSDP2, "--world-size", "1", "--global-batch-size", "2"])
    assert one.grad_reduce_op == "SUM"  # world size 1: SUM (NCCL's AVG is wrong there)
    per_token = preflight_config([*TORCH_FSDP2, "--calculate-per-token-loss"])
    assert "1/T of finalize_model_grads is NOT applied" in per_token.grad_averaging


@pytest.mark.parametrize(("strategy", "memory", "wire"), [
    # One rank, DP x CP = 4, bf16 params and grads, fp32 main params, Adam's 8 B per element:
    # (params, grads, main params, optimizer state); (grad bytes, param all-gather bytes) with
    # ring factors 2 x 3/4 (all-reduce), 3/4 (reduce-scatter, all-gather), M = 2.
    ("no_shard", (ELEMENTS * 2, ELEMENTS * 2, ELEMENTS * 4, ELEMENTS * 8),
     (2 * 0.75 * ELEMENTS * 2, 0)),
    ("optim", (ELEMENTS * 2, ELEMENTS * 2, ELEMENTS, ELEMENTS * 2),
     (0.75 * ELEMENTS * 2, 0.75 * ELEMENTS * 2)),  # once per step; one gather after the step
    ("optim_grads", (ELEMENTS * 2, ELEMENTS / 2, ELEMENTS, ELEMENTS * 2),
     (2 * 0.75 * ELEMENTS * 2, 0.75 * ELEMENTS * 2)),  # every microbatch's backward
    ("optim_grads_params", (ELEMENTS / 2, ELEMENTS / 2, ELEMENTS, ELEMENTS * 2),
     (2 * 0.75 * ELEMENTS * 2, 2 * 2 * 0.75 * ELEMENTS * 2)),  # forward + backward, M = 2
])
def test_each_strategy_shards_and_sends_what_megatron_fsdp_does(strategy, memory, wire):
    config = preflight_config([*MEGATRON_FSDP, "--data-parallel-sharding-strategy", strategy])
    (row,) = sharded_rows(config, chunk_layouts(config))
    assert row["param_elements"] == ELEMENTS
    assert (row["param_bytes"], row["grad_bytes"], row["main_param_bytes"],
            row["optimizer_state_bytes"]) == pytest.approx(memory)
    assert (row["grad_sync_bytes"], row["param_all_gather_bytes"]) == pytest.approx(wire)
    assert row["grad_collective"] == ("all-reduce" if strategy == "no_shard" else "reduce-scatter")


def test_torch_fsdp2_without_resharding_gathers_once_per_microbatch():
    config = preflight_config([*TORCH_FSDP2, "--torch-fsdp2-no-reshard-after-forward"])
    (row,) = sharded_rows(config, chunk_layouts(config))
    assert row["param_all_gather_bytes"] == pytest.approx(2 * 0.75 * ELEMENTS * 2)
    assert preflight_config(SMALL).sharded_dp is None
    assert sharded_rows(preflight_config(SMALL), chunk_layouts(preflight_config(SMALL))) == []


@pytest.mark.parametrize(("argv", "message", "line"), [
    ([*SMALL, "--use-torch-fsdp2"], "--use-torch-fsdp2 is not supported with gradient "
     "accumulation fusion", 1006),
    ([*TORCH_FSDP2, "--world-size", "8", "--pipeline-model-parallel-size", "2"],
     "--use-torch-fsdp2 is not supported with pipeline parallelism", 1000),
    ([*TORCH_FSDP2, "--use-distributed-optimizer"], "--use-torch-fsdp2 is not supported with "
     "MCore's distributed optimizer", 1004),
    ([*TORCH_FSDP2, "--ckpt-format", "torch"], "--use-torch-fsdp2 requires --ckpt-format "
     "torch_dist or torch_dcp, got torch", 1008),
    ([t for t in TORCH_FSDP2 if t != "--untie-embeddings-and-output-weights"],
     "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights", 1010),
    ([*[t for t in TORCH_FSDP2 if t != "--bf16"], "--fp16"], "--use-torch-fsdp2 is not "
     "supported with --fp16", 1012),
    ([*SMALL, "--use-megatron-fsdp"], "--use-megatron-fsdp requires --ckpt-format fsdp_dtensor, "
     "got torch_dist", 1146),
    ([*MEGATRON_FSDP, "--check-weight-hash-across-dp-replicas-interval", "10"],
     "--check-weight-hash-across-dp-replicas-interval is not supported with --use-megatron-fsdp",
     1139),
    ([*MEGATRON_FSDP, "--data-parallel-sharding-strategy", "no_shard",
      "--init-model-with-meta-device"], "--init-model-with-meta-device is not supported with "
     "--use-megatron-fsdp --data-parallel-sharding-strategy no_shard", 1160),
    ([*MEGATRON_FSDP, "--fsdp-manual-registration"], "--fsdp-manual-registration requires "
     "--use-nccl-ub", 1168),
    ([*SMALL, "--fsdp-manual-registration", "--use-nccl-ub"], "--fsdp-manual-registration "
     "requires --use-megatron-fsdp", 1167),
    ([*SMALL, "--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor requires "
     "--use-megatron-fsdp", 1621),
    ([*SMALL, "--ckpt-format", "torch_dcp"], "--ckpt-format torch_dcp requires --use-torch-fsdp2",
     1613),
    ([*TORCH_FSDP2, "--world-size", "8", "--tensor-model-parallel-size", "2", "--ckpt-format",
      "torch_dcp"], "--ckpt-format torch_dcp is not supported with --tensor-model-parallel-size",
     1615),
])
def test_each_sharded_dp_rule_is_refused_naming_its_flags(argv, message, line):
    with pytest.raises(ConfigError) as exc:
        preflight_config(argv)
    found = [(r.message, r.stage, r.line) for r in exc.value.refusals]
    assert any(m.startswith(message) and s == "validate_args" and n == line
               for m, s, n in found), found


def test_both_fsdp_flags_are_refused_whatever_the_checkpoint_format():
    # validate_args:1008 wants torch_dist/torch_dcp for torch FSDP2, :1146 fsdp_dtensor for
    # Megatron-FSDP: no format satisfies both, each refuses the other's.
    both = [*TORCH_FSDP2, "--use-megatron-fsdp"]
    found = _refusals(*both, "--ckpt-format", "fsdp_dtensor")
    assert [m.split(" (")[0] for m, _ in found] == [
        "--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp, got fsdp_dtensor"]
    found = _refusals(*both, "--ckpt-format", "torch_dist")
    assert [m.split(" (")[0] for m, _ in found] == [
        "--use-megatron-fsdp requires --ckpt-format fsdp_dtensor, got torch_dist"]


def test_megatron_fsdp_turns_the_distributed_optimizer_on_and_fsdp2_turns_fp8_gather_off():
    # validate_args:1111: Megatron-FSDP sets use_distributed_optimizer; so --overlap-param-gather
    # (:991) and --fp8-param-gather (:1061) pass without --use-distributed-optimizer.
    config = preflight_config([*MEGATRON_FSDP, "--overlap-grad-reduce", "--overlap-param-gather"])
    assert config.use_distributed_optimizer
    # validate_args:1016-1022 (TE >= 2.0): FSDP2 turns --fp8-param-gather off, so :1061 passes.
    fsdp2 = preflight_config([*TORCH_FSDP2, "--fp8-format", "hybrid", "--fp8-param-gather"])
    assert not fsdp2.fp8_param_gather


def test_the_twin_lists_the_sharded_path_as_not_twinned():
    for argv, start in ((MEGATRON_FSDP, "Megatron-FSDP (optim_grads_params) (--use-megatron-fsdp)"),
                        (TORCH_FSDP2, "torch FSDP2 (--use-torch-fsdp2)")):
        plan = plan_twin(preflight_config(argv), TwinOptions())
        assert any(item.startswith(start) for item in plan.not_twinned), plan.not_twinned


def test_a_passing_twin_says_the_sharded_path_was_not_checked():
    # A twin that matched refgrad (a minimal section): the verdict still names the launch's
    # Megatron-FSDP path as unchecked, and the DDP launch's verdict does not.
    section = {"run": True, "passed": True, "bitwise": True, "candidate": "fastgrad",
               "world_size": 4, "tp_size": 1, "steps": [{"stepped": True}],
               "not_twinned": ["x"]}
    for argv, says in ((MEGATRON_FSDP, True), (SMALL, False)):
        report = {"layout": []}
        write_sections(preflight_config(argv), report, [dict(section)])
        assert report["verdict"].startswith("PASS")
        assert ("the data-parallel path (Megatron-FSDP (optim_grads_params)) not checked"
                in report["verdict"]) is says, report["verdict"]


def test_ddps_fp32_reduce_scatter_finding_is_not_claimed_under_megatron_fsdp():
    # Finding 2 (the fp32-accumulating reduce-scatter with averaging in the collective) is in
    # DDP's param_and_grad_buffer.py; Megatron-FSDP's buffers never read the flag (only
    # distributed_data_parallel.py and param_and_grad_buffer.py of core/distributed do).
    flags = ["--ddp-reduce-scatter-with-fp32-accumulation", "--ddp-average-in-collective"]
    ddp = preflight_config([*SMALL, "--use-distributed-optimizer", *flags])
    fsdp = preflight_config([*MEGATRON_FSDP, *flags])
    assert "megatron-core-2" in {f.key for f in reached(launch_settings(ddp))}
    assert "megatron-core-2" not in {f.key for f in reached(launch_settings(fsdp))}


def test_the_report_shows_the_sharded_figures_only_under_fsdp():
    config = preflight_config([*MEGATRON_FSDP, "--data-parallel-sharding-strategy", "optim"])
    report = {"config": config.to_dict(), "sharded_dp": sharded_rows(config, chunk_layouts(config))}
    ((title, _, rows),) = sharded_tables(report)
    assert title.startswith("Megatron-FSDP (optim) in place of DDP (shards optimizer state over")
    assert rows[0][7].endswith("(reduce-scatter x 1)") and rows[0][8].endswith("(x 1)")
    assert sharded_tables({"config": preflight_config(SMALL).to_dict()}) == []


def test_torch_fsdp2_keeps_fp32_masters_of_bf16_params_only():
    # megatron/core/optimizer/__init__.py:638-684: bf16 params get Float16OptimizerWithFloat16Params
    # (fp32 masters), fp32 params FP32Optimizer (none); sharded with the params, 1/4 each.
    rows = {}
    for name, argv in (("bf16", TORCH_FSDP2), ("fp32", [t for t in TORCH_FSDP2 if t != "--bf16"])):
        config = preflight_config(argv)
        (rows[name],) = sharded_rows(config, chunk_layouts(config))
    assert rows["bf16"]["main_param_bytes"] == ELEMENTS / 4 * 4
    assert rows["fp32"]["main_param_bytes"] == 0
    assert rows["fp32"]["param_bytes"] == ELEMENTS / 4 * 4


def test_the_notes_give_the_sharded_grad_dtype_not_ddps_fp32_accumulation():
    ddp = "--bf16: Megatron accumulates and reduces grads in fp32"
    assert any(n.startswith(ddp) for n in preflight_config(SMALL).notes)
    for argv, own in ((MEGATRON_FSDP, "--use-megatron-fsdp: grads are kept in bf16 and reduced in bf16"),
                      (TORCH_FSDP2, "--use-torch-fsdp2: grads are kept and reduced in bf16")):
        notes = preflight_config(argv).notes
        assert not any(n.startswith(ddp) for n in notes), notes
        assert any(n.startswith(own) for n in notes), notes


def test_megatron_fsdp_with_experts_stays_not_modelled():
    with pytest.raises(FlagError) as exc:
        preflight_config([*MEGATRON_FSDP, "--num-experts", "2"])
    assert exc.value.messages[0].startswith("--use-megatron-fsdp: not modelled (Megatron-FSDP "
                                            "with experts")

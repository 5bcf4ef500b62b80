"""``--optimizer sgd``: read, checked and laid out as Megatron-LM core_r0.19.0 does.

Expected values are derived by hand from megatron-core 0.19.2's source, cited per test:
megatron/training/arguments.py (the defaults: --sgd-momentum 0.9 at :2516, --weight-decay
0.01 at :2501, --min-lr 0.0 at :2854, --lr None at :2847; validate_args:1319-1320
``assert args.min_lr <= args.lr``), megatron/core/optimizer/__init__.py (:618-624 builds
``SGD(param_groups, lr=config.lr, weight_decay=config.weight_decay,
momentum=config.sgd_momentum)`` with no init_state_fn; the grad scaler at :646-660; the
DistributedOptimizer at :666, Float16OptimizerWithFloat16Params at :680, FP32Optimizer at
:684), torch/optim/sgd.py and Transformer Engine's FusedSGD (``Invalid learning rate``,
``Invalid momentum value``, ``Invalid weight_decay value``, in that order; ``lr < 0.0`` on
None a TypeError; FusedSGD.get_momentums allocates every momentum buffer, torch.optim.SGD
only when momentum != 0), distrib_optimizer.py:688-694 (Adam only) and :445 (an fp32 copy of
a 16-bit param's shard), optimizer.py:1012 (an fp32 copy of every 16-bit param),
param_layout.py:24-33 (params start on 64 elements, bucket ends on lcm(DP, 128)).
"""

from __future__ import annotations

import pytest

from tests.verify.preflight_launch import parsed_launch, preflight_config
from verify.preflight.cli import build_report
from verify.preflight.config import ConfigError
from verify.preflight.flags import FlagError
from verify.preflight.paper import chunk_layouts, expert_chunk_layouts, optimizer_state_rows
from verify.preflight.render import report_tables
from verify.preflight.timing import CostInputs
from verify.preflight.twin import TwinOptions, plan_twin
from verify.preflight.twin.mapping import SGD_NOT_TWINNED

# One layer, h 64, vocabulary 128, RMSNorm, no biases, rope (no position embedding), tied at
# PP 1 (one weight): word embeddings 128 x 64 = 8,192; per layer 2 norms of 64, QKV
# [3 x 64, 64] = 12,288, proj 64 x 64 = 4,096, fc1 [4 x 64, 64] = 16,384, fc2 16,384; the
# final norm 64: 57,536 elements, every one a multiple of 64.
TOY = ["--world-size", "2", "--num-layers", "1", "--hidden-size", "64",
       "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
       "--padded-vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "2",
       "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
PARAMS = 8_192 + 64 + 12_288 + 4_096 + 64 + 16_384 + 16_384 + 64
SGD = ["--optimizer", "sgd", "--lr", "0.1"]


def _refusals(*argv: str) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        preflight_config([*TOY, *argv])
    return [(r.message, r.stage) for r in caught.value.refusals]


def _state(*argv: str) -> dict:
    config = preflight_config([*TOY, *argv])
    chunks = chunk_layouts(config)
    (row,) = optimizer_state_rows(config, chunks, expert_chunk_layouts(config))
    return row


def test_sgd_is_read_with_megatrons_defaults_and_in_the_json():
    config = preflight_config([*TOY, *SGD])
    choice = config.optimizer
    assert (choice.name, choice.lr, choice.sgd_momentum, choice.weight_decay, choice.min_lr) == (
        "sgd", 0.1, 0.9, 0.01, 0.0)
    assert config.to_dict()["optimizer"] == {
        "optimizer": "sgd", "lr": 0.1, "min_lr": 0.0, "weight_decay": 0.01, "sgd_momentum": 0.9,
        "state_tensors": ["momentum_buffer"], "state_tensors_torch_sgd": ["momentum_buffer"]}
    parsed = parsed_launch([*TOY, *SGD, "--sgd-momentum", "0.5"])
    assert parsed.unknown == [] and parsed.values["sgd_momentum"] == 0.5


def test_sgd_flags_are_ignored_under_adam_and_other_optimizers_refused():
    # --lr is read for every optimizer (validate_args:1319-1320 compares it with --min-lr).
    parsed = parsed_launch([*TOY, "--sgd-momentum", "0", "--lr", "0.1", "--weight-decay", "0"])
    assert parsed.unknown == ["--sgd-momentum 0", "--weight-decay 0"]
    assert preflight_config([*TOY, "--sgd-momentum", "0"]).optimizer.name == "adam"
    with pytest.raises(FlagError, match="--optimizer muon: not modelled"):
        parsed_launch([*TOY, "--optimizer", "muon"])


@pytest.mark.parametrize(("argv", "message", "stage"), [
    (["--optimizer", "sgd"], "--optimizer sgd needs --lr", "optimizer"),  # lr < 0.0 on None
    ([*SGD, "--sgd-momentum=-0.5"], "--sgd-momentum must be >= 0 ('Invalid momentum value: "
                                    "-0.5')", "optimizer"),
    ([*SGD, "--weight-decay=-0.1"], "--weight-decay must be >= 0 for --optimizer sgd",
     "optimizer"),
    ([*SGD, "--use-distributed-optimizer"], "--optimizer sgd cannot be used with "
                                            "--use-distributed-optimizer", "optimizer"),
    ([*SGD, "--min-lr", "1"], "--min-lr (1) must be <= --lr (0.1)", "validate_args"),
])
def test_each_sgd_rule_is_refused_at_megatrons_stage(argv, message, stage):
    (found,) = _refusals(*argv)
    assert found[0].startswith(message) and found[1] == stage


def test_sgd_refusals_come_in_megatrons_order():
    """The SGD constructor (__init__.py:618) before the grad scaler (:650, a constant scale
    must be > 0) before the DistributedOptimizer's assert (:666 -> :688)."""
    found = _refusals(*SGD, "--sgd-momentum=-1", "--use-distributed-optimizer", "--fp16",
                      "--loss-scale=-1")
    assert [m.split(" ", 1)[0] for m, _ in found] == ["--sgd-momentum", "--loss-scale",
                                                      "--optimizer"]


def test_momentum_zero_builds():
    # torch.optim.SGD and FusedSGD refuse momentum < 0 only: 0 builds.
    assert preflight_config([*TOY, *SGD, "--sgd-momentum", "0"]).optimizer.sgd_momentum == 0


def test_sgd_optimizer_state_per_rank():
    """bf16 without the distributed optimizer: Float16OptimizerWithFloat16Params, an fp32
    copy of each of the 57,536 elements (4 B) and one fp32 momentum buffer of the same size;
    at momentum 0 FusedSGD still allocates it, torch.optim.SGD does not; fp32 params:
    the FP32Optimizer steps them in place (no copy)."""
    row = _state("--bf16", *SGD)
    assert row["wrapper"] == "Float16OptimizerWithFloat16Params"
    assert row["elements"] == PARAMS == 57_536
    assert row["main_param_bytes"] == row["state_bytes"] == 4 * 57_536
    assert row["state_bytes_torch_sgd"] == 4 * 57_536
    zero = _state("--bf16", *SGD, "--sgd-momentum", "0")
    assert (zero["state_bytes"], zero["state_bytes_torch_sgd"]) == (4 * 57_536, 0)
    fp32 = _state(*SGD)
    assert (fp32["wrapper"], fp32["main_param_bytes"], fp32["state_bytes"]) == (
        "FP32Optimizer", 0, 4 * 57_536)


def test_adam_optimizer_state_with_and_without_the_distributed_optimizer():
    """Adam keeps two fp32 moments. Without the distributed optimizer over every param; with
    it over each rank's shard of the buffer: 57,536 elements padded to a multiple of
    lcm(DP 2, 128) = 128 is 57,600, a shard of 28,800 (the padding counted: a bound), an fp32
    copy of the bf16 shard (4 B) and 2 x 4 B of moments per element."""
    plain = _state("--bf16")
    assert (plain["elements"], plain["main_param_bytes"], plain["state_bytes"]) == (
        57_536, 4 * 57_536, 8 * 57_536)
    sharded = _state("--bf16", "--use-distributed-optimizer")
    assert sharded["wrapper"] == "DistributedOptimizer"
    assert (sharded["elements"], sharded["main_param_bytes"], sharded["state_bytes"]) == (
        28_800, 4 * 28_800, 8 * 28_800)


def test_the_report_carries_the_optimizer_state_and_the_twin_lists_the_sgd_step():
    argv = [*TOY, "--bf16", *SGD]
    config = preflight_config(argv)
    report = build_report(config, parsed_launch(argv), CostInputs())
    assert report["optimizer_state"][0]["state_tensors"] == ["momentum_buffer"]
    (table,) = [t for t in report_tables(report) if t[0].startswith("Optimizer state per rank")]
    # 4 x 57,536 B = 230,144 B = 224.75 KiB, the fp32 copy and the momentum buffer alike.
    assert table[2] == [["0", "sgd", "Float16OptimizerWithFloat16Params", "57,536",
                         "224.75 KiB", "224.75 KiB (momentum_buffer)", "224.75 KiB"]]
    assert report["config"]["optimizer"]["optimizer"] == "sgd"
    plan = plan_twin(config, TwinOptions())
    assert SGD_NOT_TWINNED in plan.not_twinned
    (row,) = [r for r in plan.mapping if r[0] == "optimizer"]
    assert row[1].startswith("SGD (momentum 0.9, weight decay 0.01, lr 0.1)")

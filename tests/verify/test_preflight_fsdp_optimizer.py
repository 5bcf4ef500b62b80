"""The optimizer under fully-sharded DP, and --lr / --min-lr for every optimizer.

Expected values are derived by hand from Megatron-LM core_r0.19.0 (megatron-core 0.19.2)
source, cited per test: megatron/training/arguments.py (validate_args:1106-1112
Megatron-FSDP turns --use-distributed-optimizer on; :1319-1320 ``if args.lr is not None:
assert args.min_lr <= args.lr``, whatever --optimizer is), megatron/core/optimizer/__init__.py
(:588-596 Adam's init_state_fn: exp_avg and exp_avg_sq, zeros_like the fp32 main params;
:618 SGD's momentum buffer, one per param), core/distributed/fsdp/src/megatron_fsdp/
megatron_fsdp.py:113-121 (what each strategy shards), core/distributed/
torch_fully_sharded_data_parallel.py (fully_shard: params, grads and optimizer state sharded
over DP x CP).
"""

from __future__ import annotations

import pytest

from tests.verify.preflight_launch import parsed_launch, preflight_config
from tests.verify.test_preflight_sharded_dp import ELEMENTS, MEGATRON_FSDP, SMALL, TORCH_FSDP2
from verify.preflight.cli import build_report
from verify.preflight.config import ConfigError
from verify.preflight.paper import (
    chunk_layouts,
    expert_chunk_layouts,
    optimizer_state_rows,
    sharded_rows,
)
from verify.preflight.render import report_tables
from verify.preflight.timing import CostInputs
from verify.preflight.twin import TwinOptions, plan_twin
from verify.preflight.twin.mapping import DDP_FOR_COMPARISON

# The small launch of test_preflight_sharded_dp (ELEMENTS derived by hand there) at world 4 ->
# DP 4: a rank's even quarter of its 82,240 elements is 20,560.
SHARE = ELEMENTS // 4
SGD = ["--optimizer", "sgd", "--lr", "0.1"]


def _tables(argv: list[str]) -> tuple[list[dict], list[dict]]:
    """(optimizer_state_rows, sharded_rows) of a launch."""
    config = preflight_config(argv)
    chunks = chunk_layouts(config)
    return (optimizer_state_rows(config, chunks, expert_chunk_layouts(config)),
            sharded_rows(config, chunks))


@pytest.mark.parametrize(("argv", "state_bytes"), [
    # SGD: one fp32 momentum buffer per element of the rank's quarter, 4 x 20,560.
    ([*TORCH_FSDP2, *SGD], 4 * SHARE),
    # Adam: two fp32 moments, 8 x 20,560.
    (TORCH_FSDP2, 8 * SHARE),
])
def test_torch_fsdp2_counts_the_optimizers_own_state(argv, state_bytes):
    (state,), (sharded,) = _tables(argv)
    assert sharded["optimizer_state_bytes"] == state_bytes
    # Both tables: the rank's quarter, an fp32 master of each bf16 element (4 B).
    assert state["elements"] == SHARE and state["state_bytes"] == state_bytes
    assert state["main_param_bytes"] == sharded["main_param_bytes"] == 4 * SHARE
    assert state["wrapper"] == "Float16OptimizerWithFloat16Params (torch FSDP2)"


def test_sgd_at_momentum_zero_under_fsdp2():
    """FusedSGD allocates the momentum buffer at momentum 0; torch.optim.SGD does not."""
    (state,), (sharded,) = _tables([*TORCH_FSDP2, *SGD, "--sgd-momentum", "0"])
    assert (state["state_bytes"], state["state_bytes_torch_sgd"]) == (4 * SHARE, 0)
    assert sharded["optimizer_state_bytes"] == 4 * SHARE


@pytest.mark.parametrize(("strategy", "elements"), [
    ("no_shard", ELEMENTS),  # nothing sharded: every element, not DDP's padded buffer / 4
    ("optim", SHARE),
    ("optim_grads", SHARE),
    ("optim_grads_params", SHARE),
])
def test_megatron_fsdp_optimizer_state_follows_the_strategy(strategy, elements):
    """Adam under Megatron-FSDP: 8 B of moments and an fp32 master (4 B, the default
    --megatron-fsdp-main-params-dtype) per element the rank steps, in both tables."""
    (state,), (sharded,) = _tables([*MEGATRON_FSDP, "--data-parallel-sharding-strategy",
                                    strategy])
    assert state["elements"] == elements
    assert state["state_bytes"] == sharded["optimizer_state_bytes"] == 8 * elements
    assert state["main_param_bytes"] == sharded["main_param_bytes"] == 4 * elements
    assert state["wrapper"] == f"DistributedOptimizer (Megatron-FSDP ({strategy}))"


def test_sgd_with_megatron_fsdp_names_the_flag_the_user_gave():
    """validate_args:1112 turns the distributed optimizer on; its assert (distrib_optimizer.py:
    688-694) refuses SGD. The user gave --use-megatron-fsdp, not --use-distributed-optimizer."""
    with pytest.raises(ConfigError) as caught:
        preflight_config([*MEGATRON_FSDP, *SGD])
    (refusal,) = [r for r in caught.value.refusals if r.message.startswith("--optimizer sgd")]
    assert refusal.message.startswith(
        "--optimizer sgd cannot be used with Megatron-FSDP's distributed optimizer (turned on "
        "by --use-megatron-fsdp, validate_args:1112)")
    assert "--use-distributed-optimizer" not in refusal.message


@pytest.mark.parametrize("optimizer", [[], ["--optimizer", "adam"], ["--optimizer", "sgd"]])
def test_min_lr_above_lr_is_refused_for_every_optimizer(optimizer):
    with pytest.raises(ConfigError) as caught:
        preflight_config([*SMALL, *optimizer, "--lr", "1e-4", "--min-lr", "1e-3"])
    assert [(r.message, r.stage) for r in caught.value.refusals] == [
        ("--min-lr (0.001) must be <= --lr (0.0001) (validate_args: assert args.min_lr <= "
         "args.lr)", "validate_args")]


def test_adam_reads_lr_and_min_lr_but_not_sgds_own_flags():
    argv = [*SMALL, "--lr", "1e-4", "--min-lr", "1e-5", "--weight-decay", "0.1",
            "--sgd-momentum", "0.5"]
    assert parsed_launch(argv).unknown == ["--weight-decay 0.1", "--sgd-momentum 0.5"]
    choice = preflight_config(argv).optimizer
    assert (choice.name, choice.lr, choice.min_lr) == ("adam", 1e-4, 1e-5)
    # No --lr: Megatron's rule is not applied (validate_args: `if args.lr is not None`).
    assert preflight_config([*SMALL, "--min-lr", "1"]).optimizer.min_lr == 1


def _report(argv: list[str]) -> dict:
    return build_report(preflight_config(argv), parsed_launch(argv), CostInputs())


def test_the_torch_sgd_column_only_for_sgd():
    def columns(argv: list[str]) -> list[str]:
        (table,) = [t for t in report_tables(_report(argv))
                    if t[0].startswith("Optimizer state per rank")]
        return table[1]
    assert "state (torch.optim.SGD)" not in columns(SMALL)
    assert "state (torch.optim.SGD)" in columns([*SMALL, *SGD])


def test_ddps_collectives_are_labelled_as_such_under_fsdp():
    def wire_title(argv: list[str]) -> str:
        (title,) = [t[0] for t in report_tables(_report(argv))
                    if t[0].startswith("Bytes sent per step by one rank of each stage")]
        return title
    assert DDP_FOR_COMPARISON in wire_title(TORCH_FSDP2)
    assert DDP_FOR_COMPARISON not in wire_title(SMALL)
    (sharded,) = [t for t in report_tables(_report(TORCH_FSDP2))
                  if "in place of DDP" in t[0]]
    assert "optimizer state" in sharded[1] and "Adam state" not in sharded[1]

    def production(argv: list[str]) -> dict[str, str]:
        return {s: p for s, p, _ in plan_twin(preflight_config(argv), TwinOptions()).mapping}
    fsdp, ddp = production(TORCH_FSDP2), production(SMALL)
    assert fsdp["grad reduction"].endswith(f"({DDP_FOR_COMPARISON})")
    assert fsdp["param all-gather"].endswith(f"({DDP_FOR_COMPARISON})")
    assert not any(DDP_FOR_COMPARISON in p for p in ddp.values())


def test_transformer_impl_is_not_read_for_torch_fsdp2():
    """torch_fully_sharded_data_parallel.py:114-120: --transformer-impl local only drops
    ColumnParallelLinear from the wrapped units, which changes no figure preflight counts
    (every param gathered as if in a unit); without experts it is listed as ignored."""
    assert "--transformer-impl local" in parsed_launch(
        [*TORCH_FSDP2, "--transformer-impl", "local"]).unknown

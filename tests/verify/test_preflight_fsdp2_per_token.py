"""Megatron-Core finding 8: torch FSDP2 with per-token loss leaves the grads undivided by the
step's token count, and ``verify preflight`` fails a launch that reaches it.

Hand-read in megatron-core 0.19.2 (/work/notes/mc19/megatron, branch core_r0.19.0):
core/distributed/finalize_model_grads.py:676-696 all-reduces num_tokens and calls every
chunk's ``scale_gradients(1 / num_tokens)``; torch_fully_sharded_data_parallel.py defines no
``scale_gradients``, so data_parallel_base.py:45's ``pass`` runs. DDP
(distributed_data_parallel.py:598) and Megatron-FSDP (fsdp/mcore_fsdp_adapter.py:231, bound to
megatron_fsdp.py:1446) divide their buffers. training.py get_model:1837-1843 picks the wrapper
from --use-torch-fsdp2 / --use-megatron-fsdp; arguments.py validate_args:997-1015 (the
--use-torch-fsdp2 rules) has none on --calculate-per-token-loss. The reproduction
(examples/megatron_core/repro_fsdp2_per_token_loss.py) measures it on Megatron-Core's own code.
"""

from __future__ import annotations

import json

import pytest

from tests.verify.preflight_launch import preflight_args, preflight_config
from tests.verify.test_preflight_sharded_dp import MEGATRON_FSDP, SMALL, TORCH_FSDP2
from verify.preflight import cli as preflight_cli
from verify.preflight.findings import fails_the_launch, launch_settings, reached
from verify.preflight.twin import TwinOptions, plan_twin

PER_TOKEN = "--calculate-per-token-loss"
KEY = "megatron-core-8"


def _keys(argv: list[str]) -> set[str]:
    return {f.key for f in reached(launch_settings(preflight_config(argv)))}


@pytest.mark.parametrize(("argv", "reaches"), [
    ([*TORCH_FSDP2, PER_TOKEN], True),
    # DP 1 too: FSDP2 sums over one rank (SUM), and the 1/T is still never applied.
    ([*TORCH_FSDP2, PER_TOKEN, "--world-size", "1", "--global-batch-size", "2"], True),
    (TORCH_FSDP2, False),  # the schedule divides each microbatch's loss by its tokens and M
    ([*SMALL, PER_TOKEN], False),  # DDP's scale_gradients divides its buffers
    ([*MEGATRON_FSDP, PER_TOKEN], False),  # Megatron-FSDP's adapter binds its buffer's
])
def test_the_finding_is_reached_by_fsdp2_with_per_token_loss_only(argv, reaches):
    assert (KEY in _keys(argv)) is reaches


def test_a_launch_reaching_it_fails_naming_it_and_one_without_per_token_loss_passes(capsys):
    for argv, code in (([*TORCH_FSDP2, PER_TOKEN], 1), (TORCH_FSDP2, 0),
                       ([*SMALL, PER_TOKEN], 0)):
        rc = preflight_cli.main(preflight_args([*argv, "--no-twin", "--no-progress"]),
                                environ={})
        out = capsys.readouterr().out
        assert rc == code, out
        named = "Megatron-Core finding 8 (wrong gradient)" in out
        assert named is (code == 1), out
        assert out.startswith("FAIL" if code == 1 else "PREFLIGHT PASSED"), out


def test_the_json_report_carries_it_as_failing_the_launch(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc = preflight_cli.main(preflight_args([*TORCH_FSDP2, PER_TOKEN, "--no-twin",
                                            "--no-progress", "--json", str(path)]), environ={})
    capsys.readouterr()
    report = json.loads(path.read_text())
    (entry,) = [f for f in report["findings"] if f["key"] == KEY]
    assert rc == 1 and report["passed"] is False
    assert entry["reached_by_launch"] and entry["fails_launch"]
    assert entry["reproduction"] == "examples/megatron_core/repro_fsdp2_per_token_loss.py"
    assert "scale_gradients(1/T) is a no-op on TorchFullyShardedDataParallel" in entry["title"]
    (finding,) = [f for f in reached(launch_settings(preflight_config([*TORCH_FSDP2, PER_TOKEN])))
                  if f.key == KEY]
    assert fails_the_launch(finding)


def test_the_twin_says_the_1_over_t_is_not_applied_under_fsdp2_only():
    """The twin's list of what it leaves out: under torch FSDP2 the 1/T never reaches the grads
    (data_parallel_base.py:45's no-op scale_gradients), so production's gradient is
    (1/(DP x CP)) x sum of token grads, T/(DP x CP) times the per-token mean the twin computes;
    DDP (distributed_data_parallel.py:598) and Megatron-FSDP (mcore_fsdp_adapter.py:231) divide
    after the reduction, the same gradient up to rounding when every token counts."""
    def per_token_entries(argv: list[str]) -> list[str]:
        plan = plan_twin(preflight_config([*argv, PER_TOKEN]), TwinOptions())
        return [g for g in plan.not_twinned if g.startswith(PER_TOKEN)]

    (fsdp2,) = per_token_entries(TORCH_FSDP2)
    assert "1/T of finalize_model_grads" in fsdp2 and "is not applied" in fsdp2
    assert "(Megatron-Core finding 8)" in fsdp2
    assert "T/(DP x CP) times the per-token mean" in fsdp2
    assert "does not reproduce that gradient" in fsdp2
    assert "the same gradient" not in fsdp2 and "multiplies them by 1/T" not in fsdp2
    for argv in (SMALL, MEGATRON_FSDP):
        (entry,) = per_token_entries(argv)
        assert "multiplies them by 1/T" in entry and "the same gradient up to rounding" in entry
        assert "finding 8" not in entry

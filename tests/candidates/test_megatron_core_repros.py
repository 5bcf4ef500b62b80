"""Every ``examples/megatron_core/repro_*.py`` shows its Megatron-Core bug on megatron-core 0.16.1.

Each script is run as a user runs it (a subprocess from the repository root) and must exit 1
with the line naming the bug and the evidence that the bug, not something else, tripped it.
When Megatron-Core fixes one, its script exits 0 and this test says which: update the
script's entry in examples/megatron_core/README.md and docs/megatron_core.md. The scripts'
own expectations are validated by their controls (README: the configuration that avoids
each bug exits 0). Skips, naming the reason, without megatron-core or on another version.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from verify.candidates.megatron_core.version import installed, missing_reason

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "megatron_core"
VERSION = "0.16.1"

# script -> what its output must contain while the bug is present
REPROS = {
    "repro_fp32_rs_rebinds_global.py": [
        "reduce_scatter_tensor before the fp32 DDP, reduce_scatter_with_fp32_accumulation after it",
        "got its OWN pre-scaled grads", "BUG: a DDP built after an fp32-accumulating one"],
    "repro_fp32_rs_with_avg.py": [
        "raised AssertionError('') at megatron/core/distributed/"
        "reduce_scatter_with_fp32_accumulation.py", "assert op == torch.distributed.ReduceOp.SUM",
        "BUG: reduce_scatter_with_fp32_accumulation + average_in_collective"],
    "repro_drain_one_deferred.py": [
        "deferred entries before the drain: 1 activation, 1 grad_output",
        "raised UnboundLocalError", "main_grad != expected", "BUG: the deferred microbatch's wgrad is lost"],
    "repro_drain_after_grad_sync.py": [
        "step 0 DP rank 0", "step 1 DP rank 1", "(all zero)",
        "BUG: the output layer's deferred wgrads were drained after grad_sync_func"],
    "repro_batched_p2p_pp2_vpp2.py": [
        "got losses (PP 2, VPP 2, batch_p2p_comm=True)", "BUG: with batch_p2p_comm at PP 2 + VPP 2"],
    "repro_stale_grad_output.py": [
        "after clear_embedding_activation_buffer: 0 activation, 1 grad_output",
        "main_grad != expected", "BUG: the abandoned step's grad_output was paired"],
}

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason())),
]


def test_every_repro_script_is_listed() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("repro_*.py")) == sorted(REPROS)


@pytest.mark.parametrize("script", sorted(REPROS))
def test_repro_shows_its_bug(script: str) -> None:
    if installed().version != VERSION:
        pytest.skip(f"the expected output is megatron-core {VERSION}'s; "
                    f"{installed().version} is installed")
    run = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, (f"{script} exited {run.returncode} (0: Megatron-Core fixed it?)"
                                 f"\n{run.stdout}\n{run.stderr[-3000:]}")
    for needle in REPROS[script]:
        assert needle in run.stdout, f"{script}: {needle!r} not in\n{run.stdout}"

"""Every ``examples/megatron_core/repro_*.py`` does what the installed megatron-core's source says.

Each script is run as a user runs it (a subprocess from the repository root). Where the
installed release has the bug (:data:`PRESENT`, read from that release's source: file and
function quoted per script), the script must exit 1 with the line naming the bug and the
evidence that the bug, not something else, tripped it; where the release fixed it, exit 0
saying so. The scripts' own expectations are validated by their controls (README: the
configuration that avoids each bug exits 0). Skips, naming the reason, without megatron-core
or on a release whose source was not read for :data:`PRESENT`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from verify.candidates.megatron_core.version import installed, missing_reason

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "megatron_core"

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
    "repro_fsdp2_per_token_loss.py": [
        "DistributedDataParallel step 1 rank 1: max |got - expected| 0, got/expected 1",
        # T / DP: 16 / 2 and 32 / 2 (the script's token masks)
        "TorchFullyShardedDataParallel step 0 rank 0", "got/expected 8",
        "TorchFullyShardedDataParallel step 1 rank 1", "got/expected 16",
        "BUG: with calculate_per_token_loss, TorchFullyShardedDataParallel's grads are not "
        "divided by the token count"],
}
# script -> release -> what its output must contain there instead of REPROS[script]
BY_RELEASE = {
    "repro_fsdp2_per_token_loss.py": {
        # 0.16.1: TorchFullyShardedDataParallel has no finish_grad_sync of its own, and
        # finalize_model_grads.py:443 passes force_all_reduce to _BaseDataParallel's.
        "0.16.1": [
            "DistributedDataParallel step 1 rank 1: max |got - expected| 0, got/expected 1",
            "raised TypeError(\"_BaseDataParallel.finish_grad_sync() got an unexpected keyword "
            "argument 'force_all_reduce'\") at megatron/core/distributed/finalize_model_grads.py",
            "BUG (before the scaling): every TorchFullyShardedDataParallel step fails"],
    },
}

# release -> the scripts whose bug its source has, read in megatron/core/ of each wheel. In
# 0.19.2 the code each bug lives in is that of 0.16.1 ("identical": the function's source is
# the same; otherwise what changed around it, none of it on the bug's path):
# - fp32_rs_rebinds_global: distributed/param_and_grad_buffer.py
#   _ParamAndGradBucketGroup.__init__ still does `global dist_reduce_scatter_func;
#   dist_reduce_scatter_func = reduce_scatter_with_fp32_accumulation`, and start_grad_sync
#   keeps the coalescing manager's handle unless its own config asks for fp32 accumulation
#   (0.19.2 also requires use_distributed_optimizer there, and adds a predecessor drain
#   linked only when the DDP's own flag is on).
# - fp32_rs_with_avg: distributed/reduce_scatter_with_fp32_accumulation.py
#   reduce_scatter_with_fp32_accumulation `assert op == torch.distributed.ReduceOp.SUM`
#   (file identical); distributed_data_parallel_config.py __post_init__ checks neither pair.
# - drain_one_deferred: utils.py drain_embedding_wgrad_compute (identical): `drain_idx` bound
#   only inside the loop over the entries after the first.
# - drain_after_grad_sync: pipeline_parallel/schedules.py
#   forward_backward_pipelining_without_interleaving calls config.grad_sync_func before
#   finish_embedding_wgrad_compute (identical order).
# - batched_p2p_pp2_vpp2: pipeline_parallel/p2p_communication.py _batched_p2p_ops and
#   P2PCommunicator._communicate (identical; 0.19.2 adds stage properties to
#   P2PCommunicator); model_parallel_config.py
#   ModelParallelConfig.batch_p2p_comm defaults to True.
# - stale_grad_output: pipeline_parallel/schedules.py clear_embedding_activation_buffer
#   (identical): clears embedding_activation_buffer only.
# - fsdp2_per_token_loss: distributed/torch_fully_sharded_data_parallel.py defines no
#   scale_gradients in either release (data_parallel_base.py's is `pass`); 0.19.2's
#   finalize_model_grads calls it with 1/num_tokens; 0.16.1's fails earlier (BY_RELEASE).
PRESENT = {
    "0.16.1": set(REPROS),
    "0.19.2": set(REPROS),
}

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason())),
]


def test_every_repro_script_is_listed() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("repro_*.py")) == sorted(REPROS)


@pytest.mark.parametrize("script", sorted(REPROS))
def test_repro_shows_its_bug_where_the_release_has_it(script: str) -> None:
    version = installed().version
    if version not in PRESENT:
        pytest.skip(f"megatron-core {version}'s source was not read for this test "
                    f"(read: {', '.join(PRESENT)})")
    run = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert f"megatron-core {version}" in run.stdout.splitlines()[0], run.stdout
    if script not in PRESENT[version]:
        assert run.returncode == 0, f"{script} exited {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
        assert f"fixed in megatron-core {version}" in run.stdout, run.stdout
        return
    assert run.returncode == 1, (f"{script} exited {run.returncode} (0: fixed in {version}?)"
                                 f"\n{run.stdout}\n{run.stderr[-3000:]}")
    for needle in BY_RELEASE.get(script, {}).get(version, REPROS[script]):
        assert needle in run.stdout, f"{script}: {needle!r} not in\n{run.stdout}"

"""Every ``examples/torch/repro_*.py`` shows its torch finding on the installed torch.

Each script is run as a user runs it (a subprocess from the repository root) and must exit 1
with the lines that show the behaviour, and its control's line. When torch changes one, its
script exits 0 and this test says which: update examples/torch/README.md and the finding in
``verify/candidates/torch_ddp/findings.py`` or ``torch_fsdp2/findings.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "torch"

REPROS = {
    "repro_ddp_bucket_view_average.py": [
        "elements differ between iteration 1 and 2", "control (gradient_as_bucket_view=False): 0 differ",
        "BUG: with gradient_as_bucket_view and grads zeroed in place"],
    "repro_fsdp2_divide_factor_gloo.py": [
        "RuntimeError('Cannot use ReduceOp.PREMUL_SUM with Gloo')",
        "control (set_force_sum_reduction_for_comms(True)): the sum",
        "BUG: FSDP2's set_gradient_divide_factor"],
}

pytestmark = pytest.mark.dist


def test_every_repro_script_is_listed() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("repro_*.py")) == sorted(REPROS)


@pytest.mark.parametrize("script", sorted(REPROS))
def test_repro_shows_its_finding(script: str) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, f"{script} exited {done.returncode} (0: torch fixed it)\n{done.stdout}"
    for line in REPROS[script]:
        assert line in done.stdout, f"{script}: {line!r} not in\n{done.stdout}\n{done.stderr[-2000:]}"

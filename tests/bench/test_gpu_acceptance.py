"""``bench/gpu_acceptance.sh`` rehearsed on the CPU: every step recorded, CUDA-only steps skipped.

The script is what the first session with a lent GPU runs in one call, so everything but
the GPU itself is exercised here: its smoke mode (``GPU_ACCEPTANCE_SMOKE=1``) with CUDA
hidden runs each CUDA-only step's command on the CPU as a rehearsal and records the step
as skipped for lack of CUDA, with the rehearsal's exit code; the device tool brings back
at most 8 files, none deeper than one folder, named in letters, digits, '.', '_', '-'.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from verify.candidates.megatron_core.version import missing_reason as megatron_missing

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_acceptance.sh"
CUDA_STEPS = ("pytest-gpu", "bench-gpu-kernels", "verify-run", "train-gpt", "verify-megatron")
ANY_STEPS = ("env", "pytest-all")
STATUS_LINE = re.compile(r"^(\S+)\s+(ok|failed|timeout|skipped)\s+rc=(\S+)\s+(\d+)s ?(.*)$")
# The script's own budget (smoke default 1800 s) ends every step first; this only stops a hang.
TIMEOUT_S = 2400


def _environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="",  # the same answers on a GPU node
               GPU_ACCEPTANCE_WHEELS=str(tmp_path / "no-wheels"),  # .whl/ holds another Python's
               **extra)
    env.pop("PYTHONPATH", None)  # the script puts the checkout first itself
    return env


def _status(out: Path) -> dict[str, tuple[str, str, str]]:
    steps = {}
    for line in (out / "status.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        match = STATUS_LINE.match(line)
        assert match, f"status line not in the documented form: {line!r}"
        name, state, rc, _seconds, note = match.groups()
        assert name not in steps, f"step {name} recorded twice"
        steps[name] = (state, rc, note)
    return steps


@pytest.mark.dist  # its verify run and torchrun rehearsals start torch.distributed processes
def test_smoke_run_on_the_cpu_records_every_step_and_skips_the_cuda_ones(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True,
                         env=_environment(tmp_path, OUT=str(out), GPU_ACCEPTANCE_SMOKE="1"),
                         timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]

    entries = list(out.iterdir())
    assert 1 <= len(entries) <= 8, sorted(e.name for e in entries)
    for entry in entries:
        assert entry.is_file(), f"{entry.name}: the results folder holds files only"
        assert re.fullmatch(r"[A-Za-z0-9._-]+", entry.name), entry.name

    steps = _status(out)
    assert set(steps) == {"wheels", *ANY_STEPS, *CUDA_STEPS}, sorted(steps)
    assert steps["wheels"][0] == "skipped" and steps["wheels"][2].startswith("no wheels in ")
    for name in ANY_STEPS:
        assert steps[name][:2] == ("ok", "0"), (name, steps[name])
    rehearsed = set(CUDA_STEPS)
    if megatron_missing() is not None:  # said, not rehearsed
        assert steps["verify-megatron"] == ("skipped", "-", megatron_missing())
        rehearsed.remove("verify-megatron")
    for name in rehearsed:
        state, rc, note = steps[name]
        assert state == "skipped" and rc == "0", (name, steps[name])
        assert note.startswith("CUDA is not available; CPU rehearsal rc=0 (ok)"), (name, note)

    with tarfile.open(out / "logs.tar.gz") as archive:
        logged = {Path(n).name for n in archive.getnames()}
    ran = set(ANY_STEPS) | rehearsed
    assert {f"{name}.log" for name in ran} <= logged, sorted(logged)
    summary = (out / "summary.md").read_text()
    assert "goal MET    bitwise checks equal to refgrad" in summary
    assert "CUDA is not available; CPU rehearsal" in summary and "results in" in run.stdout


def test_a_full_run_without_cuda_skips_the_cuda_steps_without_running_them(tmp_path):
    """No smoke mode, no CUDA: the CUDA steps are not rehearsed; a tiny budget ends the suite."""
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True,
                         env=_environment(tmp_path, OUT=str(out), GPU_ACCEPTANCE_BUDGET_S="0"),
                         timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    steps = _status(out)
    for name in CUDA_STEPS:
        assert steps[name] == ("skipped", "-", "CUDA is not available"), (name, steps[name])
    for name in ANY_STEPS:  # the budget is spent before any step can start
        assert steps[name][0] == "skipped" and steps[name][2].startswith("out of time budget")


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("NGPU", "0", "NGPU must be a positive integer, got '0'"),
    ("NGPU", "two", "NGPU must be a positive integer, got 'two'"),
    ("GPU_ACCEPTANCE_SMOKE", "yes", "GPU_ACCEPTANCE_SMOKE must be 0 or 1, got 'yes'"),
    ("GPU_ACCEPTANCE_BUDGET_S", "7m", "GPU_ACCEPTANCE_BUDGET_S must be whole seconds, got '7m'"),
])
def test_bad_settings_are_refused_by_name_before_any_work(tmp_path, variable, value, message):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True,
                         env=_environment(tmp_path, OUT=str(out), **{variable: value}), timeout=TIMEOUT_S)
    assert run.returncode == 2 and message in run.stderr, (run.returncode, run.stderr)
    assert not out.exists()

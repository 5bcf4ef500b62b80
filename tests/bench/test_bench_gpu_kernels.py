"""``bench/bench_gpu_kernels.py``: skips cleanly without CUDA, and judges its goals as stated.

Its GPU figures are only made on a GPU (``bench/gpu_acceptance.sh``); the smoke run in
``test_gpu_acceptance.py`` rehearses all of its code on the CPU. Here: the skip, the usage
error, and the verdict arithmetic on hand-chosen figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(BENCH / "bench_gpu_kernels.py"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_without_cuda_it_says_it_skipped_and_exits_0(tmp_path):
    report = tmp_path / "kernels.json"
    run = _run("--json", str(report), tmp_path=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "skipped: CUDA is not available" in run.stdout and "Traceback" not in run.stderr
    assert json.loads(report.read_text())["skipped"] == "CUDA is not available"


def test_device_cuda_without_cuda_is_a_usage_error_naming_the_flag(tmp_path):
    run = _run("--device", "cuda", tmp_path=tmp_path)
    assert run.returncode == 2
    assert "--device cuda was given but CUDA is not available" in run.stderr


@pytest.fixture(scope="module")
def kernels():
    sys.path.insert(0, str(BENCH))  # bench/ scripts import each other as top-level modules
    try:
        import bench_gpu_kernels
    finally:
        sys.path.remove(str(BENCH))
    return bench_gpu_kernels


def test_goal_verdicts_and_their_lines(kernels):
    # 0.89 of copy bandwidth against a 90% goal: missed by one point.
    missed = kernels.judge("reduction", 0.89, 0.90, judged=True)
    assert missed.met is False
    assert missed.line() == "goal MISSED reduction: 89.0% (goal >= 90%; short by 1.0 points)"
    assert kernels.judge("mxfp8", 0.80, 0.80, judged=True).met is True  # ">= 80%": the edge meets
    no_figure = kernels.judge("gemm", None, 0.95, judged=True, note="RuntimeError: x")
    assert no_figure.met is False
    assert no_figure.line() == "goal MISSED gemm: no figure (goal >= 95%; RuntimeError: x)"
    rehearsal = kernels.judge("gemm", 0.5, 0.95, judged=False)
    assert rehearsal.met is None and rehearsal.line().startswith("goal n/a    gemm: 50.0%")


def test_sizes_keep_one_shard_a_multiple_of_16_and_one_not(kernels):
    for device, quick in (("cuda", False), ("cuda", True), ("cpu", True)):
        shards = kernels.sizes_for(device, quick).shards
        assert shards[0] % 16 == 0 and shards[1] % 16 != 0, (device, quick, shards)
    with pytest.raises(ValueError, match="shards must be"):
        kernels.Sizes(shards=(32, 64), mxfp8_numel=1024, gemm=(1, 1, 1), repeats=1)
    with pytest.raises(ValueError, match="mxfp8_numel must be a multiple of 1024"):
        kernels.Sizes(shards=(32, 33), mxfp8_numel=1000, gemm=(1, 1, 1), repeats=1)

"""``bench/bench_suite_loaded.py``: every leg's pytest summary is kept, and which leg it is.

``--suite`` runs ``scripts/test.sh``, two pytest sessions (the main suite, then the
megatron-core 0.19.2 leg); the second's closing line once hid the first's. Here the bench
runs a command that only prints a recorded-style output of both legs (and a ``-q`` one,
which has no header): no suite runs, no spinners, no rank readings.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.timeouts import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]

# Shaped like bench/results/suite_loaded_all_bca31b4_cpu.txt, with fewer lines between.
FAKE_OUTPUT = """\
============================= test session starts ==============================
platform linux -- Python 3.11.7, pytest-9.2.0, pluggy-1.7.0
rootdir: /work/main
FAILED tests/verify/test_cli.py::test_list - AssertionError
========== 1 failed, 2006 passed, 27 skipped, 38 warnings in 1831.81s (0:30:31) ==========
test-megatron-019: Python 3.12.1, torch 2.13.0, megatron-core 0.19.2
============================= test session starts ==============================
platform linux -- Python 3.12.1, pytest-9.2.0, pluggy-1.7.0
rootdir: /work/main
================= 81 passed, 40 warnings in 435.48s (0:07:15) ==================
3 passed in 2.50s
"""

EXPECTED_LEGS = [
    {"leg": 1, "python": "3.11.7",
     "summary": "1 failed, 2006 passed, 27 skipped, 38 warnings in 1831.81s (0:30:31)"},
    {"leg": 2, "python": "3.12.1", "summary": "81 passed, 40 warnings in 435.48s (0:07:15)"},
    {"leg": 3, "python": None, "summary": "3 passed in 2.50s"},
]


def test_every_legs_summary_is_kept_with_its_leg_in_the_json_and_the_text(tmp_path):
    fake = tmp_path / "pytest_output.txt"
    fake.write_text(FAKE_OUTPUT)
    out = tmp_path / "loaded"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_suite_loaded.py"), "--busy", "0",
         "--settle", "0", "--signals-s", "0", "--command", f"cat {shlex.quote(str(fake))}",
         "--out", str(out)],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
        timeout=HANG_GUARD_S)
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(Path(f"{out}.json").read_text())["runs"]
    assert row["pytest_legs"] == EXPECTED_LEGS
    assert row["failed_tests"] == ["FAILED tests/verify/test_cli.py::test_list - AssertionError"]
    legs_line = ("leg 1 (Python 3.11.7): 1 failed, 2006 passed, 27 skipped, 38 warnings in "
                 "1831.81s (0:30:31); leg 2 (Python 3.12.1): 81 passed, 40 warnings in 435.48s "
                 "(0:07:15); leg 3: 3 passed in 2.50s")
    assert legs_line in run.stdout
    assert f"===== {legs_line}\n" in Path(f"{out}.txt").read_text()

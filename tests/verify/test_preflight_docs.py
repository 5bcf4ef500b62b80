"""Every ``$ verify preflight`` launch line of README.md and docs/*.md is a valid launch.

Each line is preflight's own options, then (after ``--``) a Megatron-LM launch line that
preflight reads with Megatron-LM's flag table and accepts. That Megatron-LM itself accepts
the same flags is checked by the differential harness (``dev/megatron_diff``, source
"docs"), which needs Megatron-LM's source and is not part of the suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.verify.doc_launches import doc_launch_lines
from tests.verify.preflight_launch import preflight_config, split_argv
from verify.preflight.flags import MEGATRON_FLAGS

REPO = Path(__file__).resolve().parents[2]
LINES = doc_launch_lines(REPO)


def test_the_docs_launch_lines_are_found():
    # README's two examples and docs/preflight.md's two GPT-3 lines, at least.
    files = {where.split(":")[0] for where, _ in LINES}
    assert len(LINES) >= 4 and {"README.md", "docs/preflight.md"} <= files


@pytest.mark.parametrize(("where", "argv"), LINES, ids=[where for where, _ in LINES])
def test_every_docs_launch_line_is_accepted(where, argv):
    world, launch = split_argv(argv)
    assert world is not None, f"{where}: give the world size (--world-size) before `--`"
    assert "--" in argv and argv.index("--") < argv.index(launch[0]), (
        f"{where}: the launch's Megatron-LM flags go after `--`")
    flags = [t.partition("=")[0] for t in launch if t.startswith("--")]
    assert all(f in MEGATRON_FLAGS for f in flags), where
    config = preflight_config(argv)
    assert config.world_size == world

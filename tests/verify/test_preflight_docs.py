"""Every ``$ verify preflight`` launch line of README.md and docs/*.md is a valid launch.

Each line is preflight's own options, then (after ``--``) a Megatron-LM launch line that
preflight reads with Megatron-LM's flag table and accepts. That Megatron-LM itself accepts
the same flags is checked by the differential harness (``dev/megatron_diff``, source
"docs"), which needs Megatron-LM's source and is not part of the suite.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.verify.doc_launches import doc_launch_lines
from tests.verify.preflight_launch import preflight_config, split_argv
from verify.preflight.flags import MEGATRON_FLAGS, NOT_MODELLED, flag_of

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


def test_the_not_modelled_list_names_each_refused_flag_once():
    """docs/preflight.md's one "not modelled" list names every flag NOT_MODELLED refuses exactly
    once, and the two resolve.py refuses (--position-embedding-type relative,
    --step-batch-size-schedule); every flag it names is one of Megatron-LM's."""
    text = (REPO / "docs" / "preflight.md").read_text()
    start = text.index('is **refused as "not modelled"**')
    listed = text[start:text.index("**listed as ignored**", start)]
    named = re.findall(r"`(--[a-z0-9-]+)", listed)
    assert named and all(flag in MEGATRON_FLAGS for flag in named), named
    refused = [flag_of(dest, {}) for dest in NOT_MODELLED]
    for flag in [*refused, "--position-embedding-type", "--step-batch-size-schedule"]:
        assert named.count(flag) == 1, (flag, named.count(flag))
    assert text.count('refused as "not modelled"**') == 1

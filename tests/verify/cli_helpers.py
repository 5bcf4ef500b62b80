"""Shared assertions for tests that drive the real ``verify`` entry point."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from verify import cli


def assert_help_and_usage_errors(capsys, command: str, help_mentions: str,
                                 usage_errors: Sequence[Sequence[str]]) -> None:
    """``verify COMMAND --help`` exits 0 and mentions ``help_mentions``; each argv in
    ``usage_errors`` (after COMMAND) is refused by argparse with exit code 2."""
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    assert help_mentions in capsys.readouterr().out
    for argv in usage_errors:
        with pytest.raises(SystemExit) as info:
            cli.main([command, *argv])
        assert info.value.code == 2, argv

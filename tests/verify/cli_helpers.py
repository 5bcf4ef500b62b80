"""Shared assertions for tests that drive the real ``verify`` entry point."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

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


def interrupt_after_line(argv: Sequence[str], when: Callable[[str], bool], cwd: Path,
                         env: dict[str, str], *, signals: int = 1,
                         timeout_s: float = 300) -> tuple[int, str, str]:
    """Run ``python -m verify *argv`` in a session of its own and send its process group
    SIGINT (as a terminal's Ctrl-C) once a line of its stderr satisfies ``when``; ``signals``
    SIGINTs in a row. Returns (exit code, stdout, stderr). Driven by the command's own
    progress lines, never by sleeps; a command that ends without such a line fails."""
    proc = subprocess.Popen([sys.executable, "-m", "verify", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()
    err: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                pytest.fail(f"the command ended before the line to interrupt at: {''.join(err)}")
            err.append(line)
            if when(line):
                break
        for _ in range(signals):
            os.killpg(proc.pid, signal.SIGINT)
        out = proc.stdout.read()
        proc.wait(timeout=timeout_s)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    while not lines.empty():
        line = lines.get()
        if line is not None:
            err.append(line)
    return proc.returncode, out, "".join(err)

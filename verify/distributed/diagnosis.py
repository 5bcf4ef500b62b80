"""What a stalled rank was doing: its process state and, if it can answer, its Python stack.

Each rank registers :mod:`faulthandler` on SIGUSR1 with a file of its own (see
``_child.rank_main``). faulthandler's handler is plain C: it dumps the Python
frames of every thread even while the rank is blocked inside a gloo collective
and holds no GIL. A rank frozen with SIGSTOP cannot run it; its state in
``/proc`` says so instead, and its last progress marker is all there is.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from verify.distributed.errors import RankState
from verify.distributed.progress import ProgressBoard
from verify.distributed.stall import RUNNABLE, thread_readings

# The frame of the harness's own entry point: frames above it belong to the rank function.
ENTRY_FUNCTION = "rank_main"
_FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>\S+)')
_STACK_FRAMES_SHOWN = 6
# How long ranks get to write their stacks; a rank that can run answers in milliseconds.
STACK_DUMP_WAIT_S = 1.5
# ... and, in all, up to this long while a rank that has not answered has a runnable
# thread: on a starved machine it waits for a CPU to run the handler (measured at load
# 30-37: a blocked rank, woken by the signal, missed 1.5 s in two runs out of two).
STACK_DUMP_STARVED_WAIT_S = 6.0


def process_state(pid: int | None, exitcode: int | None) -> str:
    """'running', 'stopped (SIGSTOP or a debugger)' or how the process ended."""
    if pid is None:
        return "not started"
    if exitcode is not None:
        if exitcode < 0:
            return f"killed by {signal.Signals(-exitcode).name}"
        return f"exited with code {exitcode}"
    try:
        # Field 3 of /proc/PID/stat, after the parenthesised command name.
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "running"
    return "stopped (SIGSTOP or a debugger)" if state in ("T", "t") else "running"


def request_stack_dumps(pids: dict[int, int], stack_files: dict[int, Path]) -> dict[int, str]:
    """SIGUSR1 each rank in ``pids``, wait (bounded) for the dumps; rank -> dump text.

    Only for ranks that have marked progress: SIGUSR1 kills a process whose handler
    is not registered yet, and ``rank_main`` registers it before its first marker.
    Waits STACK_DUMP_WAIT_S, and up to STACK_DUMP_STARVED_WAIT_S while a rank that
    has not answered is runnable (waiting for a CPU to run its handler).
    """
    asked = []
    for rank, pid in pids.items():
        try:
            os.kill(pid, signal.SIGUSR1)
            asked.append(rank)
        except OSError:
            pass
    start = time.monotonic()
    dumps: dict[int, str] = {}
    while asked:
        for rank in list(asked):
            text = stack_files[rank].read_text(errors="replace") if stack_files[rank].exists() else ""
            # The dump ends with the outermost frame, ours: wait for it to be complete.
            if ENTRY_FUNCTION in text:
                dumps[rank] = text
                asked.remove(rank)
        waited = time.monotonic() - start
        if not asked or waited >= STACK_DUMP_STARVED_WAIT_S or (
                waited >= STACK_DUMP_WAIT_S and not any(_runnable(pids[r]) for r in asked)):
            break
        time.sleep(0.05)
    return dumps


def _runnable(pid: int) -> bool:
    """Whether a thread of ``pid`` is running or waiting for a CPU (False: cannot tell)."""
    return any(thread.state == RUNNABLE for thread in thread_readings(pid) or ())


def rank_frames(dump: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the thread running the rank function, most recent first,
    ending just above the harness's entry point."""
    for block in dump.split("\n\n"):
        frames = [(m["file"], int(m["line"]), m["func"]) for m in _FRAME.finditer(block)]
        names = [f for _, _, f in frames]
        if ENTRY_FUNCTION in names:
            return frames[: names.index(ENTRY_FUNCTION)]
    return []


def _short(path: str) -> str:
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


def summarize_frames(frames: list[tuple[str, int, str]]) -> str | None:
    """One line: the torch.distributed call the rank is in, and who called it."""
    if not frames:
        return None
    inside = 0
    while inside < len(frames) and f"{os.sep}torch{os.sep}distributed{os.sep}" in frames[inside][0]:
        inside += 1
    if inside < len(frames):
        file, line, func = frames[inside]
        caller = f"{_short(file)}:{line} ({func})"
    else:  # called by rank_main itself: init_process_group or the final barrier
        caller = f"the harness ({ENTRY_FUNCTION})"
    if inside == 0:
        return f"at {caller}"
    # The public API is the outermost torch frame that is not a decorator's wrapper.
    public = [f for _, _, f in frames[:inside] if not f.startswith("_") and f != "wrapper"]
    api = public[-1] if public else frames[inside - 1][2]
    return f"in torch.distributed.{api}, called from {caller}"


def diagnose(
    ranks: list[int],
    pids: dict[int, int],
    exitcodes: dict[int, int | None],
    board: ProgressBoard,
    dumps: dict[int, str],
) -> dict[int, RankState]:
    """A RankState for each of ``ranks`` from what was collected before killing them."""
    states = {}
    for rank in ranks:
        marker = board.read(rank)
        frames = rank_frames(dumps.get(rank, ""))
        states[rank] = RankState(
            rank=rank,
            pid=pids.get(rank),
            process=process_state(pids.get(rank), exitcodes.get(rank)),
            marker=marker[0] if marker else None,
            marker_age_s=marker[1] if marker else None,
            location=summarize_frames(frames),
            stack=tuple(f"{_short(f)}:{n} in {fn}" for f, n, fn in frames[:_STACK_FRAMES_SHOWN]),
        )
    return states

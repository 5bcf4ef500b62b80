"""Terminal output of the ``verify`` commands: progress on stderr, widths that fit.

Progress is drawn with ``rich`` (bar, elapsed time, estimate of the time left) when
stderr is a terminal, and degrades to one plain line per step otherwise (CI logs).
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import time
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

DEFAULT_WIDTH = 100
# Columns of a text report written off a terminal (CI logs, files, pipes): folded at 80 or
# 100 columns its tables and labels lose their ends.
NON_TERMINAL_WIDTH = 200


def terminal_width(stream: TextIO | None = None) -> int:
    """Columns of the terminal ``stream`` writes to; ``$COLUMNS`` or 100 when not a terminal."""
    stream = stream if stream is not None else sys.stdout
    try:
        if stream.isatty():
            return max(40, shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)
    except (AttributeError, ValueError):  # a closed or unusual stream
        pass
    try:
        return max(40, int(os.environ.get("COLUMNS", DEFAULT_WIDTH)))
    except ValueError:
        return DEFAULT_WIDTH


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


def report_width(stream: TextIO | None = None, *, unlimited_off_terminal: bool = False) -> int:
    """The width of a text report: the terminal's; off a terminal at least
    :data:`NON_TERMINAL_WIDTH` columns, or no limit with ``unlimited_off_terminal``."""
    stream = stream if stream is not None else sys.stdout
    if _is_terminal(stream):
        return terminal_width(stream)
    return 1_000_000 if unlimited_off_terminal else max(terminal_width(stream), NON_TERMINAL_WIDTH)


def emit(text: str) -> None:
    """Print to stdout; a reader that went away (``| head``) silences the rest, no traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def render_rich(renderable: Any, width: int) -> str:
    """A rich renderable (e.g. a Table) as plain text of at most ``width`` columns."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False,
            legacy_windows=False).print(renderable)
    return buffer.getvalue().rstrip("\n")


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


class StepProgress:
    """Progress over weighted steps (weights: rough seconds) with an estimate of the time left.

    Use as a context manager; :meth:`step` announces the next step, :meth:`advance`
    marks work done. Disabled instances print nothing.
    """

    def __init__(self, total: float, description: str, *, enabled: bool = True,
                 stream: TextIO | None = None, steps: int | None = None) -> None:
        if not total > 0:
            raise ValueError(f"total must be > 0, got {total}")
        self.total = float(total)
        self.description = description
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0.0
        self.steps = 0
        self.finished = 0  # steps reported done (advance with a label)
        self.step_count = steps  # when given, plain lines count finished steps ("3/8") not weight
        self.start = time.perf_counter()
        self._rich: Progress | None = None
        self._task: Any = None
        try:
            self._tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self._tty = False

    def __enter__(self) -> StepProgress:
        self.start = time.perf_counter()
        if self.enabled and self._tty:
            self._rich = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                TaskProgressColumn(), TimeElapsedColumn(), TextColumn("eta"),
                TimeRemainingColumn(), console=Console(file=self.stream), transient=True,
            )
            self._rich.__enter__()
            self._task = self._rich.add_task(self.description, total=self.total)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._rich is not None:
            self._rich.__exit__(exc_type, exc, tb)
            self._rich = None

    def remaining_estimate(self) -> float | None:
        """Seconds left, extrapolated from the work done so far (None before any)."""
        if self.done <= 0:
            return None
        elapsed = time.perf_counter() - self.start
        return elapsed / self.done * (self.total - self.done)

    def step(self, label: str, expected: float | None = None) -> None:
        """Announce the next step (``expected``: its rough seconds, shown in plain mode)."""
        self.steps += 1
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, description=f"{self.description}: {label}")
            return
        elapsed = time.perf_counter() - self.start
        left = self.remaining_estimate()
        if left is None and expected is not None:
            left = self.total  # before any step finished, the rough total is the estimate
        eta = f", about {_duration(left)} left" if left is not None else ""
        print(f"[{self.description}] {label} ({_duration(elapsed)} elapsed{eta})",
              file=self.stream, flush=True)

    def advance(self, amount: float = 1.0, label: str | None = None) -> None:
        """Mark ``amount`` of the total as done (``label``: the step that finished)."""
        self.done = min(self.total, self.done + amount)
        if label is not None:
            self.finished += 1
        if not self.enabled:
            return
        if self._rich is not None:
            kwargs = {"description": f"{self.description}: {label}"} if label else {}
            self._rich.update(self._task, completed=self.done, **kwargs)
        elif label is not None:
            elapsed = time.perf_counter() - self.start
            left = self.remaining_estimate()
            eta = f", about {_duration(left)} left" if left and self.done < self.total else ""
            # Finished, not announced, steps: concurrent checks are announced once together.
            count = (f"{self.finished}/{self.step_count}" if self.step_count
                     else f"{self.done:.4g}/{self.total:g}")
            print(f"[{self.description}] {label} ({count}, {_duration(elapsed)} elapsed{eta})",
                  file=self.stream, flush=True)

"""Ctrl-C in the ``verify`` commands: the first keeps what finished, a second quits at once.

A terminal sends SIGINT to its whole process group; the rank processes ignore it
(``verify.distributed._child``) and the command decides. While :class:`Interrupts`
is active:

* the **first** SIGINT raises ``KeyboardInterrupt`` in the main thread, where the
  command stops what it computes and writes what it has (``verify preflight``
  keeps its paper part and hazards, ``verify accumulation`` the points measured).
  Inside :meth:`Interrupts.deferred` it raises nothing: it only sets
  :attr:`Interrupts.requested` and kills this process's rank processes, for a
  main thread that waits on work done elsewhere (``verify run``'s checks run in
  worker threads) and must not be torn out of the middle of its bookkeeping;
* any **later** SIGINT kills the rank processes, writes one line to stderr and
  ends the process at once with exit code 3, even while reports are being written.

The handler writes with ``os.write``: a ``print`` could re-enter a stream the main
thread was writing to when the signal came. Handlers can only be set from the main
thread; elsewhere :class:`Interrupts` changes nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType

EXIT_INTERRUPTED = 3  # the commands' "error" exit code: the run did not finish


def kill_rank_processes() -> None:
    """SIGKILL every live multiprocessing child of this process (the ranks of running work)."""
    for child in multiprocessing.active_children():
        try:
            child.kill()
        except (OSError, ValueError):  # already gone, or closed
            pass


class Interrupts:
    """Installs the two-step Ctrl-C handling for ``prog`` (e.g. ``"verify run"``) while active."""

    def __init__(self, prog: str) -> None:
        self.prog = prog
        self.requested = threading.Event()
        self._deferring = False
        self._previous: object = None
        self._installed = False

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    @contextmanager
    def deferred(self) -> Iterator[threading.Event]:
        """While active, the first Ctrl-C only sets (and yields) :attr:`requested`."""
        self._deferring = True
        try:
            yield self.requested
        finally:
            self._deferring = False

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            kill_rank_processes()
            os.write(2, f"{self.prog}: interrupted again: quitting at once\n".encode())
            os._exit(EXIT_INTERRUPTED)
        self.requested.set()
        if self._deferring:
            kill_rank_processes()
            return
        raise KeyboardInterrupt

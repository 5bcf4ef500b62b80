"""Why a multi-rank run did not return: typed, so callers can tell it from a numerical failure.

:class:`DistributedRunError` is the base; :class:`RankCrashed` means a rank raised
or died, :class:`RankTimeout` means the run stalled (no rank made progress for the
stall timeout) or outlasted its ceiling.
Both carry a :class:`RankState` for every rank that had not finished, with its
last progress marker and, where the harness could get one, its Python stack.
"""

from __future__ import annotations

import sys
import traceback as traceback_module
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType

from verify.distributed.stall import CPU_SHARE


@dataclass(frozen=True)
class Frame:
    """One frame of a rank's traceback: the module it ran in, its file, line and function."""

    module: str
    filename: str
    lineno: int
    function: str

    def short(self) -> str:
        """``path:line function`` with the path from its package root (after site-packages)."""
        path = self.filename.split("site-packages/")[-1]
        return f"{path}:{self.lineno} {self.function}"


def _frames(tb: TracebackType | None) -> tuple[Frame, ...]:
    frames = []
    while tb is not None:
        frame = tb.tb_frame
        frames.append(Frame(str(frame.f_globals.get("__name__", "?")), frame.f_code.co_filename,
                            tb.tb_lineno, frame.f_code.co_name))
        tb = tb.tb_next
    return tuple(frames)


def _root_cause(error: BaseException) -> BaseException:
    """The first exception of ``error``'s chain: what was raised before anything handled it
    (``raise ... from``, or an exception raised while handling another)."""
    seen = {id(error)}
    while True:
        earlier = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        if earlier is None or id(earlier) in seen:
            return error
        seen.add(id(earlier))
        error = earlier


@dataclass(frozen=True)
class RankFailure:
    """Why one rank failed: the exception it raised (its root cause first) or how it died.

    ``frames`` run outermost first to the frame that raised the root cause; ``item`` is the
    index of the item of :func:`verify.distributed.spawn_each` the rank was running (None:
    a plain ``spawn``, or the harness's own start or teardown).
    """

    exception: str
    message: str
    traceback: str = ""
    frames: tuple[Frame, ...] = ()
    item: int | None = None
    # Where the rank function said it was (``exc.add_note``, e.g. "in <case>"), outermost last.
    notes: tuple[str, ...] = ()

    @classmethod
    def from_exception(cls, error: BaseException, item: int | None = None) -> RankFailure:
        """The failure of a rank that raised ``error`` (while running ``item``)."""
        root = _root_cause(error)
        text = "".join(traceback_module.format_exception(error))
        notes: list[str] = []
        chained: BaseException | None = error
        while chained is not None and len(notes) < 16:
            notes[:0] = [str(n) for n in getattr(chained, "__notes__", ())]
            chained = chained.__cause__ or chained.__context__
        return cls(type(root).__name__, str(root) or "(no message)", text,
                   _frames(root.__traceback__), item, tuple(dict.fromkeys(notes)))

    @classmethod
    def died(cls, how: str, item: int | None = None) -> RankFailure:
        """The failure of a rank whose process ended without reporting (``how``: its state)."""
        return cls("ProcessDied", f"the process {how} before reporting", "", (), item)

    @property
    def root(self) -> Frame | None:
        """The frame that raised the root cause (None for a process that died)."""
        return self.frames[-1] if self.frames else None

    def summary(self) -> str:
        """One line: the root cause, where it was raised, and the rank function's notes."""
        where = [f"raised at {self.root.short()}"] if self.root is not None else []
        where += list(self.notes)
        return f"{self.exception}: {self.message}" + (f" ({'; '.join(where)})" if where else "")

    def raised_in(self, modules: Iterable[str]) -> bool:
        """True when the root cause comes from code of one of ``modules`` (a package name
        matches its submodules): the innermost frame that is one of theirs, or that is not
        torch's or the standard library's (what such code calls and fails in), belongs to one
        of them. A candidate that is torch's own code (``torch.distributed.fsdp``) names it."""
        prefixes = tuple(modules)
        for frame in reversed(self.frames):
            if any(frame.module == p or frame.module.startswith(p + ".") for p in prefixes):
                return True
            top = frame.module.split(".")[0]
            if top == "torch" or top in sys.stdlib_module_names:
                continue
            return False
        return False

    @property
    def in_collective(self) -> bool:
        """True when the root cause is the communication layer's: raised inside
        torch.distributed's Python, a ``torch.distributed.Dist*Error``, or a backend's
        transport error raised from a collective's ``wait()`` (gloo's messages name their
        transport source file; NCCL's name NCCL). These are what a rank meets when a failed
        peer has gone."""
        if self.root is not None and self.root.module.startswith("torch.distributed"):
            return True
        return (self.exception.startswith("Dist") or "/gloo/transport/" in self.message
                or "NCCL" in self.message)

    def __str__(self) -> str:
        return self.summary() + (f"\n{self.traceback}" if self.traceback else "")


@dataclass(frozen=True)
class RankState:
    """What the harness knew about one unfinished rank when it gave up on the run."""

    rank: int
    pid: int | None
    # e.g. "running", "stopped (SIGSTOP or a debugger)", "exited with code 3".
    process: str
    # The last label the rank reported (see verify.distributed.progress) and its age.
    marker: str | None = None
    marker_age_s: float | None = None
    # One line from the rank's Python stack, e.g. "in torch.distributed.all_reduce,
    # called from fastgrad/pipeline.py:340 (finalize_grads)"; None when not dumped.
    location: str | None = None
    # The innermost frames of that stack, most recent call first.
    stack: tuple[str, ...] = ()
    # CPU seconds the process used over the last ``window_s`` seconds (None: unknown).
    recent_cpu_s: float | None = None
    window_s: float | None = None
    # Whether, over that window, a thread of it could run and waited for a CPU instead
    # (verify.distributed.stall.wanted_cpu); None where its threads could not be read.
    starved: bool | None = None

    def describe(self) -> str:
        """Several lines for an error message."""
        marker = "never reached the harness's entry point (still starting?)"
        if self.marker is not None:
            age = f", {self.marker_age_s:.1f} s ago" if self.marker_age_s is not None else ""
            marker = f"last marker {self.marker!r}{age}"
        cpu = ""
        if self.recent_cpu_s is not None and self.window_s:
            cpu = f"; {self.recent_cpu_s:.2f} s of CPU in the last {self.window_s:.0f} s"
        if self.starved:
            cpu += " (starved: preempted, waiting for a CPU)"
        lines = [f"  rank {self.rank} (pid {self.pid}): {self.process}; {marker}{cpu}"]
        if self.location:
            lines.append(f"    {self.location}")
        lines.extend(f"      {frame}" for frame in self.stack)
        return "\n".join(lines)


class DistributedRunError(RuntimeError):
    """A multi-rank run failed for a reason other than the numbers it computed."""


class RankCrashed(DistributedRunError):
    """One or more ranks raised or died; ``failures`` maps rank -> :class:`RankFailure`.

    ``failures`` are the root causes: the first rank(s) to fail. A rank whose collective
    failed afterwards because a failed peer had gone (its error raised inside
    torch.distributed) is a consequence, kept apart in ``consequences``. The message leads
    with each distinct root cause (the ranks that raised it, the exception and where), then
    each distinct traceback once, then the ranks stopped because of it: W ranks raising the
    same error print it once, not W times.
    """

    def __init__(self, failures: dict[int, RankFailure], others: dict[int, RankState],
                 consequences: dict[int, RankFailure] | None = None) -> None:
        self.failures = dict(sorted(failures.items()))
        self.others = dict(sorted(others.items()))
        self.consequences = dict(sorted((consequences or {}).items()))
        groups: dict[tuple[str, str], list[int]] = {}
        for rank, failure in self.failures.items():
            groups.setdefault((failure.summary(), failure.traceback), []).append(rank)
        lines = [f"{_ranks_text(ranks)} failed: {summary}" for (summary, _), ranks in groups.items()]
        for (_, text), ranks in groups.items():
            if text:
                lines.append(f"--- traceback of {_ranks_text(ranks)} ---\n{text.rstrip()}")
        if self.others or self.consequences:
            lines.append("--- ranks stopped because of that failure ---")
            lines.extend(f"  rank {rank}: its collective failed once the failed rank had gone: "
                         f"{failure.summary()}" for rank, failure in self.consequences.items())
            lines.extend(state.describe() for state in self.others.values())
        super().__init__("\n".join(lines))

    @classmethod
    def from_arrivals(cls, arrivals: list[tuple[int, RankFailure]],
                      others: dict[int, RankState]) -> RankCrashed:
        """The crash of these failures: where some rank failed outside torch.distributed (its
        own error), a failure raised inside a collective is a consequence of it, whatever
        order they arrived in (a peer's gloo error can be read first); where every rank
        failed inside a collective, each is a root cause."""
        causes = {rank: f for rank, f in arrivals if not f.in_collective}
        if not causes:
            return cls(dict(arrivals), others)
        return cls(causes, others, {rank: f for rank, f in arrivals if f.in_collective})

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that failed first (the root causes), ascending."""
        return tuple(self.failures)

    @property
    def first(self) -> RankFailure:
        """The root cause of the lowest failed rank."""
        return next(iter(self.failures.values()))

    def summary(self) -> str:
        """One line per distinct root cause, with the ranks that raised it."""
        groups: dict[str, list[int]] = {}
        for rank, failure in self.failures.items():
            groups.setdefault(failure.summary(), []).append(rank)
        return "; ".join(f"{_ranks_text(ranks)}: {text}" for text, ranks in groups.items())


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class RankTimeout(DistributedRunError):
    """The run stalled, or outlasted its ceiling; ``states`` describes each unfinished rank.

    ``ceiling_s`` is None for a stall (no unfinished rank made progress for
    ``timeout_s``: see :mod:`verify.distributed.stall`), else the ceiling the run
    reached while some rank still computed.
    """

    def __init__(self, timeout_s: float, world_size: int, states: dict[int, RankState],
                 ceiling_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.ceiling_s = ceiling_s
        self.world_size = world_size
        self.states = dict(sorted(states.items()))
        unfinished = ", ".join(str(r) for r in self.states)
        if ceiling_s is None:
            why = (f"made no progress for {timeout_s:g} s (no progress marker, under "
                   f"{CPU_SHARE:.0%} of a core of CPU time, and no thread waiting for a CPU)")
        else:
            why = (f"were still running after {ceiling_s:g} s, the ceiling of a run "
                   f"({ceiling_s / timeout_s:g} x the {timeout_s:g} s stall timeout)")
        text = f"ranks {unfinished} of {world_size} {why} (every rank was killed):\n"
        super().__init__(text + "\n".join(s.describe() for s in self.states.values()))

    @property
    def stalled(self) -> bool:
        """True for a stall, False for a run that reached its ceiling."""
        return self.ceiling_s is None

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that had not finished, ascending."""
        return tuple(self.states)

"""Output files of the ``verify`` commands: checked before any work, written independently.

A run that takes minutes must not end in a traceback because ``--json`` names a
missing directory, and one output that cannot be written must not cost the others.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


class OutputPathError(ValueError):
    """An output option names a path that cannot be written (a usage error: exit code 2)."""


@dataclass(frozen=True)
class Output:
    """One requested output: the option that named it, its path and how to write it."""

    option: str
    path: Path
    write: Callable[[Path], None]
    announce: bool = True  # print "wrote PATH" (off when ``write`` reports its own files)

    def __post_init__(self) -> None:
        if not self.option.startswith("-"):
            raise ValueError(f"option must be a flag such as --json, got {self.option!r}")


def check_output_path(option: str, path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path when a file can be written there; an OutputPathError naming ``option`` otherwise.

    Nothing is created: the check looks at the path and its directory only.
    """
    target = Path(path)
    if str(path) == "" or str(path).endswith(os.sep):
        raise OutputPathError(f"{option} {str(path)!r}: expected a file path")
    if target.is_dir():
        raise OutputPathError(f"{option} {target}: is a directory, expected a file path")
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputPathError(f"{option} {target}: the file exists and is not writable")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.exists():
        raise OutputPathError(f"{option} {target}: directory {parent} does not exist")
    if not parent.is_dir():
        raise OutputPathError(f"{option} {target}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{option} {target}: directory {parent} is not writable")
    return target


def check_output_paths(options: Sequence[tuple[str, str | os.PathLike[str] | None]]) -> None:
    """Check every ``(option, path)`` with a path; two options naming one file are refused too."""
    seen: dict[Path, str] = {}
    for option, path in options:
        if path is None:
            continue
        target = check_output_path(option, path).resolve()
        if target in seen:
            raise OutputPathError(f"{option} and {seen[target]} name the same file {path}")
        seen[target] = option


def write_outputs(outputs: Sequence[Output], prog: str = "verify") -> list[str]:
    """Write each output; one that fails is reported on stderr and the others are still written.

    Returns one message per output that could not be written (empty when all were).
    """
    failures = []
    for output in outputs:
        try:
            output.write(output.path)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            message = f"{output.option} {output.path}: could not write: {reason}"
            print(f"{prog}: error: {message}", file=sys.stderr)
            failures.append(message)
        else:
            if output.announce:
                print(f"wrote {output.path}", file=sys.stderr)
    return failures

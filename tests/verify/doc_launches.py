"""The ``verify preflight`` launch lines of README.md and docs/*.md, as argv lists.

A launch line is a command in a fenced code block, after a ``$ `` prompt, that runs
``verify preflight`` (``\\`` continuations joined; ``$ NAME="..."`` assignments earlier in
the same file expanded). Usage synopses (no prompt) are not launch lines.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

_FENCE = re.compile(r"^```")
_ASSIGNMENT = re.compile(r'^\$ (\w+)="(.*)"$', re.S)


def _commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every ``$ `` line inside a fenced block, continuations joined."""
    out, inside, pending, start = [], False, None, 0
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line.strip()):
            inside, pending = not inside, None
            continue
        if not inside:
            continue
        if pending is not None:
            pending += " " + line.strip()
        elif line.startswith("$ "):
            pending, start = line.rstrip(), number
        else:
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        out.append((start, pending))
        pending = None
    return out


def doc_launch_lines(repo: Path) -> list[tuple[str, list[str]]]:
    """(``file:line``, argv after ``verify preflight``) for every launch line of the docs."""
    out = []
    for path in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        variables: dict[str, str] = {}
        for number, command in _commands(path.read_text(encoding="utf-8")):
            assignment = _ASSIGNMENT.match(command)
            if assignment:
                variables[assignment.group(1)] = " ".join(assignment.group(2).replace("\\", " ").split())
                continue
            expanded = re.sub(r"\$(\w+)", lambda m, known=variables: known.get(m.group(1), m.group(0)),
                              command[2:])
            tokens = shlex.split(expanded)
            if "preflight" not in tokens or "verify" not in tokens[:tokens.index("preflight")]:
                continue
            out.append((f"{path.relative_to(repo)}:{number}", tokens[tokens.index("preflight") + 1:]))
    return out

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


def preflight_option_arity() -> dict[str, int]:
    """verify preflight's own options and how many values each takes (0 or 1)."""
    import argparse

    from verify.preflight.cli import configure_parser

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    arity = {}
    for action in parser._actions:
        if action.dest in ("help", "megatron_argv", "extra_megatron_argv"):
            continue
        for flag in action.option_strings:
            arity[flag] = 0 if action.nargs == 0 else 1
    return arity


def split_preflight_argv(argv: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """(preflight's own options with their values, the Megatron-LM launch flags)."""
    arity = preflight_option_arity()
    own: dict[str, str | None] = {}
    launch: list[str] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if token == "--":
            launch += argv[index:]
            break
        name, has_value, value = token.partition("=")
        if name in arity:
            if arity[name] and not has_value:
                value, index = argv[index], index + 1
            own[name] = value if arity[name] else None
            continue
        launch.append(token)
    return own, launch

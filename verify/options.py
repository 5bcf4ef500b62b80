"""argparse helpers shared by the ``verify`` subcommands."""

from __future__ import annotations

import argparse
from typing import Any


class SetOnce(argparse.Action):
    """A single-value option that refuses to be given twice (argparse would keep the last)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if getattr(namespace, f"_seen_{self.dest}", False):
            parser.error(f"{option_string} was given more than once")
        setattr(namespace, f"_seen_{self.dest}", True)
        setattr(namespace, self.dest, values)

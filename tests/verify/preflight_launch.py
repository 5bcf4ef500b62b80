"""A ``verify preflight`` command line, resolved as its CLI resolves it (tests' shorthand).

``preflight_config(["--world-size", "4", "--pipeline-model-parallel-size", "2", ...])``
splits preflight's own options (``--world-size``) from the Megatron-LM launch flags, reads
the flags as Megatron's parse_args does and resolves them as validate_args does.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from verify.preflight.cli import configure_parser, own_options
from verify.preflight.config import PreflightConfig
from verify.preflight.flags import ParsedFlags, parse_megatron_flags, split_preflight_argv
from verify.preflight.resolve import resolve


def split_argv(argv: list[str]) -> tuple[int | None, list[str]]:
    """(--world-size or None, the launch's Megatron flags)."""
    own, launch = split_preflight_argv(list(argv), own_options())
    world = None
    for index, token in enumerate(own):
        if token == "--world-size":
            world = int(own[index + 1])
        elif token.startswith("--world-size="):
            world = int(token.split("=", 1)[1])
    return world, launch


def parsed_launch(argv: list[str]) -> ParsedFlags:
    """The Megatron flags of a preflight command line, parsed."""
    return parse_megatron_flags(split_argv(argv)[1], frozenset(own_options()))


def preflight_config(argv: list[str], environ: Mapping[str, str] | None = None) -> PreflightConfig:
    """The configuration ``verify preflight ARGV`` resolves (ConfigError/FlagError as it would)."""
    world, launch = split_argv(argv)
    return resolve(parse_megatron_flags(launch, frozenset(own_options())), environ or {},
                   world_size=world)


def preflight_args(argv: list[str]):
    """``verify preflight ARGV``'s Namespace, split as ``verify.cli.main`` splits it."""

    own, launch = split_preflight_argv(list(argv), own_options())
    parser = argparse.ArgumentParser(prog="verify preflight")
    configure_parser(parser)
    return parser.parse_args([*own, *(["--", *launch] if launch else [])])

"""The ``verify`` command line.

``verify run`` runs every registered check (or one, with ``--check``) and writes
the report; ``verify env`` prints the environment fingerprint. Other
subcommands (``layout``, ``accumulation``, ``simulate-pipeline``) live in their
own modules, listed in :data:`SUBCOMMANDS`.

Exit codes: 0 when every check passes, 1 when any fails, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from types import ModuleType

import torch

from verify.check import CheckContext
from verify.checks import all_checks, check_by_name
from verify.env import fingerprint, format_fingerprint
from verify.report import Report, render_text

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

# Subcommand name -> module defining configure_parser(parser) and main(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "layout": ("verify.studies.layout", "padding-overhead report for bucketed gradient buffers"),
    "accumulation": ("verify.studies.reduce_scatter.cli", "error growth of reduce-scatter with DP size"),
    "simulate-pipeline": ("verify.studies.pipeline", "discrete-event 1F1B pipeline simulator"),
    "preflight": ("verify.preflight.cli", "validate a Megatron-Core configuration and lay it out on paper"),
}


class UsageError(Exception):
    """Bad command-line usage (exit code 2)."""


def _load_subcommand(module_name: str) -> ModuleType | None:
    """Import a subcommand module; None only when that module itself does not exist."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise


def _add_run_parser(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser("run", help="run the registered checks and report")
    run.add_argument(
        "--check",
        action="append",
        metavar="NAME",
        help="run only this check (repeatable); see --list",
    )
    run.add_argument("--list", action="store_true", help="list the registered checks and exit")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--quick", action="store_true", help="smaller problem sizes")
    run.add_argument("--json", metavar="PATH", help="write the JSON report here")
    run.add_argument("--markdown", metavar="PATH", help="write the Markdown report here")
    run.add_argument("-v", "--verbose", action="store_true", help="print every comparison and table")


def build_parser() -> argparse.ArgumentParser:
    """The ``verify`` parser: ``run``, ``env`` and the delegated subcommands."""
    parser = argparse.ArgumentParser(
        prog="verify",
        description="Verify optimized gradient paths (fastgrad) against exact references (refgrad).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    _add_run_parser(subparsers)
    env = subparsers.add_parser("env", help="print the environment fingerprint")
    env.add_argument("--json", action="store_true", help="print JSON")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = _load_subcommand(module_name)
        if module is None:
            continue
        sub = subparsers.add_parser(name, help=help_text)
        module.configure_parser(sub)
        sub.set_defaults(_module=module_name)
    return parser


def _run_checks(args: argparse.Namespace) -> int:
    if args.list:
        for check in all_checks():
            print(f"{check.name:<16} {check.summary}")
        return EXIT_OK
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was given but CUDA is not available on this machine")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    try:
        checks = [check_by_name(n) for n in args.check] if args.check else list(all_checks())
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    context = CheckContext(device=args.device, seed=args.seed, quick=args.quick)
    report = Report(
        env=fingerprint(),
        options={"device": args.device, "seed": args.seed, "quick": args.quick,
                 "checks": [c.name for c in checks]},
    )
    for check in checks:
        print(f"running {check.name} ...", file=sys.stderr, flush=True)
        report.checks.append(check.execute(context))
    print(render_text(report, verbose=args.verbose))
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.markdown:
        report.write_markdown(args.markdown)
        print(f"wrote {args.markdown}", file=sys.stderr)
    return EXIT_OK if report.passed else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``verify`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return _run_checks(args)
        if args.command == "env":
            env = fingerprint()
            print(json.dumps(env, indent=2) if args.json else format_fingerprint(env))
            return EXIT_OK
        return int(_load_subcommand(args._module).main(args))
    except UsageError as exc:
        print(f"verify: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

"""``verify preflight``: check a Megatron-Core configuration and lay the full-size model out on paper.

Stages of :func:`main` (each returns or raises; a later phase adds the scaled
twin run as :data:`TWIN_STAGE`):

1. read the flags (``--args-file`` and the command line) and resolve them into a
   validated :class:`~verify.preflight.config.PreflightConfig` (exit 2 on a rule
   production enforces, nothing run);
2. the paper figures (:func:`build_report`);
3. the twin run: not in this phase, the report says so;
4. output: verdict line, tables, ``--json``/``--markdown``.

Exit codes: 0 pass, 1 numerical failure (reserved for the twin run), 2 usage,
3 error.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from importlib import metadata

from verify.env import fingerprint
from verify.preflight.config import ConfigError, PreflightConfig, resolve
from verify.preflight.flags import (
    FLAG_SPECS,
    FlagError,
    ParsedFlags,
    parse_megatron_flags,
    read_args_file,
)
from verify.preflight.paper import (
    BUCKET_RULES,
    WIRE_FORMULAS,
    chunk_layouts,
    memory_rows,
    reduction_error,
    wire_rows,
)
from verify.preflight.render import print_terminal, write_outputs
from verify.preflight.timing import CostInputs, pipeline_timing

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3
TWIN_NOTE = ("The scaled twin run is not part of this output: these figures are computed on "
             "paper from the configuration; no model was built and no collective was run.")
# Stage 3 hook: (config, args, report) -> passed. None until the twin phase adds it.
TWIN_STAGE: Callable[[PreflightConfig, argparse.Namespace, dict], bool] | None = None


class _MegatronFlag(argparse.Action):
    """Collects a Megatron flag, as written, into ``args.megatron_argv`` (order kept)."""

    def __call__(self, parser, namespace, values, option_string=None):
        collected = list(getattr(namespace, "megatron_argv", None) or [])
        collected.append(option_string)
        if values is not None and not isinstance(values, list):
            collected.append(values)
        namespace.megatron_argv = collected


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Preflight's own options, and every Megatron flag it understands."""
    parser.description = ("Validate a Megatron-Core training configuration as production does, "
                          "and compute its buffer layouts, traffic, reduction error and pipeline "
                          "bubble on paper. Flags preflight does not know go in --args-file or "
                          "after `--`; they are listed and ignored.")
    own = parser.add_argument_group("preflight options")
    own.add_argument("--args-file", action="append", default=[], metavar="PATH",
                     help="a file of Megatron flags (\\ continuations and # comments allowed); "
                          "repeatable, command-line flags win")
    own.add_argument("--json", metavar="PATH", help="write the JSON report here")
    own.add_argument("--markdown", metavar="PATH", help="write the Markdown report here")
    own.add_argument("--forward-ms", type=float, help="forward time per microbatch and stage")
    own.add_argument("--backward-ms", type=float, help="backward time per microbatch and stage")
    own.add_argument("--grad-sync-ms", type=float, help="grad-sync time of one stage")
    own.add_argument("--p2p-ms", type=float, help="time of one pipeline transfer")
    own.add_argument("--assumed-tflops", type=float, default=400.0,
                     help="achieved TFLOP/s per GPU for the estimated costs (default 400)")
    own.add_argument("--assumed-bus-gbps", type=float, default=100.0,
                     help="collective bus bandwidth in GB/s for the estimated costs (default 100)")
    parser.epilog = "Megatron-Core flags understood: " + " ".join(FLAG_SPECS)
    megatron = parser.add_argument_group("Megatron-Core flags (same names as Megatron's)")
    for flag, (_, kind) in FLAG_SPECS.items():
        nargs = 0 if kind in ("true", "false") else None
        megatron.add_argument(flag, action=_MegatronFlag, nargs=nargs, dest="megatron_argv",
                              default=None, metavar="V", help=argparse.SUPPRESS)
    parser.add_argument("extra_megatron_argv", nargs="*", metavar="-- MEGATRON_FLAGS",
                        help="further Megatron flags after `--` (unknown ones are listed)")


def read_flags(args: argparse.Namespace) -> ParsedFlags:
    """Args files first, then the command line (later flags win, as with argparse)."""
    tokens: list[str] = []
    for path in args.args_file:
        tokens += read_args_file(path)
    tokens += list(getattr(args, "megatron_argv", None) or [])
    tokens += list(getattr(args, "extra_megatron_argv", None) or [])
    return parse_megatron_flags(tokens)


def gradverify_version() -> str:
    try:
        return metadata.version("gradverify")
    except metadata.PackageNotFoundError:  # running from a checkout without install
        return "unknown"


def build_report(config: PreflightConfig, parsed: ParsedFlags, costs: CostInputs) -> dict:
    """Stage 2: every paper figure, JSON-ready."""
    chunks = chunk_layouts(config)
    wire = wire_rows(config, chunks)
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    return {
        "tool": "verify preflight",
        "gradverify_version": gradverify_version(),
        "passed": True,
        "verdict": (f"PREFLIGHT PASSED: valid under Megatron-Core's rules; TP={config.tensor_model_parallel_size}"
                    f" PP={pp} VPP={vpp} DP={config.data_parallel_size} "
                    f"({config.data_parallel_source}), {config.num_microbatches} microbatches; "
                    f"{pp * vpp} gradient buffers laid out on paper"),
        "config": config.to_dict(),
        "unknown_flags": list(parsed.unknown),
        "ignored_positionals": list(parsed.positional),
        "layout": memory_rows(config, chunks),
        "bucket_rules": BUCKET_RULES,
        "wire": wire,
        "wire_formulas": dict(WIRE_FORMULAS),
        "reduction_error": reduction_error(config),
        "pipeline": pipeline_timing(config, chunks, wire, costs),
        "twin": {"run": False, "note": TWIN_NOTE},
        "env": fingerprint(),
    }


def main(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """Run the stages; returns the exit code."""
    environ = os.environ if environ is None else environ
    try:
        parsed = read_flags(args)
        config = resolve(parsed, environ)
        costs = CostInputs(forward_ms=args.forward_ms, backward_ms=args.backward_ms,
                           grad_sync_ms=args.grad_sync_ms, p2p_ms=args.p2p_ms,
                           assumed_tflops=args.assumed_tflops,
                           assumed_bus_gbps=args.assumed_bus_gbps)
    except (FlagError, ConfigError, ValueError) as exc:
        print("PREFLIGHT REFUSED: the configuration would not start; nothing was run.",
              file=sys.stderr)
        print(f"verify preflight: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report = build_report(config, parsed, costs)
        if TWIN_STAGE is not None:
            report["passed"] = TWIN_STAGE(config, args, report)
        print_terminal(report)
        for path in write_outputs(report, args.json, args.markdown):
            print(f"wrote {path}", file=sys.stderr)
    except OSError as exc:
        print(f"verify preflight: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK if report["passed"] else EXIT_FAILED

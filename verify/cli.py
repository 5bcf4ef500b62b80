"""The ``verify`` command line.

``verify run`` runs every registered check (or one, with ``--check``) and writes
the reports and plots; ``verify env`` prints the environment fingerprint. Other
subcommands (``layout``, ``accumulation``, ``simulate-pipeline``) live in their
own modules, listed in :data:`SUBCOMMANDS`.

Exit codes, for a CI job to gate on (``verify run``; README "Exit codes"):

0  every check passed (hazards only direct API use reaches are reported, and pass);
1  a candidate computed a wrong gradient or crashed in a configuration a Megatron-LM launch
   can reach (a FAIL; it wins over 3: a bug found stands whatever else went wrong), or
   nothing was verified (every check skipped);
2  bad usage, before any check runs: a bad flag or output path, or a ``--candidate`` that
   cannot run here (not installed: the message gives the install command; unusable);
3  no failure found, but the harness could not finish: a stalled rank, a crash whose root
   cause is the harness's own, Ctrl-C, or an output not written.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from verify.candidates import (
    CANDIDATES,
    DEFAULT_CANDIDATE,
    Candidate,
    Technique,
    candidate_named,
    candidate_names,
)
from verify.check import Check, CheckContext
from verify.checks import RANK_MODULES, all_checks, check_by_name
from verify.console import StepProgress, emit, report_width
from verify.distributed import RankLauncher
from verify.env import fingerprint, format_fingerprint, gradverify_version, provenance
from verify.interrupt import Interrupts
from verify.options import SetOnce
from verify.outputs import Output, OutputPathError, check_output_paths, write_outputs
from verify.plots import PlotUnavailable, matplotlib_available, report_plots
from verify.runner import RunItem, abandoned_check_threads, run_checks

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3
EXIT_BY_VERDICT = {"PASS": EXIT_OK, "FAIL": EXIT_FAILED, "ERROR": EXIT_ERROR}
DEFAULT_TIMEOUT_S = CheckContext.timeout_s
# ``CandidateInfo.version`` of a candidate whose package is missing here.
NOT_INSTALLED = "not installed"

# Subcommand name -> module defining configure_parser(parser) and main(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "layout": ("verify.studies.layout", "padding-overhead report for bucketed gradient buffers"),
    "accumulation": ("verify.studies.reduce_scatter.cli", "error growth of reduce-scatter with DP size"),
    "simulate-pipeline": ("verify.studies.pipeline", "discrete-event 1F1B pipeline simulator"),
    "preflight": ("verify.preflight.cli", "validate a Megatron-Core configuration and lay it out on paper"),
}

# Rough wall seconds of each check on 2 CPU cores (full size; --quick takes about half):
# the progress estimate and --help use them. Unknown checks count as DEFAULT_CHECK_SECONDS.
ROUGH_CHECK_SECONDS = {"formats": 6, "oracle": 3, "metrics": 1, "layout": 2, "reduce_scatter": 11,
                       "deferred_wgrad": 10, "pipeline": 9, "mxfp8": 2, "optim": 7}
DEFAULT_CHECK_SECONDS = 10.0
QUICK_FACTOR = 0.5
# Twice as many checks at once as CPUs: much of a check's time is spent waiting (its ranks
# starting, meeting on the store, its references computed in processes of their own), and
# the others compute meanwhile. Measured on 2 cores, `verify run --candidate fastgrad
# --candidate megatron-core` (15 results): 140 s at --jobs 2, 108 s at 3, 87 s at 4
# (bench/results/verify_run_two_candidates_cpu.txt).
DEFAULT_JOBS = 2 * (os.cpu_count() or 1)


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


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _rough_total(quick: bool) -> float:
    total = sum(ROUGH_CHECK_SECONDS.values())
    return total * QUICK_FACTOR if quick else total


def _add_run_parser(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser(
        "run", help="run the registered checks and report",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description=(
            "Run the registered checks and write the reports. Rough run time on 2 CPU cores: "
            f"about {_rough_total(False):.0f} s for all checks, {_rough_total(True):.0f} s with "
            "--quick. Exit codes: 0 all passed (hazards only direct API use reaches are "
            "reported, not failed); 1 a candidate computed a wrong gradient or crashed where a "
            "launch can reach it (or nothing was verified); 2 usage, a --candidate that cannot "
            "run here included; 3 no failure found but the harness could not finish (a stall, "
            "a crash of its own, Ctrl-C, an output not written)."
        ),
    )
    run.add_argument("--check", action="append", metavar="NAME",
                     help="run only this check (repeatable); see --list")
    run.add_argument("--candidate", action="append", metavar="NAME",
                     help=f"the implementation the technique checks verify (repeatable: one "
                          f"report, a column per candidate; built in: {', '.join(CANDIDATES)}, "
                          f"others from installed plugins, see --list; default "
                          f"{DEFAULT_CANDIDATE}); the truth-layer checks run once")
    run.add_argument("--list", action="store_true",
                     help="list the registered checks and the candidates (with their installed "
                          "versions) and exit")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu", action=SetOnce)
    run.add_argument("--seed", type=int, default=0, action=SetOnce)
    run.add_argument("--quick", action="store_true", help="smaller problem sizes")
    run.add_argument("--timeout", type=_positive_seconds, default=DEFAULT_TIMEOUT_S,
                     metavar="SECONDS", action=SetOnce,
                     help="stall timeout of each multi-rank phase: when none of its ranks made "
                          "progress (a progress marker, or 2%% of a core of CPU time) for SECONDS, "
                          "it is an ERROR naming each rank and where it waits; a rank that "
                          "computes is never stopped for being slow (a phase still running "
                          "after 20 x SECONDS is ended)")
    run.add_argument("--jobs", type=_positive_int, default=DEFAULT_JOBS, metavar="N", action=SetOnce,
                     help="checks run at the same time (each check's ranks stay its own "
                          f"processes; default twice the CPUs, here {DEFAULT_JOBS}); 1 runs "
                          "them one after another")
    run.add_argument("--json", metavar="PATH", action=SetOnce, help="write the JSON report here")
    run.add_argument("--markdown", metavar="PATH", action=SetOnce,
                     help="write the Markdown report here")
    run.add_argument("--no-plots", action="store_true",
                     help="do not draw the figures (PNG) beside the reports (they are drawn "
                          "beside --markdown, else --json, when matplotlib is installed)")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="print every comparison, finding and table")


def build_parser() -> argparse.ArgumentParser:
    """The ``verify`` parser: ``run``, ``env`` and the delegated subcommands."""
    parser = argparse.ArgumentParser(
        prog="verify",
        description="Verify optimized gradient paths (fastgrad) against exact references (refgrad).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {gradverify_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    _add_run_parser(subparsers)
    env = subparsers.add_parser("env", help="print the environment fingerprint",
                                description="Print the environment fingerprint (about 1 s).")
    env.add_argument("--json", metavar="PATH", action=SetOnce,
                     help="write the fingerprint as JSON to PATH ('-': standard output)")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = _load_subcommand(module_name)
        if module is None:
            continue
        sub = subparsers.add_parser(name, help=help_text,
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.configure_parser(sub)
        sub.set_defaults(_module=module_name)
    return parser


def _plot_outputs(report: Any, args: argparse.Namespace) -> list[Output]:
    """The figures, beside the Markdown report (else the JSON one); none without a report."""
    anchor = args.markdown or args.json
    if args.no_plots or anchor is None:
        return []
    if not matplotlib_available():
        print("verify: note: no plots drawn (matplotlib is not installed: "
              "pip install -e '.[plot]' in the gradverify checkout)", file=sys.stderr)
        return []
    anchor_path = Path(anchor)

    def draw(directory: Path) -> None:
        written = report_plots(report.checks, directory, anchor_path.stem)
        base = Path(args.markdown).parent if args.markdown else directory
        report.plots.extend((title, os.path.relpath(path, base)) for title, path in written)
        for _, path in written:
            print(f"wrote {path}", file=sys.stderr)

    return [Output("--markdown" if args.markdown else "--json", anchor_path.parent, draw,
                   announce=False)]


def _run_checks(args: argparse.Namespace, interrupts: Interrupts) -> int:
    if args.list:
        emit(_listing())
        return EXIT_OK
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda was given but CUDA is not available on this machine")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    check_output_paths([("--json", args.json), ("--markdown", args.markdown)])
    try:
        checks = [check_by_name(n) for n in args.check] if args.check else list(all_checks())
    except ValueError as exc:
        raise UsageError(f"--check: {exc}") from exc
    candidates = _candidates(args.candidate, checks)
    if args.candidate and all(check.technique is None for check in checks):
        raise UsageError(f"--candidate {args.candidate[0]}: the checks selected "
                         f"({', '.join(c.name for c in checks)}) are truth-layer checks, which run "
                         "once and verify gradverify itself, not a candidate; add a technique "
                         "check (see --list)")
    items = [RunItem(check, None) for check in checks if check.technique is None] + [
        RunItem(check, candidate) for check in checks if check.technique is not None
        for candidate in candidates]
    items.sort(key=lambda item: checks.index(item.check))  # registry order, candidates side by side
    with interrupts.deferred() as interrupted:
        # From here on, a first Ctrl-C never tears through the bookkeeping: the checks not
        # finished are marked interrupted and every requested output is still written.
        return _run_and_report(args, items, candidates, interrupted)


def _candidates(names: Sequence[str] | None, checks: Sequence[Check]) -> list[Candidate]:
    """The ``--candidate`` names as candidates, in the order given (default: fastgrad), each
    able to run some of ``checks`` here: one that cannot (not installed, unusable) is a usage
    error naming why and the install command, before any check runs, never a PASS of nothing."""
    names = list(names or [DEFAULT_CANDIDATE])
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"--candidate {repeated[0]} was given more than once")
    try:
        candidates = [candidate_named(n) for n in names]
    except ValueError as exc:  # unknown name, or a plugin that cannot be used
        raise UsageError(f"--candidate: {exc}") from exc
    techniques = [check.technique for check in checks if check.technique is not None]
    refusals = [f"--candidate {c.name} cannot run here: {why}" for c in candidates
                if (why := cannot_run_here(c, techniques)) is not None]
    if refusals:
        raise UsageError("\n".join(refusals))
    return candidates


def cannot_run_here(candidate: Candidate, techniques: Sequence[Technique]) -> str | None:
    """Why ``candidate`` can run none of ``techniques`` here (None: it can run some): its
    ``info()`` fails, it is not installed, or it lists each of them as unsupported here
    (``CandidateInfo.unsupported``, with the reason: for a missing package, how to install it).
    A candidate that runs some of them and not others runs, its others SKIP with the reason."""
    try:
        info = candidate.info()
    except Exception as exc:  # noqa: BLE001 - an unusable candidate is named, not a traceback
        return f"reading what is installed failed: {type(exc).__name__}: {exc}"
    unsupported = dict(info.unsupported)
    if info.version == NOT_INSTALLED:
        return "; ".join(dict.fromkeys(unsupported.values())) or info.description
    wanted = list(dict.fromkeys(t.value for t in techniques))
    if wanted and all(t in unsupported for t in wanted):
        return "; ".join(f"{t}: {unsupported[t]}" for t in wanted)
    return None


def _listing() -> str:
    """``verify run --list``: the checks, then the candidates with their installed versions."""
    lines = ["checks (technique checks run against each --candidate; the truth layer once):"]
    for check in all_checks():
        kind = "truth layer" if check.technique is None else "technique"
        lines.append(f"  {check.name:<16} {kind:<11}  {check.summary}")
    lines += ["", "candidates (--candidate NAME):"]
    try:
        names = candidate_names()
    except ValueError as exc:  # an installed plugin takes a built-in name: say so, list the rest
        names = tuple(CANDIDATES)
        lines.append(f"  plugins not listed: {exc}")
    for name in names:
        try:
            info = candidate_named(name).info()
        except ValueError as exc:  # a broken plugin is listed with why, the rest still are
            lines.append(f"  {name:<16} {'unusable':<12} {exc}")
            continue
        default = " (default)" if name == DEFAULT_CANDIDATE else ""
        lines.append(f"  {name:<16} {info.version:<12} {info.description}{default}")
        for technique, reason in info.unsupported:
            lines.append(f"  {'':<16} {'':<12} cannot run {technique}: {reason}")
        if info.redirects:
            lines.append(f"  {'':<16} {'':<12} on this machine, redirected: "
                         + "; ".join(r.split(":")[0] for r in info.redirects))
    return "\n".join(lines)


def _run_and_report(args: argparse.Namespace, items: Sequence[RunItem],
                    candidates: Sequence[Candidate], interrupted: threading.Event) -> int:
    from verify.report import Report, render_text, write_markdown

    context = CheckContext(device=args.device, seed=args.seed, quick=args.quick,
                           timeout_s=args.timeout)
    report = Report(
        env=fingerprint(), provenance=provenance(),
        options={"device": args.device, "seed": args.seed, "quick": args.quick,
                 "timeout_s": args.timeout,
                 "checks": list(dict.fromkeys(item.check.name for item in items)),
                 "candidates": [c.name for c in candidates]},
        candidates=[c.info().to_dict() for c in candidates],
    )
    factor = QUICK_FACTOR if args.quick else 1.0
    weights = [ROUGH_CHECK_SECONDS.get(item.check.name, DEFAULT_CHECK_SECONDS) * factor
               for item in items]
    if any(item.check.spawns_ranks for item in items) and not interrupted.is_set():
        # Start the fork server now: it imports torch (and each candidate's modules) while
        # the first checks run; every rank of the run is forked from it.
        RankLauncher().preloading(*RANK_MODULES, *(m for c in candidates
                                                   for m in c.preload_modules)).warm_up()
    with StepProgress(sum(weights), "verify run", steps=len(items)) as progress:
        outcome = run_checks(items, weights, context, progress, args.jobs, interrupted)
    report.checks.extend(outcome.results)
    if outcome.interrupted:
        report.complete = False
        marked = len(outcome.stopped) + len(outcome.not_started)
        finished = len(outcome.results) - marked
        print(f"verify run: interrupted (Ctrl-C) during {', '.join(outcome.stopped) or 'start-up'}"
              f"; reporting the {finished} check{'s' if finished != 1 else ''} that finished, "
              f"{marked} marked interrupted (report incomplete; Ctrl-C again quits at once)",
              file=sys.stderr)
    emit(render_text(report, verbose=args.verbose, width=report_width(unlimited_off_terminal=args.verbose)))
    outputs = _plot_outputs(report, args)  # first: the reports show the plots
    if args.json:
        outputs.append(Output("--json", Path(args.json), report.write_json))
    if args.markdown:
        outputs.append(Output("--markdown", Path(args.markdown),
                              lambda path: write_markdown(report, path)))
    failures = _write_all(outputs)
    if failures and report.verdict != "FAIL":  # a failure found stands, written or not
        return EXIT_ERROR
    return EXIT_BY_VERDICT[report.verdict]


def _write_all(outputs: Sequence[Output]) -> list[str]:
    """write_outputs, with plotting errors (not only OSError) kept from stopping the rest."""
    guarded = []
    for output in outputs:
        def write(path: Path, _write: Callable[[Path], None] = output.write) -> None:
            try:
                _write(path)
            except (OSError, PlotUnavailable):
                raise
            except Exception as exc:  # noqa: BLE001 - a figure must not cost the reports
                raise OSError(f"{type(exc).__name__}: {exc}") from exc
        guarded.append(Output(output.option, output.path, write, output.announce))
    return write_outputs(guarded)


def _env(args: argparse.Namespace) -> int:
    env = fingerprint() | provenance()
    if args.json is None:
        emit(format_fingerprint(env))
        return EXIT_OK
    if args.json == "-":
        emit(json.dumps(env, indent=2))
        return EXIT_OK
    check_output_paths([("--json", args.json)])
    failures = write_outputs([Output("--json", Path(args.json),
                                     lambda p: p.write_text(json.dumps(env, indent=2) + "\n"))])
    return EXIT_ERROR if failures else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``verify`` console script; returns the exit code."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["preflight"]:
        from verify.preflight.cli import own_options
        from verify.preflight.flags import FlagError, split_preflight_argv

        try:
            # Preflight's options for argparse; every other token is the launch's, behind `--`.
            own, launch = split_preflight_argv(argv[1:], own_options() | {"-h": False, "--help": False})
            argv = ["preflight", *own, *(["--", *launch] if launch else [])]
        except FlagError as exc:
            print(f"verify preflight: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    args = parser.parse_args(argv)
    try:
        with Interrupts(f"verify {args.command}") as interrupts:
            if args.command == "run":
                return _run_checks(args, interrupts)
            if args.command == "env":
                return _env(args)
            return int(_load_subcommand(args._module).main(args))
    except (UsageError, OutputPathError, PlotUnavailable) as exc:
        print(f"verify {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"verify {args.command}: interrupted", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        emit("")  # silences stdout; the reader is gone
        return EXIT_OK


def console_main() -> None:
    """The ``verify`` console script: :func:`main`, then exit with its code.

    After Ctrl-C, checks still busy in abandoned worker threads (``verify.runner``)
    must not see the interpreter shut down around them, so the process then ends
    at once, once its output is flushed.
    """
    code = main()
    if abandoned_check_threads():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()

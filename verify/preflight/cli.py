"""``verify preflight``: check a Megatron-Core configuration and lay the full-size model out on paper.

Stages of :func:`main` (each returns or raises):

1. read the flags (``--args-file`` and the command line) and resolve them into a
   validated :class:`~verify.preflight.config.PreflightConfig` (exit 2 listing every rule
   production enforces that the launch breaks, in Megatron-LM's order, nothing run; the
   ``--json``/``--markdown`` reports carry the list);
2. the paper figures (:func:`build_report`);
3. the scaled twin (:mod:`verify.preflight.twin`): trained by each ``--candidate``
   (fastgrad by default, Megatron-Core with ``--candidate megatron-core``) on real ranks
   and compared with refgrad after every step, then production's hazards for the
   configuration (``--no-twin``: paper figures and hazards only);
4. output: verdict line, tables, ``--json``/``--markdown``.

Exit codes: 0 pass, 1 numerical failure (the twin differs from refgrad), 2
usage (a refused configuration, or a twin larger than ``--max-world-size``),
3 error (a rank failed or stalled, Ctrl-C stopped the twin, a file could not be written).
After Ctrl-C the paper figures and hazards are still printed and written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path

from verify.candidates.interfaces import Candidate
from verify.candidates.megatron_core.version import missing_reason
from verify.candidates.registry import CANDIDATES, DEFAULT_CANDIDATE, candidate_named
from verify.env import fingerprint
from verify.outputs import OutputPathError, check_output_paths
from verify.preflight.config import ConfigError, PreflightConfig
from verify.preflight.flags import (
    MEGATRON_LM,
    MODELLED,
    FlagError,
    LaunchRefused,
    ParsedFlags,
    flag_of,
    parse_megatron_flags,
    read_args_file,
)
from verify.preflight.paper import (
    BUCKET_RULES,
    WIRE_FORMULAS,
    chunk_layouts,
    expert_chunk_layouts,
    expert_wire_rows,
    memory_rows,
    optimizer_state_rows,
    reduction_error,
    sharded_rows,
    wire_rows,
)
from verify.preflight.render import print_terminal, write_outputs
from verify.preflight.resolve import resolve
from verify.preflight.timing import CostInputs, pipeline_timing
from verify.preflight.twin import (
    TwinOptions,
    TwinRunError,
    TwinSizeError,
    UnsupportedTwin,
    paper_only_hazards,
    plan_twin,
    prepare_twin,
    run_twin_stage,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3
MEGATRON_CORE = "megatron-core"
INTERRUPTED_NOTE = "interrupted (Ctrl-C)"
TWIN_NOTE = ("The scaled twin run is not part of this output (--no-twin): these figures are "
             "computed on paper from the configuration; no model was built and no collective "
             "was run.")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Preflight's own options; the launch's Megatron-LM flags follow `--`."""
    parser.allow_abbrev = False  # as Megatron-LM's parser: --tensor-model is no flag
    parser.description = (f"Validate a Megatron-LM launch as {MEGATRON_LM} does, and compute "
                          "its buffer layouts, traffic, reduction error and pipeline bubble on "
                          "paper. Usage: verify preflight [PREFLIGHT OPTIONS] -- MEGATRON FLAGS "
                          "(the flags a launch script hands to pretrain_gpt.py, unchanged).")
    own = parser.add_argument_group("preflight options (none is a Megatron-LM flag)")
    own.add_argument("--world-size", type=int, metavar="N",
                     help="the launch's world size, which Megatron-LM takes from the launcher; "
                          "without it WORLD_SIZE under torchrun, or the torchrun line of --args-file")
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
                     help="achieved TFLOP/s per GPU for the estimated costs")
    own.add_argument("--assumed-bus-gbps", type=float, default=100.0,
                     help="collective bus bandwidth in GB/s for the estimated costs")
    twin = parser.add_argument_group("scaled twin")
    twin.add_argument("--no-twin", action="store_true",
                      help="paper figures and hazards only: build no model, run no collective")
    # The parser's formatter appends each default ("(default: 16)").
    twin.add_argument("--twin-hidden-size", type=int, default=TwinOptions.hidden_size,
                      metavar="H", help="the twin's layer width")
    twin.add_argument("--twin-layers", type=int, default=TwinOptions.layers, metavar="L",
                      help="the twin's layers per virtual stage (an uneven split keeps "
                           "production's differences between stages on top)")
    twin.add_argument("--twin-steps", type=int, default=TwinOptions.steps, metavar="N",
                      help="training steps, each compared with refgrad")
    twin.add_argument("--twin-max-microbatches", type=int, default=TwinOptions.max_microbatches,
                      metavar="M", help="cap on the twin's microbatches per step")
    twin.add_argument("--max-world-size", type=int, default=TwinOptions.max_world_size,
                      metavar="W", help="most ranks the twin may spawn, TP x PP x DP x CP")
    twin.add_argument("--timeout", type=float, default=TwinOptions.timeout_s, metavar="S",
                      help="stall timeout of the twin's ranks in seconds: an error when none "
                           "made progress (marker or CPU time) for that long")
    twin.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    twin.add_argument("--candidate", action="append", metavar="NAME",
                      help=f"the implementation that trains the twin (built in: "
                           f"{', '.join(CANDIDATES)}, others from installed plugins; default: "
                           f"{MEGATRON_CORE} where it is installed and can train the launch's "
                           f"twin here, else {DEFAULT_CANDIDATE}); repeat it for one report "
                           "with a section per candidate")
    modelled = sorted({flag_of(dest, {}) for dest in MODELLED})
    parser.epilog = (f"Every flag of {MEGATRON_LM}'s parse_args is read as it reads it; these "
                     "are modelled: " + " ".join(modelled) + ". Flags that would change the "
                     "layout, gradient path or batch in ways preflight does not model are "
                     "refused ('not modelled'); the others are listed and ignored.")
    parser.add_argument("extra_megatron_argv", nargs="*", metavar="-- MEGATRON_FLAGS",
                        help="the launch's Megatron-LM flags (after `--`)")


def own_options() -> dict[str, bool]:
    """Preflight's own options (those of :func:`configure_parser`) and whether each takes a value."""
    parser = argparse.ArgumentParser(add_help=False)
    configure_parser(parser)
    return {flag: action.nargs != 0 for action in parser._actions
            for flag in action.option_strings}


def read_flags(args: argparse.Namespace, own: frozenset[str] = frozenset()) -> ParsedFlags:
    """Args files first, then the command line (later flags win, as with argparse)."""
    tokens: list[str] = []
    for path in args.args_file:
        tokens += read_args_file(path)
    tokens += list(getattr(args, "extra_megatron_argv", None) or [])
    return parse_megatron_flags(tokens, own)


def gradverify_version() -> str:
    try:
        return metadata.version("gradverify")
    except metadata.PackageNotFoundError:  # running from a checkout without install
        return "unknown"


def build_report(config: PreflightConfig, parsed: ParsedFlags, costs: CostInputs) -> dict:
    """Stage 2: every paper figure, JSON-ready."""
    chunks = chunk_layouts(config)
    wire = wire_rows(config, chunks)
    experts = expert_chunk_layouts(config)
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    return {
        "tool": "verify preflight",
        "gradverify_version": gradverify_version(),
        "passed": True,
        "megatron": MEGATRON_LM,
        "verdict": (f"PREFLIGHT PASSED: valid under the rules of {MEGATRON_LM}; "
                    f"{config.shape} ({config.data_parallel_source}), "
                    f"{config.num_microbatches} microbatches; {pp * vpp} gradient "
                    f"buffer{'s' if pp * vpp != 1 else ''} laid out on paper"
                    + _expert_verdict(config) + _sharded_verdict(config)),
        "config": config.to_dict(),
        "unknown_flags": list(parsed.unknown),
        "ignored_positionals": list(parsed.positional),
        "layout": memory_rows(config, chunks),
        "bucket_rules": BUCKET_RULES,
        "wire": wire,
        "wire_formulas": dict(WIRE_FORMULAS),
        "reduction_error": reduction_error(config),
        **expert_figures(config),
        "optimizer_state": optimizer_state_rows(config, chunks, experts),
        "sharded_dp": sharded_rows(config, chunks),
        "pipeline": pipeline_timing(config, chunks, wire, costs, experts),
        "twin": {"run": False, "note": TWIN_NOTE},
        "hazards": [],
        "env": fingerprint(),
    }


def _expert_verdict(config: PreflightConfig) -> str:
    """The verdict's words on the experts: their buffers are on paper only."""
    if config.moe is None:
        return ""
    moe = config.moe
    where = (f"{len(expert_chunk_layouts(config))} expert buffers over expert DP "
             f"{config.expert_data_parallel_size}" if config.expert_buffers else
             "the experts' params in the dense buffers (EP 1, ETP = TP)")
    return (f" ({moe.num_experts} experts, EP {moe.expert_model_parallel_size}, ETP "
            f"{moe.expert_tensor_parallel_size}: {where})")


def _sharded_verdict(config: PreflightConfig) -> str:
    """The verdict's words on fully-sharded DP: its per-rank figures are on paper only."""
    if config.sharded_dp is None:
        return ""
    return (f"; {config.sharded_dp.label} in place of DDP: its sharding and collectives on "
            "paper (unpadded), its own buffers not laid out")


def expert_figures(config: PreflightConfig) -> dict:
    """The expert buffers' paper figures (none without expert buffers): their layout per
    (stage, chunk), bytes on the wire over expert DP, averaging and predicted error."""
    experts = expert_chunk_layouts(config)
    if not experts:
        return {}
    return {"expert_layout": memory_rows(config, experts),
            "expert_wire": expert_wire_rows(config, experts),
            "expert_reduction_error": reduction_error(config, expert=True)}


def twin_options(args: argparse.Namespace) -> TwinOptions:
    """The ``--twin-*`` flags, validated (ValueError names the flag)."""
    return TwinOptions(hidden_size=args.twin_hidden_size, layers=args.twin_layers,
                       steps=args.twin_steps, max_microbatches=args.twin_max_microbatches,
                       max_world_size=args.max_world_size, timeout_s=args.timeout)


def default_twin_candidate(config: PreflightConfig, options: TwinOptions
                           ) -> tuple[Candidate, str | None]:
    """The candidate that trains the twin when none is named: the launch is Megatron-LM's, so
    Megatron-Core where it is installed and can train this launch's twin here; else fastgrad,
    with the reason Megatron-Core did not (None: it is not installed)."""
    megatron = candidate_named(MEGATRON_CORE)
    if missing_reason() is not None:
        return candidate_named(DEFAULT_CANDIDATE), None
    prepared = prepare_twin(config, options, megatron)
    if isinstance(prepared, UnsupportedTwin):
        return candidate_named(DEFAULT_CANDIDATE), (
            f"megatron-core cannot train this launch's twin here ({prepared.reason}); "
            f"{DEFAULT_CANDIDATE}'s twin ran instead")
    return megatron, None


def twin_candidates(args: argparse.Namespace) -> tuple[Candidate, ...]:
    """The ``--candidate`` flags in order (none: decided by :func:`default_twin_candidate`
    once the configuration is known); ValueError on a repeat."""
    names = list(getattr(args, "candidate", None) or [])
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--candidate {repeated[0]} is given more than once (one section per "
                         "candidate)")
    try:
        return tuple(candidate_named(n) for n in names)
    except ValueError as exc:  # unknown name, or a plugin that cannot be used
        raise ValueError(f"--candidate: {exc}") from exc


def refusal_report(exc: LaunchRefused, headline: str) -> dict:
    """A refused launch's report, JSON-ready: every refusal in Megatron-LM's order, and the
    rules not checked because of them."""
    return {
        "tool": "verify preflight",
        "gradverify_version": gradverify_version(),
        "passed": False,
        "refused": True,
        "megatron": MEGATRON_LM,
        "verdict": f"PREFLIGHT REFUSED: {headline}; nothing was run",
        "refusals": exc.to_dict(),
        "not_checked": list(exc.not_checked),
        "env": fingerprint(),
    }


def refusal_markdown(report: dict) -> str:
    """The refusal report as Markdown: the verdict, the numbered refusals, what was not checked."""
    lines = ["# verify preflight", "", f"**{report['verdict']}**", "",
             f"Refused under the rules of {report['megatron']}, in the order it checks them:", ""]
    lines += [f"{i}. {r['message']} [{r['stage']}]" for i, r in enumerate(report["refusals"], 1)]
    if report["not_checked"]:
        lines += ["", "Not checked:", ""] + [f"- {note}" for note in report["not_checked"]]
    return "\n".join(lines) + "\n"


def refuse(exc: LaunchRefused, headline: str, args: argparse.Namespace) -> int:
    """Print every refusal and what they leave unchecked, write the requested reports; exit 2."""
    print(f"PREFLIGHT REFUSED: {headline}; nothing was run.", file=sys.stderr)
    print(f"verify preflight: error: {exc}", file=sys.stderr)
    for note in exc.not_checked:
        print(f"verify preflight: not checked: {note}", file=sys.stderr)
    report = refusal_report(exc, headline)
    try:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
            print(f"wrote {args.json}", file=sys.stderr)
        if args.markdown:
            Path(args.markdown).write_text(refusal_markdown(report), encoding="utf-8")
            print(f"wrote {args.markdown}", file=sys.stderr)
    except OSError as exc_write:
        print(f"verify preflight: error: {exc_write}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_USAGE


def main(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
         candidates: Sequence[Candidate] | None = None) -> int:
    """Run the stages; returns the exit code. ``candidates``: the implementations the twin runs
    (tests' deliberately broken ones; default: the ``--candidate`` flags)."""
    environ = os.environ if environ is None else environ
    try:  # preflight's own options first: a bad one is not the configuration's fault
        check_output_paths([("--json", args.json), ("--markdown", args.markdown)])
        costs = CostInputs(forward_ms=args.forward_ms, backward_ms=args.backward_ms,
                           grad_sync_ms=args.grad_sync_ms, p2p_ms=args.p2p_ms,
                           assumed_tflops=args.assumed_tflops,
                           assumed_bus_gbps=args.assumed_bus_gbps)
        options = twin_options(args)
        if args.no_twin and getattr(args, "candidate", None):
            raise ValueError("--candidate chooses the implementation that trains the twin, and "
                             "--no-twin trains none: give one of them")
        chosen = tuple(candidates) if candidates is not None else twin_candidates(args)
        parsed = read_flags(args, frozenset(own_options()))
    except FlagError as exc:
        return refuse(exc, "the launch's flags are refused", args)
    except (OutputPathError, ValueError) as exc:
        print("PREFLIGHT REFUSED: a preflight option is invalid; nothing was run.", file=sys.stderr)
        print(f"verify preflight: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        config = resolve(parsed, environ, world_size=args.world_size)
    except ConfigError as exc:
        return refuse(exc, "the configuration would not start", args)
    if not args.no_twin:
        try:
            plan_twin(config, options)  # refuses a twin above --max-world-size before any work
        except TwinSizeError as exc:
            print("PREFLIGHT REFUSED: the configuration is valid, but its twin needs more ranks "
                  "than allowed; nothing was run (--no-twin gives the paper figures).",
                  file=sys.stderr)
            print(f"verify preflight: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    report = build_report(config, parsed, costs)
    if not args.no_twin and not chosen:
        default, why_not = default_twin_candidate(config, options)
        chosen = (default,)
        if why_not is not None:
            report["twin_candidate_note"] = why_not
    twin_error = partial_error = None
    if args.no_twin:
        paper_only_hazards(config, report)
    else:
        try:
            verdict = run_twin_stage(config, options, report, environ=environ, candidates=chosen,
                                     progress=False if args.no_progress else None)
            if verdict is None:  # a torchrun rank other than 0: rank 0 reports
                return EXIT_OK
            # One candidate's ranks failed beside others that finished: their sections stand.
            partial_error = report.pop("twin_error", None)
        except TwinRunError as exc:
            twin_error = str(exc)
        except KeyboardInterrupt:
            # Ctrl-C: the ranks are gone (spawn kills them); what was computed on paper stands.
            twin_error = INTERRUPTED_NOTE
            report["interrupted"] = True
        except Exception as exc:  # noqa: BLE001 - a bug in the twin must not lose the paper figures
            twin_error = (f"internal error while checking the twin ({type(exc).__name__}: {exc}); "
                          "this is a gradverify bug: please report it with the --json report")
            report["twin_traceback"] = traceback.format_exc()
        if twin_error is not None:
            # The paper figures and the configuration's hazards still stand: report them.
            paper_only_hazards(config, report)
            report["twin"] = {"run": False, "error": twin_error,
                              "note": f"The scaled twin did not finish: {twin_error}"}
            report["verdict"] = f"ERROR: the scaled twin did not finish: {twin_error}"
            report["passed"] = False
    try:
        try:
            print_terminal(report)
        except BrokenPipeError:
            pass  # the reader went away (| head): the files below are still written
        for path in write_outputs(report, args.json, args.markdown):
            print(f"wrote {path}", file=sys.stderr)
    except OSError as exc:
        print("ERROR: verify preflight could not finish", file=sys.stderr)
        print(f"verify preflight: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if twin_error is not None or partial_error is not None:
        print(f"verify preflight: error: {twin_error or partial_error}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK if report["passed"] else EXIT_FAILED

"""``verify accumulation``: the command line of the reduce-scatter error-growth study."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from verify.options import SetOnce
from verify.studies.reduce_scatter.models import (
    DISTRIBUTIONS,
    DTYPE_ALIASES,
    DTYPES,
    METHOD_LABELS,
    METHODS,
)
from verify.studies.reduce_scatter.render import render_markdown, render_text
from verify.studies.reduce_scatter.sweep import (
    DEFAULT_DP,
    DEFAULT_NUMEL,
    EXIT_OK,
    EXIT_USAGE,
    Point,
    SweepConfig,
    growth_table,
    published_claims_table,
    run_sweep,
)

EXIT_ERROR = 3  # interrupted, or an output could not be written (as `verify run`)
# The flag behind each SweepConfig field, for error messages that name what the user typed.
FLAG_OF_FIELD = {"dp_sizes": "--dp", "dtypes": "--dtype", "distributions": "--distribution",
                 "methods": "--method", "numel": "--numel", "seed": "--seed"}
# Rough bytes of memory per element: the per-element ULP distances kept for every
# (dtype, method) (int64), and per element of the [N, columns] block in flight
# (float32 samples and noise, the 16-bit copy, fp32 partial sums, float64 sums).
BYTES_PER_KEPT_ULP = 8
BYTES_PER_BLOCK_ELEMENT = 32
# Within a long (distribution, N) group, a progress line at most this often (no terminal).
BLOCK_LINE_S = 15.0


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _choice_list(allowed: Sequence[str], aliases: dict[str, str] | None = None):
    def parse(text: str) -> tuple[str, ...]:
        values = []
        for raw in (v.strip() for v in text.split(",") if v.strip()):
            name = (aliases or {}).get(raw, raw)
            if name not in allowed:
                raise argparse.ArgumentTypeError(f"{raw!r} is not one of {tuple(allowed)}")
            values.append(name)
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return tuple(values)

    return parse


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``verify accumulation``."""
    parser.description = (
        "Error growth of 16-bit reduce-scatter with the data-parallel size N: ring and tree "
        "in the wire dtype vs fp32 accumulation, against the correctly rounded exact sum. "
        "Rough run time on 2 CPU cores: about 20 s with the defaults, 3 minutes at --dp 65536 "
        "--numel 100000 (it grows with --numel times the --dp sizes); progress on stderr."
    )
    parser.add_argument("--dp", type=_int_list, default=DEFAULT_DP, action=SetOnce,
                        help="comma-separated DP sizes")
    parser.add_argument("--dtype", type=_choice_list(tuple(DTYPES), DTYPE_ALIASES),
                        default=tuple(DTYPES), action=SetOnce, help="wire dtypes: fp16,bf16")
    parser.add_argument("--distribution", type=_choice_list(DISTRIBUTIONS), action=SetOnce,
                        default=DISTRIBUTIONS, help="input distributions, comma-separated")
    parser.add_argument("--method", type=_choice_list(METHODS), default=METHODS,
                        action=SetOnce, help="reduction methods, comma-separated")
    parser.add_argument("--numel", type=int, default=DEFAULT_NUMEL, action=SetOnce,
                        help="elements per point")
    parser.add_argument("--seed", type=int, default=0, action=SetOnce, help="random seed")
    parser.add_argument("--backend", choices=("sim", "dist"), default="sim", action=SetOnce,
                        help="sim: in-process models; dist: this process group's "
                             "real collectives, under torchrun")
    parser.add_argument("--json", metavar="PATH", action=SetOnce,
                        help="write the results as JSON")
    parser.add_argument("--markdown", metavar="PATH", action=SetOnce,
                        help="write the tables as Markdown")
    parser.add_argument("--plot", metavar="PNG", action=SetOnce,
                        help="plot error vs N (needs matplotlib: pip install -e '.[plot]' in the gradverify checkout)")
    parser.add_argument("--no-progress", action="store_true", help="no progress display on stderr")


def _with_flags(message: str) -> str:
    """``message`` with a leading SweepConfig field name replaced by the flag that sets it."""
    for field_name, flag in FLAG_OF_FIELD.items():
        if message.startswith(field_name + " "):
            return flag + message[len(field_name):]
    return message


def estimated_memory_bytes(config: SweepConfig) -> int:
    """Rough peak memory of ``run_sweep(config)`` (see BYTES_PER_* above)."""
    kept = max(config.numel_for(dp) for dp in config.dp_sizes)
    block = max(max(config.block_elements, config.numel_for(dp)) for dp in config.dp_sizes)
    return (kept * BYTES_PER_KEPT_ULP * len(config.dtypes) * len(config.methods)
            + block * BYTES_PER_BLOCK_ELEMENT)


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory, else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _output_problem(args: argparse.Namespace) -> str | None:
    """None when every requested output can be written; else the one-line reason."""
    from verify.outputs import OutputPathError, check_output_paths
    from verify.plots import INSTALL_HINT

    try:
        check_output_paths([("--json", args.json), ("--markdown", args.markdown),
                            ("--plot", args.plot)])
    except OutputPathError as exc:
        return str(exc)
    if args.plot and not _matplotlib_available():
        return f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}"
    return None


def write_points_plot(points: Sequence[Point], path: Path) -> None:
    """Error vs N per method, one panel per (dtype, distribution), with the bounds."""
    from verify.plots import plot_error_growth

    series: dict[tuple[str, str], dict[str, list[tuple[int, float]]]] = {}
    for p in points:
        series.setdefault((p.dtype, p.distribution), {}).setdefault(
            METHOD_LABELS[p.method], []).append((p.dp, p.rel_error))
    plot_error_growth(series, path)


def main(args: argparse.Namespace) -> int:
    """Run the sweep (or the dist measurement) and write the requested outputs."""
    from verify.console import StepProgress, emit
    from verify.outputs import Output, write_outputs

    problem = _output_problem(args)
    if problem:
        print(f"verify accumulation: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if args.backend == "dist":
        from verify.studies.reduce_scatter.dist import main_dist

        return main_dist(args)
    try:
        config = SweepConfig(
            dp_sizes=tuple(args.dp), dtypes=tuple(args.dtype),
            distributions=tuple(args.distribution), methods=tuple(args.method),
            numel=args.numel, seed=args.seed,
        )
    except (TypeError, ValueError) as exc:
        print(f"verify accumulation: error: {_with_flags(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    needed, available = estimated_memory_bytes(config), available_memory_bytes()
    if available is not None and needed > available:
        print(f"verify accumulation: error: --numel {config.numel} needs about "
              f"{needed / 2**30:.1f} GiB of memory and {available / 2**30:.1f} GiB are "
              "available; use a smaller --numel", file=sys.stderr)
        return EXIT_USAGE
    start = time.perf_counter()
    total = len(config.distributions) * len(config.dp_sizes)
    points: list[Point] = []
    incomplete = None
    with StepProgress(total, "accumulation", enabled=not args.no_progress) as progress:
        try:
            run_sweep(config, _progress_reporter(progress), into=points)
        except KeyboardInterrupt:
            # Ctrl-C: what was measured is still reported and written, marked incomplete.
            groups = len(points) // max(1, len(config.dtypes) * len(config.methods))
            incomplete = (f"INCOMPLETE: interrupted (Ctrl-C) after {groups} of {total} "
                          "(distribution, N) groups; only those are below")
    seconds = time.perf_counter() - start
    if incomplete:
        print(f"verify accumulation: {incomplete} (Ctrl-C again quits at once)", file=sys.stderr)
    # A closed pipe must not cost the files below.
    emit("\n\n".join(filter(None, [incomplete, render_text(points, config)])))
    print(f"measured {len(points)} points in {seconds:.1f}s", file=sys.stderr)
    outputs = []
    if args.json:
        payload = {
            "config": asdict(config),
            "complete": incomplete is None,
            "seconds": seconds,
            "points": [asdict(p) for p in points],
            "growth": growth_table(points),
            "published_claims": published_claims_table(points),
        }
        outputs.append(Output("--json", Path(args.json),
                              lambda p: p.write_text(json.dumps(payload, indent=2))))
    if args.markdown:
        markdown = render_markdown(points, config)
        if incomplete:
            title, _, rest = markdown.partition("\n")
            markdown = f"{title}\n\n**{incomplete}.**\n{rest}"
        outputs.append(Output("--markdown", Path(args.markdown), lambda p: p.write_text(markdown)))
    if args.plot:
        outputs.append(Output("--plot", Path(args.plot), lambda p: write_points_plot(points, p)))
    failures = write_outputs(outputs, prog="verify accumulation")
    return EXIT_ERROR if failures or incomplete else EXIT_OK


def _progress_reporter(progress: Any) -> Callable[[float, int, str, bool], None]:
    """``run_sweep``'s progress onto ``progress`` (a ``StepProgress``): a line per finished
    (distribution, N) group, and within a long group (DP 65,536: minutes) one per
    compute block at most every ``BLOCK_LINE_S`` seconds; the bar moves every block."""
    state = {"done": 0.0, "line_at": time.monotonic()}

    def report(done: float, _total: int, label: str, group_finished: bool) -> None:
        amount, state["done"] = done - state["done"], done
        now = time.monotonic()
        if group_finished or now - state["line_at"] >= BLOCK_LINE_S:
            state["line_at"] = now
            progress.advance(amount, label)
        else:
            progress.advance(amount)

    return report


def _matplotlib_available() -> bool:
    from verify.plots import matplotlib_available

    return matplotlib_available()

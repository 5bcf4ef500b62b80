"""``verify accumulation``: the command line of the reduce-scatter error-growth study."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

from verify.studies.reduce_scatter.models import DISTRIBUTIONS, DTYPE_ALIASES, DTYPES, METHODS
from verify.studies.reduce_scatter.render import render_markdown, render_text, write_plot
from verify.studies.reduce_scatter.sweep import (
    DEFAULT_DP,
    DEFAULT_NUMEL,
    EXIT_OK,
    EXIT_USAGE,
    SweepConfig,
    growth_table,
    published_claims_table,
    run_sweep,
)


class ProgressBar:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, enabled: bool = True, width: int = 30) -> None:
        self.enabled = enabled
        self.width = width
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        filled = int(self.width * done / total)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {done}/{total} {label}  {elapsed:.1f}s"
        if self.tty:
            end = "\n" if done == total else ""
            print(f"\r{line:<79}", end=end, file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------
# CLI
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
        "in the wire dtype vs fp32 accumulation, against the correctly rounded exact sum."
    )
    parser.add_argument("--dp", type=_int_list, default=DEFAULT_DP,
                        help="comma-separated DP sizes (default 2,4,...,1024)")
    parser.add_argument("--dtype", type=_choice_list(tuple(DTYPES), DTYPE_ALIASES),
                        default=tuple(DTYPES), help="wire dtypes: fp16,bf16 (default both)")
    parser.add_argument("--distribution", type=_choice_list(DISTRIBUTIONS),
                        default=DISTRIBUTIONS, help=f"input distributions {DISTRIBUTIONS}")
    parser.add_argument("--method", type=_choice_list(METHODS), default=METHODS,
                        help=f"reduction methods {METHODS}")
    parser.add_argument("--numel", type=int, default=DEFAULT_NUMEL,
                        help=f"elements per point (default {DEFAULT_NUMEL})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("sim", "dist"), default="sim",
                        help="sim: in-process models (default); dist: this process group's "
                             "real collectives, under torchrun")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    parser.add_argument("--plot", metavar="PNG", help="plot error vs N (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def main(args: argparse.Namespace) -> int:
    """Run the sweep (or the dist measurement) and write the requested outputs."""
    if args.backend == "dist":
        from verify.studies.reduce_scatter.dist import main_dist

        return main_dist(args)
    try:
        config = SweepConfig(
            dp_sizes=tuple(args.dp), dtypes=tuple(args.dtype),
            distributions=tuple(args.distribution), methods=tuple(args.method),
            numel=args.numel, seed=args.seed,
        )
    except ValueError as exc:
        print(f"verify accumulation: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    plot_path = args.plot
    if plot_path and not _matplotlib_available():
        print("verify accumulation: matplotlib is not installed (pip install "
              "'gradverify[plot]'); skipping --plot", file=sys.stderr)
        plot_path = None
    start = time.perf_counter()
    points = run_sweep(config, ProgressBar(enabled=not args.no_progress))
    seconds = time.perf_counter() - start
    print(render_text(points, config))
    print(f"measured {len(points)} points in {seconds:.1f}s", file=sys.stderr)
    if args.json:
        payload = {
            "config": asdict(config),
            "seconds": seconds,
            "points": [asdict(p) for p in points],
            "growth": growth_table(points),
            "published_claims": published_claims_table(points),
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(render_markdown(points, config))
        print(f"wrote {args.markdown}", file=sys.stderr)
    if plot_path:
        write_plot(points, config, plot_path)
        print(f"wrote {plot_path}", file=sys.stderr)
    return EXIT_OK


def _matplotlib_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None

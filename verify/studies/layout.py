"""``verify layout``: padding overhead of bucketed gradient buffers, from the formula.

For decoder-only transformer parameter lists of about 125M, 7B and 70B
parameters, at several data-parallel sizes and with high-busbw padding on and
off, this reports how many elements (and bytes) the padding adds and the
largest power of two dividing each rank's shard. It also recomputes Megatron-Core's
published worked examples from the formula and flags where their arithmetic is wrong.
All layouts come from the formula itself, ``refgrad.layout.compute_layout`` (the ``layout``
check holds every candidate's layout to it), with Megatron-Core's default bucket size.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradvocab import default_bucket_size
from refgrad.layout import compute_layout
from verify.options import SetOnce
from verify.outputs import Output, OutputPathError, check_output_paths, write_outputs
from verify.studies.layout_input import add_model_arguments, model_rows, user_models
from verify.studies.layout_models import MODELS, ModelSpec

DEFAULT_DPS = (8, 64, 512)
GRAD_BYTES = 4  # fp32 main grads (grad_reduce_in_fp32), the usual production setting
PARAM_BYTES = 2  # bf16 params (param buffer exists with the distributed optimizer)


def two_adic(value: int) -> int:
    """The largest power of two dividing ``value`` (value > 0)."""
    return value & -value


def padding_row(
    model: ModelSpec,
    dp_size: int,
    high_busbw: bool,
    *,
    grad_bytes: int = GRAD_BYTES,
    param_bytes: int = PARAM_BYTES,
) -> dict[str, Any]:
    """One report row: the model's layout at ``dp_size`` with the default bucket size."""
    numels, shared, _ = model.param_numels()
    bucket_size = default_bucket_size(dp_size)
    layout = compute_layout(
        numels,
        dp_size=dp_size,
        bucket_size=bucket_size,
        use_distributed_optimizer=True,
        pad_buckets_for_high_nccl_busbw=high_busbw,
        shared_embedding=shared,
    )
    params = sum(numels)
    padding = layout.numel - params  # start gaps inside buckets + end padding
    end_padding = layout.numel - layout.numel_unpadded
    shard_sizes = [(end - start) // dp_size for start, end in layout.bucket_indices]
    shard_pow2 = [two_adic(s) for s in shard_sizes]
    return {
        "model": model.name,
        "params": params,
        "dp": dp_size,
        "high_busbw": high_busbw,
        "bucket_size": bucket_size,
        "buckets": len(layout.bucket_indices),
        "numel": layout.numel,
        "padding_elements": padding,
        "end_padding_elements": end_padding,
        "padding_bytes": padding * (grad_bytes + param_bytes),
        "padding_percent": 100.0 * padding / layout.numel,
        "min_shard_pow2": min(shard_pow2),
        "max_shard_pow2": max(shard_pow2),
        "shards_divisible_by_2**16": sum(1 for s in shard_sizes if s % 2**16 == 0),
    }


def padding_rows(
    models: Sequence[str],
    dps: Sequence[int],
    *,
    grad_bytes: int = GRAD_BYTES,
    param_bytes: int = PARAM_BYTES,
) -> list[dict[str, Any]]:
    """Rows for every (model, dp, high-busbw on/off)."""
    return [
        padding_row(MODELS[m], dp, hb, grad_bytes=grad_bytes, param_bytes=param_bytes)
        for m in models
        for dp in dps
        for hb in (False, True)
    ]


PADDING_COLUMNS = (
    "model", "params", "dp", "high_busbw", "buckets", "padding_elements",
    "padding_bytes", "padding_percent", "min_shard_pow2", "shards_divisible_by_2**16",
)


def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def published_examples() -> list[dict[str, Any]]:
    """The published worked padding numbers beside the same quantities from the formula."""
    rows: list[dict[str, Any]] = []

    def row(example: str, quantity: str, published_value: Any, formula_value: Any) -> None:
        rows.append(
            {
                "example": example,
                "quantity": quantity,
                "published": published_value,
                "formula": formula_value,
                "agrees": published_value == formula_value,
            }
        )

    # Example 1: dp 8, a 10,000,000-element bf16 bucket, basic padding.
    d1 = math.lcm(8, 128)
    p1 = _pad(10_000_000, d1)
    row("1: dp=8, 10M elements, basic", "divisor lcm(8,128)", 128, d1)
    row("1: dp=8, 10M elements, basic", "padded bucket (elements)", 10_000_128, p1)
    row("1: dp=8, 10M elements, basic", "overhead (bytes, bf16)", 256, 2 * (p1 - 10_000_000))
    # Example 2: dp 64, 40,000,000 elements, high-busbw padding.
    d2 = math.lcm(64, 128, 2**16)
    p2 = _pad(40_000_000, d2)
    row("2: dp=64, 40M elements, high-busbw", "divisor lcm(64,128,2**16)", 4_194_304, d2)
    row("2: dp=64, 40M elements, high-busbw", "padded bucket (elements)", 41_943_040, p2)
    row("2: dp=64, 40M elements, high-busbw", "overhead (elements)", 1_943_040, p2 - 40_000_000)
    row(
        "2: dp=64, 40M elements, high-busbw",
        "overhead (% of 80 MB)",
        4.86,
        round(100 * (p2 - 40_000_000) / 40_000_000, 3),
    )
    # Example 3: the per-rank shard (NCCL ring message).
    row("3: shard, no padding", "40,000,000 / 64", 625_000, 40_000_000 // 64)
    row("3: shard, no padding", "625,000 % 65,536", 34_088, 625_000 % 2**16)
    row("3: shard, high-busbw padding", "padded / 64", 655_360, p2 // 64)
    row("3: shard, high-busbw padding", "shard % 65,536", 0, (p2 // 64) % 2**16)
    row("3: shard, high-busbw padding", "largest 2^k dividing shard", 2**16, two_adic(p2 // 64))
    # Worst case: dp 128, a bucket one element over the published divisor.
    d4 = math.lcm(128, 128, 2**16)
    p4 = _pad(8_388_609, d4)
    row("worst: dp=128, 8,388,609 elements", "divisor lcm(128,128,2**16)", 8_388_608, d4)
    row("worst: dp=128, 8,388,609 elements", "padded bucket (elements)", 16_777_216, p4)
    row("worst: dp=128, 8,388,609 elements", "overhead (elements)", 8_388_607, p4 - 8_388_609)
    return rows


EXAMPLE_COLUMNS = ("example", "quantity", "published", "formula", "agrees")


def published_example_findings(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One sentence per published number the formula contradicts, and the 2^16 claim."""
    return [
        f"published example {r['example']}: {r['quantity']} is "
        f"{r['formula']:,} by the formula, the published description says {r['published']:,}"
        if isinstance(r["formula"], int)
        else f"published example {r['example']}: {r['quantity']} is {r['formula']} by the "
        f"formula, the published description says {r['published']}"
        for r in rows
        if not r["agrees"]
    ] + [
        "the published claim that high-busbw padding makes every rank's shard divisible by 2^16 "
        "does not follow from lcm(dp, 128, 2**16): the bucket is divisible by 2^16, the shard "
        "only by 2^16/dp for power-of-two dp (see min_shard_pow2 in the padding table)"
    ]


def _format_cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_table(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """A plain fixed-width text table."""
    cells = [[_format_cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``verify layout``."""
    parser.description = (
        "Padding overhead of bucketed gradient buffers (distributed optimizer, default bucket "
        "size) for built-in models or your own (well under a second)."
    )
    parser.add_argument(
        "--model",
        action="append",
        choices=sorted(MODELS),
        help="built-in model parameter list (repeatable; default: all, unless your own model "
             "is given)",
    )
    parser.add_argument(
        "--dp", action="append", type=_positive_int,
        help=f"data-parallel size (repeatable; default {', '.join(map(str, DEFAULT_DPS))})",
    )
    parser.add_argument("--grad-bytes", type=_positive_int, action=SetOnce, default=GRAD_BYTES, help="bytes per grad element")
    parser.add_argument("--param-bytes", type=_positive_int, action=SetOnce, default=PARAM_BYTES, help="bytes per param element")
    parser.add_argument("--json", metavar="PATH", action=SetOnce,
                        help="write the report as JSON to PATH ('-': standard output instead "
                             "of the tables)")
    add_model_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """Print the padding report; 0 on success, 2 on bad usage, 3 when --json cannot be written."""
    try:
        if args.json not in (None, "-"):
            check_output_paths([("--json", args.json)])
        own = user_models(args)
    except (OutputPathError, ValueError) as exc:
        print(f"verify layout: error: {exc}", file=sys.stderr)
        return 2
    names = args.model or ([] if own else list(MODELS))
    models = [MODELS[m] for m in names] + own
    dps = args.dp or list(DEFAULT_DPS)
    rows = model_rows(models, dps, padding_row, grad_bytes=args.grad_bytes,
                      param_bytes=args.param_bytes)
    examples = published_examples()
    findings = published_example_findings(examples)
    if args.json is not None:
        text = json.dumps({"padding": rows, "published_examples": examples, "findings": findings},
                          indent=2)
        if args.json == "-":
            print(text)
            return 0
        return 3 if write_outputs([Output("--json", Path(args.json),
                                          lambda p: p.write_text(text + "\n"))],
                                  prog="verify layout") else 0
    print(
        "Padding overhead with the distributed optimizer, default bucket size "
        f"max(40M, 1M*dp), {args.grad_bytes}-byte grads + {args.param_bytes}-byte params"
    )
    print(format_table(PADDING_COLUMNS, rows))
    print()
    if own:  # the user's own model: their numbers, not ours (the JSON keeps everything)
        print("(Megatron-Core's published worked examples, recomputed: `verify layout` without a "
              "model of your own, or --json)")
        return 0
    print("Megatron-Core's published worked examples, recomputed from pad(v, lcm(dp, 128[, 2**16]))")
    print(format_table(EXAMPLE_COLUMNS, examples))
    print()
    for line in findings:
        print(f"* {line}")
    return 0

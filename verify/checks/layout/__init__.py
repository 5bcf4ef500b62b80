"""Check ``layout``: fastgrad's bucketed, padded buffers against refgrad's layout.

What it verifies (REFERENCE_NOTES section 1):
  * hand-derived small layouts, computed by both refgrad and the candidate;
  * random parameter lists (dp powers of two and not, bucket sizes, shared
    embeddings first/middle/last/larger than a bucket): candidate == refgrad
    exactly, and every invariant of the notes holds, with shards of all
    ranks covering every element exactly once;
  * a 10^5-parameter list: candidate == refgrad;
  * ``fastgrad.buffer.ParamAndGradBuffer`` on ``ctx.device``: views where the
    layout says, 64-element aligned, values kept, padding zero and invisible
    to the norm/checkpoint helpers;
  * (non-quick) real gloo reduce-scatter / all-reduce at dp 2 and 3 through
    the buffers, each rank's shard against an exact sum laid out by refgrad;
  * the padding-overhead report and the published worked examples.

Package layout: ``invariants`` (what every layout must satisfy), ``cases`` (hand-derived
and random cases), ``worker`` (the multi-rank reductions), ``buffers`` (single-process
buffer properties), ``entry`` (the candidate, the run function and the report glue).
"""

from verify.checks.layout.buffers import buffer_violations
from verify.checks.layout.cases import (
    HAND_CASES,
    HandCase,
    LayoutCase,
    compare_layouts,
    hand_case_mismatch,
    random_case,
)
from verify.checks.layout.entry import CHECK, LayoutCandidate, run
from verify.checks.layout.invariants import layout_violations, shard_coverage_violations
from verify.checks.layout.worker import (
    ReduceScenario,
    default_scenarios,
    expected_reduction,
    reduce_worker,
    run_reduce_scenarios,
)

__all__ = [
    "CHECK",
    "HAND_CASES",
    "HandCase",
    "LayoutCandidate",
    "LayoutCase",
    "ReduceScenario",
    "buffer_violations",
    "compare_layouts",
    "default_scenarios",
    "expected_reduction",
    "hand_case_mismatch",
    "layout_violations",
    "random_case",
    "reduce_worker",
    "run",
    "run_reduce_scenarios",
    "shard_coverage_violations",
]

"""Check ``layout``: a candidate's bucketed, padded buffers against refgrad's layout.

What it verifies (REFERENCE_NOTES section 1):
  * hand-derived small layouts, computed by both refgrad and the candidate;
  * random parameter lists (dp powers of two and not, bucket sizes, shared
    embeddings first/middle/last/larger than a bucket): candidate == refgrad
    exactly, and every invariant of the notes holds, with shards of all
    ranks covering every element exactly once;
  * a 10^5-parameter list: candidate == refgrad;
  * the candidate's buffer (fastgrad: ``fastgrad.buffer.ParamAndGradBuffer``) on
    ``ctx.device``: views where the layout says, 64-element aligned, values kept,
    padding zero and invisible to the norm/checkpoint helpers;
  * (non-quick) real gloo reduce-scatter / all-reduce at dp 2 and 3 through
    the buffers, each rank's shard against an exact sum laid out by refgrad;
  * the padding-overhead report and the published worked examples.

Package layout: ``invariants`` (what every layout must satisfy), ``cases`` (hand-derived
and random cases), ``worker`` (the multi-rank reductions), ``buffers`` (single-process
buffer properties), ``entry`` (the run function and the report glue). The implementation
is reached only through ``candidate.layout()`` (:mod:`verify.candidates.interfaces`).
"""

from verify.candidates.interfaces import LayoutCase
from verify.checks.layout.buffers import buffer_violations
from verify.checks.layout.cases import (
    HAND_CASES,
    HandCase,
    compare_layouts,
    hand_case_mismatch,
    random_case,
)
from verify.checks.layout.entry import CHECK, run
from verify.checks.layout.invariants import layout_violations, shard_coverage_violations
from verify.checks.layout.worker import (
    ReduceScenario,
    ScenarioResult,
    default_scenarios,
    expected_reduction,
    reduce_worker,
    run_reduce_scenarios,
    scenario_settings,
)

__all__ = [
    "CHECK",
    "HAND_CASES",
    "HandCase",
    "LayoutCase",
    "ReduceScenario",
    "ScenarioResult",
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
    "scenario_settings",
    "shard_coverage_violations",
]

"""The reduce_scatter check's run function and its registration."""

from __future__ import annotations

from verify.check import Check, CheckContext, CheckRecorder
from verify.checks.reduce_scatter.candidate import ReduceScatterCandidate
from verify.checks.reduce_scatter.local import (
    check_cuda_local_reduction,
    check_local_order_sensitive,
)
from verify.checks.reduce_scatter.models import (
    check_average,
    check_error_growth,
    check_models,
    check_production_sum_order,
)
from verify.checks.reduce_scatter.worker import check_multi_rank


def run(ctx: CheckContext, rec: CheckRecorder, candidate: ReduceScatterCandidate) -> None:
    """The ``reduce_scatter`` check against ``candidate`` (default: fastgrad's)."""
    check_multi_rank(ctx, rec, candidate)
    check_local_order_sensitive(ctx, rec, candidate)
    check_cuda_local_reduction(ctx, rec, candidate)
    check_models(ctx, rec)
    check_error_growth(ctx, rec)
    check_average(ctx, rec)
    check_production_sum_order(ctx, rec)


CHECK = Check(
    name="reduce_scatter",
    summary="fp32-accumulating reduce-scatter vs refgrad (bitwise, gloo W=2..4); error growth with N",
    run=run,
    default_candidate=ReduceScatterCandidate.default(),
    spawns_ranks=True,
)

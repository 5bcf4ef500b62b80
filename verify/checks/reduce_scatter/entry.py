"""The reduce_scatter check's run function and its registration."""

from __future__ import annotations

import concurrent.futures

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
from verify.distributed import spawn

CHECK_NAME = "reduce_scatter"


def _local_parts(ctx: CheckContext, rec: CheckRecorder, candidate: ReduceScatterCandidate) -> None:
    """Everything but the multi-rank part and the measurement of torch's own sum order."""
    check_local_order_sensitive(ctx, rec, candidate)
    check_cuda_local_reduction(ctx, rec, candidate)
    check_models(ctx, rec)
    check_error_growth(ctx, rec)
    check_average(ctx, rec)


def _local_parts_process(rank: int, world: int, ctx: CheckContext,
                         candidate: ReduceScatterCandidate) -> CheckRecorder:
    """:func:`_local_parts` in a process of its own (``spawn`` with one rank)."""
    rec = CheckRecorder(CHECK_NAME)
    _local_parts(ctx, rec, candidate)
    return rec


def run(ctx: CheckContext, rec: CheckRecorder, candidate: ReduceScatterCandidate) -> None:
    """The ``reduce_scatter`` check against ``candidate`` (default: fastgrad's)."""
    # The local parts are seconds of Python-bound refgrad arithmetic: in a process of
    # their own they run beside the multi-rank part instead of holding this process's
    # interpreter lock (``verify run`` runs two checks in threads of one process).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        local = pool.submit(spawn, _local_parts_process, 1, ctx, candidate, timeout_s=ctx.timeout_s)
        check_multi_rank(ctx, rec, candidate)
        rec.absorb(local.result()[0])
    # Measured here, in the process (and torch thread count) a user's own code runs in.
    check_production_sum_order(ctx, rec)


CHECK = Check(
    name=CHECK_NAME,
    summary="fp32-accumulating reduce-scatter vs refgrad (bitwise, gloo W=2..4); error growth with N",
    run=run,
    default_candidate=ReduceScatterCandidate.default(),
    spawns_ranks=True,
)

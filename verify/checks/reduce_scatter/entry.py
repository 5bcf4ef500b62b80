"""The reduce_scatter check's run function and its registration."""

from __future__ import annotations

import concurrent.futures

from verify.candidates import Candidate, Technique
from verify.check import Check, CheckContext, CheckRecorder, launcher_for
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
from verify.checks.reduce_scatter.sharded import check_sharded
from verify.checks.reduce_scatter.worker import check_multi_rank
from verify.distributed import spawn

CHECK_NAME = "reduce_scatter"


def _local_parts(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """Everything but the multi-rank part and the measurement of torch's own sum order."""
    with candidate.grad_reduction() as reduction:
        check_local_order_sensitive(ctx, rec, reduction)
        check_cuda_local_reduction(ctx, rec, reduction)
    check_models(ctx, rec)
    check_error_growth(ctx, rec)
    check_average(ctx, rec)


def _local_parts_process(rank: int, world: int, ctx: CheckContext,
                         candidate: Candidate) -> CheckRecorder:
    """:func:`_local_parts` in a process of its own (``spawn`` with one rank)."""
    rec = CheckRecorder(CHECK_NAME)
    _local_parts(ctx, rec, candidate)
    return rec


def run(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """The ``reduce_scatter`` check against ``candidate``'s grad reduction (default: fastgrad's)."""
    candidate.grad_reduction()  # a candidate without the technique: SKIP, nothing run
    # The local parts are seconds of Python-bound refgrad arithmetic: in a process of
    # their own they run beside the multi-rank part instead of holding this process's
    # interpreter lock (``verify run`` runs two checks in threads of one process).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        local = pool.submit(spawn, _local_parts_process, 1, ctx, candidate, timeout_s=ctx.timeout_s,
                            launcher=launcher_for(candidate))
        check_multi_rank(ctx, rec, candidate)
        check_sharded(ctx, rec, candidate)
        rec.absorb(local.result()[0])
    # Measured here, in the process (and torch thread count) a user's own code runs in.
    check_production_sum_order(ctx, rec)


CHECK = Check(
    name=CHECK_NAME,
    summary="fp32-accumulating reduce-scatter and the DDP bucket reduction vs refgrad (bitwise, "
            "gloo W=2..6); error growth with N",
    run=run,
    spawns_ranks=True,
    technique=Technique.GRAD_REDUCTION,
)

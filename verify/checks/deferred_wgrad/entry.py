"""The deferred_wgrad check's run function and its registration."""

from __future__ import annotations

from verify.check import Check, CheckContext, CheckRecorder
from verify.checks.deferred_wgrad.candidate import DeferredWgradCandidate
from verify.checks.deferred_wgrad.comparisons import check_cuda_wgrad, run_deferred_wgrad_check


def run(ctx: CheckContext, rec: CheckRecorder, candidate: DeferredWgradCandidate) -> None:
    """The ``deferred_wgrad`` check against ``candidate`` (default: fastgrad's layer)."""
    run_deferred_wgrad_check(ctx, rec, candidate)
    check_cuda_wgrad(ctx, rec, candidate)


CHECK = Check(
    name="deferred_wgrad",
    summary="Deferred embedding wgrad: bitwise vs immediate (or the drain order), vs refgrad, tied grads",
    run=run,
    default_candidate=DeferredWgradCandidate.default(),
    spawns_ranks=True,
)

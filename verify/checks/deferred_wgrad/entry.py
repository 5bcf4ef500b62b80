"""The deferred_wgrad check's run function and its registration."""

from __future__ import annotations

from verify.candidates import Candidate, Technique
from verify.check import Check, CheckContext, CheckRecorder, run_part
from verify.checks.deferred_wgrad.comparisons import check_cuda_wgrad, run_deferred_wgrad_check


def run(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """The ``deferred_wgrad`` check against ``candidate``'s output layer and wgrad GEMMs."""
    # Unsupported from the accessor: nothing can run (SKIP). The ranks enter their own.
    candidate.deferred_wgrad()
    run_deferred_wgrad_check(ctx, rec, candidate)
    if ctx.device != "cuda":
        rec.skip("CUDA wgrad GEMM (cuBLAS, fp32 output) vs refgrad: run `verify run --device cuda`")
        return
    with rec.skip_if_unsupported():
        run_part(ctx, rec, candidate, _cuda_wgrad)


def _cuda_wgrad(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """The candidate's wgrad GEMMs on CUDA vs refgrad, inside its deferred-wgrad scope."""
    with candidate.deferred_wgrad() as wgrad:
        check_cuda_wgrad(ctx, rec, wgrad)


CHECK = Check(
    name="deferred_wgrad",
    summary="Deferred embedding wgrad: bitwise vs immediate (or the drain order), vs refgrad, tied grads",
    run=run,
    spawns_ranks=True,
    technique=Technique.DEFERRED_WGRAD,
)

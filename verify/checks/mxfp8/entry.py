"""The mxfp8 check's run function and its registration."""

from __future__ import annotations

from verify.candidates import Candidate, Technique
from verify.check import Check, CheckContext, CheckRecorder, run_part
from verify.checks.mxfp8.drift import check_drift
from verify.checks.mxfp8.memory import check_memory
from verify.checks.mxfp8.quantizer import (
    check_gpu_kernel,
    check_quantizer,
    conformance_table,
    rceil_versus_fp32_division,
)
from verify.checks.mxfp8.sharing import check_sharing

# ----------------------------------------------------------------------------- entry


def run(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """The ``mxfp8`` check against ``candidate``'s quantizer and MXFP8 param all-gather."""
    candidate.mxfp8()  # Unsupported from the accessor: nothing can run (SKIP).
    run_part(ctx, rec, candidate, _quantizer_parts)
    with rec.skip_if_unsupported():  # the ranks enter the candidate's mxfp8 themselves
        rank0 = check_sharing(ctx, rec, candidate)
        if rank0 is not None:  # None: the sharing run crashed (recorded as its crash)
            check_memory(rec, rank0)
    run_part(ctx, rec, candidate, _drift)


def _quantizer_parts(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """The quantizer against the spec, its GPU kernel, the conformance table, RCEIL."""
    with candidate.mxfp8() as mxfp8:
        results = check_quantizer(ctx, rec, mxfp8)
        with rec.skip_if_unsupported():
            check_gpu_kernel(ctx, rec, mxfp8)
        conformance_table(ctx, rec, results, candidate.name, mxfp8)
        rceil_versus_fp32_division(ctx, rec, mxfp8)


def _drift(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    with candidate.mxfp8() as mxfp8:
        check_drift(ctx, rec, mxfp8)


CHECK = Check(
    name="mxfp8",
    summary="MXFP8 quantization (4 scale modes) vs the exact spec, and grad-buffer sharing for MXFP8 param all-gather",
    run=run,
    spawns_ranks=True,
    technique=Technique.MXFP8,
)

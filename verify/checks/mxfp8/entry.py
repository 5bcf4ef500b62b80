"""The mxfp8 check's candidate, its run function and its registration."""

from __future__ import annotations

from dataclasses import dataclass

from fastgrad import mxfp8 as fast
from verify.check import Check, CheckContext, CheckRecorder
from verify.checks.mxfp8.drift import check_drift
from verify.checks.mxfp8.memory import check_memory
from verify.checks.mxfp8.quantizer import (
    QuantizeFn,
    check_quantizer,
    check_triton,
    conformance_table,
    rceil_versus_fp32_division,
)
from verify.checks.mxfp8.sharing import check_sharing

# ----------------------------------------------------------------------------- entry


@dataclass(frozen=True)
class MXFP8Candidate:
    """The MXFP8 quantizer under test: ``quantize(x, *, scale_mode, block_size) -> (scales, bits)``."""

    quantize: QuantizeFn = fast.quantize

    def __post_init__(self) -> None:
        if not callable(self.quantize):
            raise TypeError("MXFP8Candidate.quantize must be callable")

    @classmethod
    def default(cls) -> MXFP8Candidate:
        """``fastgrad.mxfp8.quantize``."""
        return cls()


def run(ctx: CheckContext, rec: CheckRecorder, candidate: MXFP8Candidate) -> None:
    """The ``mxfp8`` check against ``candidate`` (default: fastgrad's quantizer)."""
    results = check_quantizer(ctx, rec, candidate.quantize)
    check_triton(ctx, rec)
    conformance_table(ctx, rec, results)
    rceil_versus_fp32_division(ctx, rec)
    rank0 = check_sharing(ctx, rec)
    check_memory(rec, rank0)
    check_drift(ctx, rec)


CHECK = Check(
    name="mxfp8",
    summary="MXFP8 quantization (4 scale modes) vs the exact spec, and grad-buffer sharing for MXFP8 param all-gather",
    run=run,
    default_candidate=MXFP8Candidate.default(),
    spawns_ranks=True,
)

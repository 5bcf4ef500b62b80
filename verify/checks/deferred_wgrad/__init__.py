"""Check ``deferred_wgrad``: deferred embedding wgrad vs immediate, vs refgrad, and tied grads.

What it establishes, on real gloo process groups (2 processes):

1. Deferred vs immediate ``main_grad``, bitwise, over two iterations (``main_grad``
   carries over from the first into the second), for M in {1, 3, 8}
   microbatches, limit in {0, 1, 2, M}, TP 1 (rank-specific data on each
   process) and TP 2 with sequence parallelism off and on, fp32 and bf16
   ``main_grad``. Where the deferral changes the order of the fp32 adds
   (``0 < limit < M``) bitwise equality with microbatch order does not hold
   (fp32 addition is not associative); there the check requires bitwise equality
   with the immediate path run in production's drain order
   (``limit..M-1, 0..limit-1``) instead, and holds the microbatch-order result
   to the Higham bound, reporting the ULP distances it finds.
   dgrads must be bitwise equal in every case (they always run at once).
2. The candidate vs refgrad (``refgrad.deferred_wgrad.reference_main_grad`` in the order
   the adds really happen): bitwise on a small-integer grid where every partial
   sum is exact in the ``main_grad`` format; within
   ``fastgrad_error_factor(T, 2M) * A`` elementwise on random data (the GEMM's
   summation order is the only unfixed rounding), with ULPs reported.
3. The 0-entry drain (immediate mode; a second drain) returns 0 and leaves
   ``main_grad`` bitwise unchanged; 1-entry drains run (limit 1, M = 1).
4. Tied embeddings (stage 0 = word embedding, stage 1 = deferred output layer):
   after the embedding-group all-reduce both stages hold bitwise the same
   ``main_grad``, equal to refgrad's correctly rounded sum of the two.
5. The in-flight guard refuses to drain into a bucket whose reduce has started.
6. A step abandoned after a backward (entries left in both buffers) does not
   leak into the next step: ``start_step`` clears both (production clears one).

Package layout: ``cases`` (the case matrix and its data), ``worker`` (one rank's run),
``comparisons`` (what the results must satisfy), ``entry`` (the run function and the
registration). The implementation is reached only through ``candidate.deferred_wgrad()``
(:mod:`verify.candidates.interfaces`).
"""

from verify.checks.deferred_wgrad.cases import (
    WgradCase,
    build_cases,
    case_data,
    compared_with_refgrad,
)
from verify.checks.deferred_wgrad.comparisons import (
    compare_wgrad_gemms_on,
    run_deferred_wgrad_check,
)
from verify.checks.deferred_wgrad.entry import CHECK, run
from verify.checks.deferred_wgrad.worker import run_case_on_rank

__all__ = [
    "CHECK",
    "WgradCase",
    "build_cases",
    "case_data",
    "compare_wgrad_gemms_on",
    "compared_with_refgrad",
    "run",
    "run_case_on_rank",
    "run_deferred_wgrad_check",
]

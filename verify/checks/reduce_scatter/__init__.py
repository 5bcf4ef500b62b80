"""Check ``reduce_scatter``: a candidate's DP gradient reduction vs refgrad, and error growth.

The candidate (fastgrad by default, Megatron-Core, or a broken one) is reached only through
its :class:`~verify.candidates.interfaces.GradReduction` (``candidate.grad_reduction()``):

1. On real gloo groups of 2, 3 and 4 ranks (quick: 2 and 3), with rank-specific
   fp16/bf16 inputs and two iterations, every mode of the candidate's fp32-accumulating
   reduce-scatter (fastgrad: ``fastgrad.reduce_scatter.reduce_scatter_with_fp32_accumulation``;
   sync, async, caller scratch, in place; SUM and AVG, the ops and forms it has: the others
   are skips naming why) must equal ``refgrad.reduce_scatter.reduce_scatter(
   accumulate="fp32", order="rank")`` bitwise.
2. The vectorised models used by ``verify accumulation`` (ring, rank, tree in the
   wire dtype; fp32 accumulation) must equal refgrad bitwise, and the sweep's
   fast exact reference must equal ``verify.oracle`` bitwise.
3. A small error-growth sweep against the exact oracle, with expectations that
   follow from proofs (fp32 accumulation of same-sign data is within 1 ULP) or
   from large statistical margins (the ring's error grows, fp32's does not).
4. Order-sensitive inputs (exponents spread wider than fp32's 24 bits, so fp32 partial
   sums round differently in another order; the check asserts this with refgrad): the
   candidate's local reduction at W=3, 4, 5, 8 and its reduce-scatter on gloo groups of
   3 (and 4) ranks must equal refgrad fp32/rank bitwise, so any change of summation
   order fails here.
5. The whole DP reduction as the candidate's DDP runs it on a bucket (``buckets``): the
   mean as a pre-scale by 1/W in the grad dtype or AVG in the collective, reduce-scatter or
   all-reduce, plain or fp32-accumulating, at W = 2..4 (quick 2, 3) and, for the
   average-sensitive inputs, W = 3, 5, 6; a plain DDP once more after the fp32-accumulating
   ones. Held to refgrad's DP mean; where the candidate documents a departure (the
   pre-scale; gloo's reverse-ring sum in the grad dtype) it is held bitwise to refgrad's
   model of it and the distance from the spec is a documented difference, not a failure.
6. Measured, reported as tables and findings: production's averaging (pre-scale
   by 1/W in the 16-bit dtype) vs dividing the fp32 sum, against the exact
   average; and whether production's ``torch.sum(dim=0, dtype=float32)`` local
   reduction follows rank order.

Package layout: ``cases`` (inputs and the bucket cases), ``worker`` (the multi-rank part),
``buckets`` (the DDP bucket cases, in the ranks and their classification), ``local`` (the
local reduction on order-sensitive inputs and on CUDA), ``models`` (the sweep's models, error
growth, averaging, sum order), ``entry`` (the run function and the registration).
"""

from verify.checks.reduce_scatter.cases import order_sensitive_input, rank_input
from verify.checks.reduce_scatter.entry import CHECK, run
from verify.checks.reduce_scatter.local import (
    check_cuda_local_reduction,
    check_local_order_sensitive,
    compare_local_reduction_on,
)
from verify.checks.reduce_scatter.models import (
    check_average,
    check_error_growth,
    check_models,
    check_production_sum_order,
)
from verify.checks.reduce_scatter.worker import check_multi_rank

__all__ = [
    "CHECK",
    "check_average",
    "check_cuda_local_reduction",
    "check_error_growth",
    "check_local_order_sensitive",
    "check_models",
    "check_multi_rank",
    "check_production_sum_order",
    "compare_local_reduction_on",
    "order_sensitive_input",
    "rank_input",
    "run",
]

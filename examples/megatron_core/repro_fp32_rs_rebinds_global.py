"""A plain DistributedDataParallel built after one with reduce_scatter_with_fp32_accumulation.

megatron/core/distributed/param_and_grad_buffer.py _ParamAndGradBucketGroup.__init__ rebinds
the module global ``dist_reduce_scatter_func`` for the rest of the process. The second DDP
(config False, overlap_grad_reduce=True) then reduce-scatters through the fp32 function but
waits on the coalescing manager's handle, so the fp32 function's wait() (which sums and
writes the shard) never runs: every rank keeps its own pre-scaled grads.

    python examples/megatron_core/repro_fp32_rs_rebinds_global.py
"""

from _common import report

from verify.candidates.megatron_core.findings.reduction import case_findings, rebind_finding
from verify.candidates.megatron_core.reduction import ReductionCase, run_reductions

if __name__ == "__main__":
    cases = [ReductionCase(3, reduce_scatter_with_fp32_accumulation=True), ReductionCase(3)]
    first, second = run_reductions(cases)
    report([rebind_finding(cases[1], second), *case_findings(cases[1], second)])

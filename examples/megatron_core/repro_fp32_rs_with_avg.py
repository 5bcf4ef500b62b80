"""reduce_scatter_with_fp32_accumulation with average_in_collective: the config is accepted,
the first grad sync fails ``assert op == ReduceOp.SUM`` (no message).

    python examples/megatron_core/repro_fp32_rs_with_avg.py
"""

from _common import report

from verify.candidates.megatron_core.findings.reduction import case_findings
from verify.candidates.megatron_core.reduction import ReductionCase, run_reductions

if __name__ == "__main__":
    case = ReductionCase(2, reduce_scatter_with_fp32_accumulation=True, average_in_collective=True)
    (ranks,) = run_reductions([case])
    report(case_findings(case, ranks))

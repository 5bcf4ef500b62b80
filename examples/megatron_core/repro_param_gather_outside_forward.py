"""overlap_param_gather: the wait for a bucket's param all-gather is in the forward pre-hook of
each module that owns the params (distributed_data_parallel.py _make_forward_pre_hook). Params
read outside their owning module's forward (here: the modules are never called) keep the
previous step's values on the pieces other DP ranks own, silently. Megatron-Core's own models
always call the owning modules; this is a documented contract, reported as production
behaviour (exit 0), with the stale pieces shown.

    python examples/megatron_core/repro_param_gather_outside_forward.py
"""

from _common import report

from verify.candidates.megatron_core.findings.optim import case_findings
from verify.candidates.megatron_core.optim import OptimCase, run_optim

if __name__ == "__main__":
    case = OptimCase(overlap_param_gather=True, call_owning_modules=False)
    report([f for f in case_findings(case, run_optim(case)) if "all-gather" in f.name])

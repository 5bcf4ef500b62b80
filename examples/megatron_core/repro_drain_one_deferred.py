"""megatron/core/utils.py drain_embedding_wgrad_compute with exactly one deferred entry
(``--wgrad-deferral-limit 1``, or one microbatch): UnboundLocalError on ``drain_idx`` after
both buffers were emptied, so that microbatch's wgrad never reaches main_grad.

    python examples/megatron_core/repro_drain_one_deferred.py
"""

from _common import report

from verify.candidates.megatron_core.deferred_wgrad import DeferredWgradCase, run_deferred_wgrad
from verify.candidates.megatron_core.findings.deferred_wgrad import case_findings

if __name__ == "__main__":
    case = DeferredWgradCase(num_microbatches=4, wgrad_deferral_limit=1)
    (ranks,) = run_deferred_wgrad([case])
    report(case_findings(case, ranks))

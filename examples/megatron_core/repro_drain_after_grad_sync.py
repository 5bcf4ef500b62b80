"""defer_embedding_wgrad_compute with overlap_grad_reduce (PP 2, DP 2, bf16, distributed
optimizer, wired as Megatron-LM's training.py): forward_backward_pipelining_without_interleaving
calls config.grad_sync_func (every bucket's reduce-scatter) before
finish_embedding_wgrad_compute (the drain), so the output layer's deferred wgrads are added
to main_grad after its reduction started. Without grad_sync_func the same happens from the
second step on (the hooks launch the bucket during the last backward).

    python examples/megatron_core/repro_drain_after_grad_sync.py
"""

from _common import report

from verify.candidates.megatron_core.findings.pipeline import case_findings
from verify.candidates.megatron_core.pipeline import PipelineCase, run_pipeline

if __name__ == "__main__":
    case = PipelineCase(output_head=True)
    report(case_findings(case, run_pipeline(case)))

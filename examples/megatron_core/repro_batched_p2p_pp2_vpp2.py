"""PP 2 with VPP 2 and batch_p2p_comm=True (ModelParallelConfig's default; Megatron-LM turns it
off with VPP unless --no-overlap-p2p-communication): at PP 2 the previous and the next rank
are the same rank, _batched_p2p_ops matches send_prev/send_next in posting order, and a stage
receives an input gradient in place of an activation. Known upstream: NVIDIA/Megatron-LM
issues 1450 and 750.

    python examples/megatron_core/repro_batched_p2p_pp2_vpp2.py
"""

from _common import report

from verify.candidates.megatron_core.findings.pipeline import case_findings
from verify.candidates.megatron_core.pipeline import PipelineCase, run_pipeline

if __name__ == "__main__":
    case = PipelineCase(virtual_pipeline=2, overlap_p2p_comm=False, steps=1)
    report(case_findings(case, run_pipeline(case)))

"""fastgrad, gradverify's own implementation, as the default candidate.

Each technique's adapter lives in a module of its own here (``verify.candidates.fastgrad.<technique>``)
and is imported by the accessor that returns it, where the technique runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from verify.candidates.interfaces import Behaviour, Candidate, CandidateInfo, DocumentedBehaviour

if TYPE_CHECKING:  # the technique interfaces, for annotations only
    from verify.candidates.interfaces import (
        MXFP8,
        BucketLayout,
        DeferredWgrad,
        DistributedOptimizerStep,
        GradReduction,
        PipelineTraining,
    )

DOCUMENTED: dict[Behaviour, DocumentedBehaviour] = {
    Behaviour.PRESCALE: DocumentedBehaviour(
        "the DP mean is every rank's grads multiplied by 1/W in the grad dtype, then a SUM "
        "(production's default averaging)",
        "fastgrad.averaging.grad_averaging (the plan), applied by fastgrad.bucket.Bucket."
        "start_grad_sync or, with the fp32-accumulating reduce-scatter, inside "
        "fastgrad.reduce_scatter.reduce_shards_fp32 (prescale=)"),
    Behaviour.WIRE_COLLECTIVE: DocumentedBehaviour(
        "the plain collective accumulates in the grad dtype in gloo's reverse-ring order "
        "(AVG: that sum divided by W)",
        "fastgrad.bucket.ReduceScatterStrategy (fastgrad.comm.reduce_scatter_into) / "
        "AllReduceStrategy (torch.distributed.all_reduce)"),
}


@dataclass(frozen=True)
class FastgradCandidate(Candidate):
    """fastgrad as published."""

    name = "fastgrad"
    code_modules = ("fastgrad", "verify.candidates.fastgrad")
    # fastgrad keeps no process-wide state (DESIGN.md's ground rules): its configurations
    # may share rank processes, which keeps the checks fast.
    isolates_configurations = False

    def info(self) -> CandidateInfo:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("gradverify")
        except PackageNotFoundError:  # run from a source tree that is not installed
            installed = "source tree"
        return CandidateInfo(name=self.name, version=installed,
                             description="gradverify's own implementation (fastgrad)")

    def documented(self, behaviour: Behaviour) -> DocumentedBehaviour | None:
        return DOCUMENTED.get(behaviour)

    def layout(self) -> BucketLayout:
        """``fastgrad.layout.compute_layout`` and ``fastgrad.buffer.ParamAndGradBuffer``."""
        from verify.candidates.fastgrad.layout import FastgradLayout

        return FastgradLayout()

    def grad_reduction(self) -> GradReduction:
        """``fastgrad.reduce_scatter`` and ``fastgrad.buffer``'s buckets."""
        from verify.candidates.fastgrad.grad_reduction import FastgradGradReduction

        return FastgradGradReduction()

    def deferred_wgrad(self) -> DeferredWgrad:
        """``fastgrad.deferred_wgrad.ColumnParallelOutputLayer`` and its wgrad GEMM."""
        from verify.candidates.fastgrad.deferred_wgrad import FastgradDeferredWgrad

        return FastgradDeferredWgrad()

    def mxfp8(self) -> MXFP8:
        """``fastgrad.mxfp8`` (the Triton kernel on CUDA) and ``fastgrad.mxfp8_sharing``."""
        from verify.candidates.fastgrad.mxfp8 import FastgradMXFP8

        return FastgradMXFP8()

    def pipeline(self) -> PipelineTraining:
        """``fastgrad.ddp`` under ``fastgrad.pipeline``'s 1F1B schedules."""
        from verify.candidates.fastgrad.pipeline import FastgradPipeline

        return FastgradPipeline()

    def optimizer(self) -> DistributedOptimizerStep:
        """``fastgrad.optim``'s DistributedOptimizer / ReplicatedOptimizer over fastgrad's stages."""
        from verify.candidates.fastgrad.optimizer import FastgradOptimizer

        return FastgradOptimizer()

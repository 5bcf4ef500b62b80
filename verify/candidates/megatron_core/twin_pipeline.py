"""The preflight twin's part of Megatron-Core's
:class:`~verify.candidates.interfaces.PipelineTraining`: :meth:`~StagesForOptimizer.model`
(:class:`~verify.candidates.megatron_core.stages.MegatronStages`, trained step by step under
Megatron-Core's optimizer) and ``model_support``, a mixin of
:class:`~verify.candidates.megatron_core.pipeline_training.MegatronPipeline` beside the
``pipeline`` check's SGD ``train``.
"""

from __future__ import annotations

from gradvocab import Averaging, ParallelDims
from verify.candidates.interfaces import (
    ModelSupport,
    PipelineCase,
    StageSettings,
    Technique,
    Unsupported,
)
from verify.candidates.megatron_core.stages import MegatronStages
from verify.candidates.megatron_core.version import installed

CANDIDATE = "megatron-core"
TENSOR_PARALLEL = ("the twin's TP > 1 model (a vocab-parallel output layer with a TP-split loss, "
                   "Linear+tanh blocks replicated on sequence shards) is not wired to "
                   "Megatron-Core's tensor-parallel layers")
SHARED_WEIGHT_AT_PP1 = ("one weight for the twin's first Linear layer and Megatron-Core's output "
                        "layer at PP 1 is not wired (Megatron ties its word embedding and output "
                        "layer inside LanguageModule, which the Linear+tanh stack does not have)")
REPLICATED_OPTIMIZER = ("the twin reads Megatron-Core's fp32 masters and Adam moments from its "
                        "DistributedOptimizer's shards only (the replicated "
                        "Float16OptimizerWithFloat16Params / FP32Optimizer keep them elsewhere)")


def unsupported(reason: str) -> Unsupported:
    """:class:`Unsupported` for the pipeline technique, naming this candidate."""
    return Unsupported(Technique.PIPELINE, f"{CANDIDATE} {reason}")


def require_features(case: PipelineCase, *also: str) -> None:
    """Unsupported (decided from the case, so on every rank alike) where the installed
    version lacks what ``case`` needs: its schedule, reduction and output head (and ``also``)."""
    needed = ["schedule_1f1b" if case.virtual_stages == 1 else "schedule_interleaved", *also]
    if case.reduce_scatter_with_fp32_accumulation:
        needed.append("reduce_scatter_with_fp32_accumulation")
    if case.reduction.megatron_flags().average_in_collective:
        needed.append("average_in_collective")
    if case.spec.output_head:
        needed += ["defer_embedding_wgrad_compute", "fused_wgrad_gemm"]
    reason = installed().skip_reason(*needed)
    if reason is not None:
        raise unsupported(reason)


class StagesForOptimizer:
    """``PipelineTraining.model`` and ``model_support`` for Megatron-Core."""

    def ddp_class(self) -> type:
        """The DDP class each model chunk is wrapped in (a test's broken candidate returns a
        subclass)."""
        from megatron.core.distributed import DistributedDataParallel

        return DistributedDataParallel

    def model_support(self) -> ModelSupport:
        found = installed()
        mxfp8 = None if found.has("mxfp8_param_buffer_sharing") else (
            found.features["mxfp8_param_buffer_sharing"].reason)
        return ModelSupport(tensor_parallel=TENSOR_PARALLEL, mxfp8_params=mxfp8 or (
            "the twin's MXFP8 params are not wired to Transformer Engine's MXFP8Tensor"),
                            shared_weight_at_pp1=SHARED_WEIGHT_AT_PP1,
                            replicated_optimizer=REPLICATED_OPTIMIZER)

    def model(self, case: PipelineCase, grid: ParallelDims, settings: StageSettings) -> MegatronStages:
        """Megatron-Core's stages of ``case``; Unsupported (decided from the case, so on every
        rank alike, before any collective) for what :meth:`model_support` names or the
        installed version lacks."""
        support = self.model_support()
        for needed, reason in ((case.tp_size > 1, support.tensor_parallel),
                               (settings.mxfp8 is not None, support.mxfp8_params),
                               (case.spec.shares_one_weight, support.shared_weight_at_pp1),
                               (not case.use_distributed_optimizer, support.replicated_optimizer)):
            if needed and reason is not None:
                raise unsupported(reason)
        require_features(case, "distributed_optimizer")
        if case.reduction is Averaging.SUM:
            raise unsupported("averages its grads over DP (the twin's reduction is 'prescale')")
        return MegatronStages(case, grid, settings, self.ddp_class())


__all__ = ["StagesForOptimizer", "require_features", "unsupported"]

"""Megatron-Core behind the seam (``verify.candidates.interfaces``): ``MegatronCoreCandidate``.

Each accessor returns the technique's interface, running Megatron-Core's own code:

=================  ==================================================================
technique          interface (module in this package), and the driver of its findings
=================  ==================================================================
layout             ``bucket_layout.MegatronLayout``: ``_ParamAndGradBuffer`` and
                   ``DistributedDataParallel`` (driver: ``layout``)
reduce_scatter     ``grad_reduction.MegatronGradReduction``: its fp32-accumulating
                   reduce-scatter and DDP's bucket reduction (driver: ``reduction``)
deferred_wgrad     ``output_layer.MegatronDeferredWgrad``: ``ColumnParallelLinear`` and the
                   schedules' drain (driver: ``deferred_wgrad``)
pipeline           ``pipeline_training.MegatronPipeline``: DDP under the 1F1B schedules
                   (driver: ``pipeline``); the preflight twin's stages step by step
                   (``twin_pipeline``, ``stages``)
optim              ``optimizer.MegatronOptimizer``: ``get_megatron_optimizer`` over its DDP
                   chunks (driver: ``optim``)
mxfp8              Unsupported with the reason (``mxfp8``: Transformer Engine, CUDA only)
=================  ==================================================================

Each interface is used inside ``with``: the scope (``scope.MegatronScope``) holds the CPU
redirects and what else Megatron assumes of the process. Where Megatron-Core departs from
refgrad's spec by design, :meth:`MegatronCoreCandidate.documented` names the behaviour and
where it lives, and the checks hold it to refgrad's model of it.

What cannot run here (the installed version lacks it, or it needs CUDA) raises
:class:`~verify.candidates.interfaces.Unsupported` with the reason read from the installed code
(:mod:`verify.candidates.megatron_core.version`); without megatron-core every technique
is Unsupported, saying how to install it. Importing this module does not import
Megatron-Core (``verify.candidates.registry`` imports it to list the candidate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import torch

from verify.candidates.interfaces import (
    OPTIMIZER_BEHAVIOURS,
    Behaviour,
    Candidate,
    CandidateInfo,
    DocumentedBehaviour,
    Finding,
    Technique,
    Unsupported,
)
from verify.candidates.megatron_core.findings import FINDINGS
from verify.candidates.megatron_core.redirect import REDIRECTS
from verify.candidates.megatron_core.version import (
    installed,
    missing_reason,
    require_modelled_adamw,
)

if TYPE_CHECKING:  # the adapters import Megatron-Core's modules where a technique runs
    from verify.candidates.megatron_core.bucket_layout import MegatronLayout
    from verify.candidates.megatron_core.grad_reduction import MegatronGradReduction
    from verify.candidates.megatron_core.optimizer import MegatronOptimizer
    from verify.candidates.megatron_core.output_layer import MegatronDeferredWgrad
    from verify.candidates.megatron_core.pipeline_training import MegatronPipeline


BUFFER = "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync"
DOCUMENTED: dict[Behaviour, DocumentedBehaviour] = {
    Behaviour.BUFFER_ALIGNMENT_FROM_ALLOCATOR: DocumentedBehaviour(
        "leaves its buffers' memory alignment to the allocator: each param view sits at a "
        "64-element offset from its buffer's start, the start is where torch.zeros put it "
        "(CUDA's caching allocator: 512-byte blocks; torch's CPU allocator: 64 bytes)",
        "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__ "
        "(_pad_start_of_param_if_needed; grad_data and param_data from torch.zeros)"),
    Behaviour.ONE_BUCKET_AFTER_FIRST_STAGE: DocumentedBehaviour(
        "one bucket on every pipeline stage after the first and in every model chunk after "
        "the first, whatever bucket size was asked",
        "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.__init__ "
        "(bucket_size = None when disable_bucketing or pp_rank > 0; Megatron-LM's get_model "
        "passes disable_bucketing for model chunks after the first)"),
    Behaviour.PRESCALE: DocumentedBehaviour(
        "the DP mean is every rank's bucket multiplied by 1/W in the grad dtype, then a SUM "
        "(average_in_collective=False, the default)",
        f"{BUFFER} (bucket.grad_data *= gradient_scaling_factor; 1/dp from megatron.core."
        "distributed.distributed_data_parallel.DistributedDataParallel.__init__)"),
    Behaviour.WIRE_COLLECTIVE: DocumentedBehaviour(
        "the plain collective accumulates in the grad dtype in gloo's reverse-ring order "
        "(ReduceOp.AVG: that sum divided by W)",
        f"{BUFFER} (dist_reduce_scatter_func = torch.distributed.reduce_scatter_tensor, or "
        "torch.distributed.all_reduce without the distributed optimizer)"),
    Behaviour.TORCH_ADAMW_ORDER: DocumentedBehaviour(
        "AdamW in torch.optim.AdamW's order of operations (Megatron-Core falls back to it without "
        "Transformer Engine or apex)",
        "megatron/core/optimizer/__init__.py (torch.optim.AdamW as Adam); refgrad model: "
        "refgrad/optim_torch.py torch_order_step, with torch's CPU fp32 sqrt"),
    Behaviour.NO_DECAY_ON_1D_PARAMS: DocumentedBehaviour(
        "no weight decay on 1-D params and biases",
        "megatron/core/optimizer/__init__.py get_standard_config_overrides (wd_mult 0), applied by "
        "megatron/core/optimizer_param_scheduler.py OptimizerParamScheduler.step"),
    Behaviour.PARTIAL_SUM_GRAD_NORM: DocumentedBehaviour(
        "global grad norm from fp32 partial sums (per-param fp32 norms, their norm, squared and "
        "summed over ranks in fp32), clipped with max_norm / (norm + 1e-6)",
        "megatron/core/optimizer/clip_grads.py get_grad_norm_fp32 with "
        "megatron/core/utils.py local_multi_tensor_l2_norm; clip_grad_by_total_norm_fp32"),
    Behaviour.PARAM_GATHER_IN_FORWARD: DocumentedBehaviour(
        "with overlap_param_gather the step launches no param all-gather: the next forward's first "
        "pre-hook launches its bucket group's (after zero_grad_buffer resets them), each pre-hook "
        "waits for its own and launches the next",
        "megatron/core/optimizer/distrib_optimizer.py DistributedOptimizer.step_with_ready_grads "
        "(start_param_sync only without overlap_param_gather); "
        "megatron/core/distributed/param_and_grad_buffer.py _ParamAndGradBucketGroup.finish_param_sync"),
}


@dataclass(frozen=True)
class MegatronCoreCandidate(Candidate):
    """The installed megatron-core, run unmodified (CUDA assumptions redirected on a CPU)."""

    name = "megatron-core"
    code_modules = ("megatron", "verify.candidates.megatron_core")
    # Imported once by the rank launcher's fork server (Megatron's import costs each rank
    # ~3 s of CPU); every configuration still runs in fresh processes forked from it.
    preload_modules = ("verify.candidates.megatron_core.preload",)

    def info(self) -> CandidateInfo:
        reason = missing_reason()
        if reason is not None:
            return CandidateInfo(name=self.name, version="not installed", description=reason,
                                 unsupported=tuple((t.value, reason) for t in Technique))
        found = installed()
        redirects = () if torch.cuda.is_available() else tuple(
            f"{name}: {what}" for name, what in REDIRECTS.items())
        unsupported = []
        if not found.has("mxfp8_param_buffer_sharing"):
            unsupported.append((Technique.MXFP8.value,
                                found.features["mxfp8_param_buffer_sharing"].reason))
        return CandidateInfo(
            name=self.name, version=found.version,
            description="NVIDIA Megatron-Core's own DDP, schedules and distributed optimizer",
            redirects=redirects, unsupported=tuple(unsupported),
            details=tuple((k, ("yes: " if f.present else "no: ") + f.reason)
                          for k, f in found.features.items()))

    def findings(self) -> tuple[Finding, ...]:
        """Megatron-Core's known root causes (``verify.candidates.megatron_core.findings``)."""
        return FINDINGS

    def documented(self, behaviour: Behaviour) -> DocumentedBehaviour | None:
        """Where Megatron-Core departs from refgrad's spec by design (``docs/megatron_core.md``);
        its optimizer's departures are Unsupported where refgrad has no model of its inner
        optimizer (not torch.optim.AdamW)."""
        if behaviour in OPTIMIZER_BEHAVIOURS:
            require_modelled_adamw()
        return DOCUMENTED.get(behaviour)

    @staticmethod
    def _require_installed(technique: Technique) -> None:
        """Unsupported for ``technique`` with the install hint when megatron-core is missing."""
        reason = missing_reason()
        if reason is not None:
            raise Unsupported(technique, reason)

    def grad_reduction(self) -> MegatronGradReduction:
        """``reduce_scatter_with_fp32_accumulation`` and ``DistributedDataParallel``'s bucket
        reduction (``grad_reduction``)."""
        from verify.candidates.megatron_core.grad_reduction import MegatronGradReduction

        self._require_installed(Technique.GRAD_REDUCTION)
        return MegatronGradReduction()

    def layout(self) -> MegatronLayout:
        """Megatron's ``_ParamAndGradBuffer`` / ``DistributedDataParallel`` (``bucket_layout``)."""
        from verify.candidates.megatron_core.bucket_layout import MegatronLayout

        self._require_installed(Technique.LAYOUT)
        return MegatronLayout()

    def deferred_wgrad(self) -> MegatronDeferredWgrad:
        """Megatron's ``ColumnParallelLinear`` with deferred wgrad and the schedules' drain
        (``output_layer``)."""
        from verify.candidates.megatron_core.output_layer import MegatronDeferredWgrad

        self._require_installed(Technique.DEFERRED_WGRAD)
        reason = installed().skip_reason("defer_embedding_wgrad_compute",
                                         "drain_embedding_wgrad_compute", "fused_wgrad_gemm")
        if reason is not None:
            raise self.unsupported(Technique.DEFERRED_WGRAD, reason)
        return MegatronDeferredWgrad()

    def pipeline(self) -> MegatronPipeline:
        """Megatron's DDP under its 1F1B schedules (``pipeline_training``): the pipeline
        check's SGD training, and the preflight twin's stages under its own optimizer."""
        from verify.candidates.megatron_core.pipeline_training import MegatronPipeline

        self._require_installed(Technique.PIPELINE)
        return MegatronPipeline()

    def optimizer(self) -> MegatronOptimizer:
        """``get_megatron_optimizer`` over its DDP chunks (``verify.candidates.megatron_core.optimizer``)."""
        from verify.candidates.megatron_core.optimizer import MegatronOptimizer

        self._require_installed(Technique.OPTIMIZER)
        return MegatronOptimizer()

    def mxfp8(self) -> NoReturn:
        """Unsupported with the reason: Transformer Engine's MXFP8 needs CUDA (on a CPU
        machine), or, where it could run, what would run and that it is not wired yet."""
        from verify.candidates.megatron_core.mxfp8 import NOT_WIRED, unavailable_reason

        self._require_installed(Technique.MXFP8)
        reason = unavailable_reason()
        raise self.unsupported(Technique.MXFP8, NOT_WIRED if reason is None
                               else f"cannot run MXFP8 here: {reason}")

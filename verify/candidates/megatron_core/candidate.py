"""Megatron-Core behind the seam (``verify.candidates.api``): ``MegatronCoreCandidate``.

The seam defines one typed interface per technique; this adapter implements those that
exist so far and names, per technique, the driver in this package that runs Megatron-Core's
own code for it (the checks reach them through the candidate once their interfaces land):

=================  ==================================================================
technique          Megatron-Core, run by
=================  ==================================================================
layout             ``layout.buffer_layouts`` / ``layout.ddp_layouts``
reduce_scatter     :meth:`MegatronCoreCandidate.grad_reduction` (its fp32-accumulating
                   reduce-scatter); the whole DDP reduction: ``reduction.run_reductions``
deferred_wgrad     ``deferred_wgrad.run_deferred_wgrad``
pipeline           ``pipeline.run_pipeline``; :meth:`MegatronCoreCandidate.pipeline` (the
                   preflight twin's stages: ``twin_pipeline``, ``stages``)
optim              ``optim.run_optim``; :meth:`MegatronCoreCandidate.optimizer` (the
                   twin's: ``optimizer``)
mxfp8              ``mxfp8.unavailable_reason`` (Transformer Engine and CUDA only)
=================  ==================================================================

What cannot run here (the installed version lacks it, or it needs CUDA) raises
:class:`~verify.candidates.api.Unsupported` with the reason read from the installed code
(:mod:`verify.candidates.megatron_core.version`); without megatron-core every technique
is Unsupported, saying how to install it. Importing this module does not import
Megatron-Core (``verify.candidates.registry`` imports it to list the candidate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from verify.candidates.api import Candidate, CandidateInfo, Technique, Unsupported
from verify.candidates.api.grad_reduction import ReduceScatter
from verify.candidates.megatron_core.redirect import REDIRECTS
from verify.candidates.megatron_core.version import installed, missing_reason

if TYPE_CHECKING:  # the adapters, for annotations only (imported where a technique runs)
    from verify.candidates.megatron_core.optimizer import MegatronOptimizer
    from verify.candidates.megatron_core.twin_pipeline import MegatronTwinPipeline


@dataclass(frozen=True)
class MegatronFP32ReduceScatter(ReduceScatter):
    """Megatron-Core's ``reduce_scatter_with_fp32_accumulation``, called as published (SUM only:
    Megatron asserts it; DDP averages by pre-scaling the bucket instead)."""

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup,
                 op: dist.ReduceOp.RedOpType, async_op: bool = False) -> dist.Work | None:
        from megatron.core.distributed.reduce_scatter_with_fp32_accumulation import (
            reduce_scatter_with_fp32_accumulation,
        )

        return reduce_scatter_with_fp32_accumulation(output, input, op=op, group=group,
                                                     async_op=async_op)


@dataclass(frozen=True)
class MegatronGradReduction:
    """The seam's ``GradReduction`` for Megatron-Core."""

    def reduce_scatter(self) -> ReduceScatter:
        return MegatronFP32ReduceScatter()


@dataclass(frozen=True)
class MegatronCoreCandidate(Candidate):
    """The installed megatron-core, run unmodified (CUDA assumptions redirected on a CPU)."""

    name = "megatron-core"

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

    @staticmethod
    def _require_installed(technique: Technique) -> None:
        """Unsupported for ``technique`` with the install hint when megatron-core is missing."""
        reason = missing_reason()
        if reason is not None:
            raise Unsupported(technique, reason)

    def grad_reduction(self) -> MegatronGradReduction:
        self._require_installed(Technique.GRAD_REDUCTION)
        reason = installed().skip_reason("reduce_scatter_with_fp32_accumulation")
        if reason is not None:
            raise self.unsupported(Technique.GRAD_REDUCTION, reason)
        return MegatronGradReduction()

    def _not_wired(self, technique: Technique, driver: str) -> Unsupported:
        self._require_installed(technique)
        return self.unsupported(technique, f"runs through {driver}, which is not yet wired to the "
                                "seam's interface for this technique")

    def layout(self):
        raise self._not_wired(Technique.LAYOUT, "verify.candidates.megatron_core.layout")

    def deferred_wgrad(self):
        raise self._not_wired(Technique.DEFERRED_WGRAD, "verify.candidates.megatron_core.deferred_wgrad")

    def pipeline(self) -> MegatronTwinPipeline:
        """Its DDP and 1F1B schedules over the twin's stages
        (``verify.candidates.megatron_core.twin_pipeline``)."""
        from verify.candidates.megatron_core.twin_pipeline import MegatronTwinPipeline

        self._require_installed(Technique.PIPELINE)
        return MegatronTwinPipeline()

    def optimizer(self) -> MegatronOptimizer:
        """``get_megatron_optimizer`` over its DDP chunks (``verify.candidates.megatron_core.optimizer``)."""
        from verify.candidates.megatron_core.optimizer import MegatronOptimizer

        self._require_installed(Technique.OPTIMIZER)
        return MegatronOptimizer()

    def mxfp8(self):
        from verify.candidates.megatron_core.mxfp8 import unavailable_reason

        self._require_installed(Technique.MXFP8)
        reason = unavailable_reason()
        raise self.unsupported(Technique.MXFP8, reason or "has no MXFP8 driver yet")

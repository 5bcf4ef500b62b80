"""Megatron-Core behind the seam (``verify.candidates.api``): ``MegatronCoreCandidate``.

The seam defines one typed interface per technique; this adapter implements those that
exist so far and names, per technique, the driver in this package that runs Megatron-Core's
own code for it (the checks reach them through the candidate once their interfaces land):

=================  ==================================================================
technique          Megatron-Core, run by
=================  ==================================================================
layout             ``layout.buffer_layouts`` / ``layout.ddp_layouts``
reduce_scatter     :meth:`MegatronCoreCandidate.grad_reduction` (``grad_reduction``: its
                   fp32-accumulating reduce-scatter and DDP's bucket reduction); the
                   findings' driver: ``reduction.run_reductions``
deferred_wgrad     ``deferred_wgrad.run_deferred_wgrad``
pipeline           ``pipeline.run_pipeline``
optim              ``optim.run_optim``
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

from verify.candidates.api import Candidate, CandidateInfo, Technique, Unsupported
from verify.candidates.megatron_core.redirect import REDIRECTS
from verify.candidates.megatron_core.version import installed, missing_reason

if TYPE_CHECKING:  # the adapters import Megatron-Core's modules where a technique runs
    from verify.candidates.megatron_core.grad_reduction import MegatronGradReduction


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
        """``reduce_scatter_with_fp32_accumulation`` and ``DistributedDataParallel``'s bucket
        reduction (``grad_reduction``)."""
        from verify.candidates.megatron_core.grad_reduction import MegatronGradReduction

        self._require_installed(Technique.GRAD_REDUCTION)
        return MegatronGradReduction()

    def _not_wired(self, technique: Technique, driver: str) -> Unsupported:
        self._require_installed(technique)
        return self.unsupported(technique, f"runs through {driver}, which is not yet wired to the "
                                "seam's interface for this technique")

    def layout(self):
        raise self._not_wired(Technique.LAYOUT, "verify.candidates.megatron_core.layout")

    def deferred_wgrad(self):
        raise self._not_wired(Technique.DEFERRED_WGRAD, "verify.candidates.megatron_core.deferred_wgrad")

    def pipeline(self):
        raise self._not_wired(Technique.PIPELINE, "verify.candidates.megatron_core.pipeline")

    def optimizer(self):
        raise self._not_wired(Technique.OPTIMIZER, "verify.candidates.megatron_core.optim")

    def mxfp8(self):
        from verify.candidates.megatron_core.mxfp8 import unavailable_reason

        self._require_installed(Technique.MXFP8)
        reason = unavailable_reason()
        raise self.unsupported(Technique.MXFP8, reason or "has no MXFP8 driver yet")

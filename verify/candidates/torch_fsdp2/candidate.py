"""torch's FSDP2 behind the seam (``verify.candidates.interfaces``): ``TorchFSDP2Candidate``.

=================  ==================================================================
technique          interface (module in this package)
=================  ==================================================================
layout             ``layout.TorchFSDP2Layout``: no buckets; every parameter sharded on
                   dim 0 by ``fully_shard`` (its shards reported)
reduce_scatter     ``grad_reduction.TorchFSDP2GradReduction``: ``foreach_reduce`` per
                   ``reduce_dtype``, with its divide factors, microbatches without grad sync,
                   uneven shards
optim              ``optimizer.TorchFSDP2Optimizer``: ``torch.optim.AdamW`` / ``SGD`` and
                   ``torch.nn.utils``' clipping on the DTensor shards
pipeline,          Unsupported (no pipeline schedules or output layer wired; MXFP8 needs
deferred_wgrad,    torchao)
mxfp8
=================  ==================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verify.candidates.interfaces import (
    Behaviour,
    Candidate,
    CandidateInfo,
    DocumentedBehaviour,
    Finding,
    Technique,
)
from verify.candidates.torch_fsdp2.findings import FINDINGS

if TYPE_CHECKING:
    from verify.candidates.torch_fsdp2.grad_reduction import TorchFSDP2GradReduction
    from verify.candidates.torch_fsdp2.layout import TorchFSDP2Layout
    from verify.candidates.torch_fsdp2.optimizer import TorchFSDP2Optimizer

COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
DOCUMENTED: dict[Behaviour, DocumentedBehaviour] = {
    Behaviour.DIM0_PARAMETER_SHARDS: DocumentedBehaviour(
        "no bucketed buffer: every parameter is split on dim 0 into W chunks of ceil(dim0 / W) "
        "rows (torch.chunk; the last ones short or empty), each padded to that many rows",
        "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam._init_sharded_param "
        "(_fsdp_common._chunk_with_empty, _get_dim0_padded_size)"),
    Behaviour.WIRE_COLLECTIVE: DocumentedBehaviour(
        "the reduce-scatter sums in the reduce dtype in the backend's order (gloo: reverse "
        "ring); ReduceOp.AVG divides that sum by W",
        f"{COLLECTIVES}.foreach_reduce (DefaultReduceScatter: torch.distributed.reduce_scatter_single)"),
    Behaviour.DIVIDE_FACTORS: DocumentedBehaviour(
        "the grads cast to reduce_dtype, averaged with ReduceOp.AVG (fp32, bf16) or divided by "
        "factors of W before and after a SUM (fp16), cast to the sharded parameter's dtype; "
        "microbatches without grad sync accumulate unsharded, upcast to reduce_dtype first",
        f"{COLLECTIVES}._get_gradient_divide_factors and foreach_reduce; torch.distributed.fsdp."
        "_fully_shard._fsdp_param.FSDPParam.to_accumulated_grad_if_needed"),
    Behaviour.TORCH_ADAMW_ORDER: DocumentedBehaviour(
        "AdamW in torch.optim.AdamW's order of operations (single-tensor path) on the fp32 "
        "sharded params", "torch.optim.adamw._single_tensor_adamw (torch.optim.AdamW on "
                          "FSDP2's DTensor shards)"),
    Behaviour.TORCH_SGD_ORDER: DocumentedBehaviour(
        "SGD in torch.optim.SGD's order of operations on the fp32 sharded params",
        "torch.optim.sgd._single_tensor_sgd"),
    Behaviour.PARTIAL_SUM_GRAD_NORM: DocumentedBehaviour(
        "the global norm is every rank's fp32 norm of its shards' per-param norms, squared, "
        "all-reduced and square-rooted, within γ(n + k + R + 8) of the exact norm",
        "torch.nn.utils.get_total_norm (torch._foreach_norm and torch.linalg.vector_norm on "
        "DTensor shards, reduced by torch.distributed.tensor._ops._math_ops._NormPartial)"),
    Behaviour.TORCH_CLIP_COEFFICIENT: DocumentedBehaviour(
        "the clip coefficient min(max_norm / (N + 1e-6), 1) is computed on the fp32 norm "
        "tensor (a reciprocal, then times max_norm) and multiplies every grad",
        "torch.nn.utils.clip_grads_with_norm_"),
    Behaviour.PARAM_GATHER_IN_FORWARD: DocumentedBehaviour(
        "the step launches no param all-gather: each FSDP module's forward gathers its "
        "params (and reshards them after)",
        "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._pre_forward"),
}
NOT_HERE = {
    Technique.DEFERRED_WGRAD: "has no output layer with deferred wgrad",
    Technique.PIPELINE: "has no pipeline schedules wired (torch.distributed.pipelining)",
    Technique.MXFP8: "has no MXFP8 parameters wired (torchao's float8 training)",
}


@dataclass(frozen=True)
class TorchFSDP2Candidate(Candidate):
    """torch's ``fully_shard`` (FSDP2) as installed, run unmodified on gloo ranks."""

    name = "torch-fsdp2"
    code_modules = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.optim",
                    "torch.nn.utils", "verify.candidates.torch_fsdp2")
    # fully_shard keeps its state on the module it shards (the device meshes it caches are
    # keyed by group): configurations may share rank processes.
    isolates_configurations = False

    def info(self) -> CandidateInfo:
        return CandidateInfo(
            name=self.name, version=f"torch {torch.__version__}",
            description="torch.distributed.fsdp.fully_shard (FSDP2) with torch.optim on its shards",
            unsupported=tuple((t.value, f"{self.name} {why}") for t, why in NOT_HERE.items()))

    def documented(self, behaviour: Behaviour) -> DocumentedBehaviour | None:
        return DOCUMENTED.get(behaviour)

    def findings(self) -> tuple[Finding, ...]:
        return FINDINGS

    def layout(self) -> TorchFSDP2Layout:
        """``fully_shard``'s per-parameter shards (``layout``)."""
        from verify.candidates.torch_fsdp2.layout import TorchFSDP2Layout

        return TorchFSDP2Layout()

    def grad_reduction(self) -> TorchFSDP2GradReduction:
        """``foreach_reduce`` (``grad_reduction``)."""
        from verify.candidates.torch_fsdp2.grad_reduction import TorchFSDP2GradReduction

        return TorchFSDP2GradReduction()

    def optimizer(self) -> TorchFSDP2Optimizer:
        """torch.optim on the shards (``optimizer``)."""
        from verify.candidates.torch_fsdp2.optimizer import TorchFSDP2Optimizer

        return TorchFSDP2Optimizer()

    def deferred_wgrad(self):
        raise self.unsupported(Technique.DEFERRED_WGRAD, NOT_HERE[Technique.DEFERRED_WGRAD])

    def pipeline(self):
        raise self.unsupported(Technique.PIPELINE, NOT_HERE[Technique.PIPELINE])

    def mxfp8(self):
        raise self.unsupported(Technique.MXFP8, NOT_HERE[Technique.MXFP8])

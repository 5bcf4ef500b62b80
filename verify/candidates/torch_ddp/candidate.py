"""torch's ``DistributedDataParallel`` behind the seam (``verify.candidates.interfaces``): ``TorchDDPCandidate``.

=================  ==================================================================
technique          interface (module in this package)
=================  ==================================================================
layout             ``layout.TorchDDPLayout``: the Reducer's bucket assignment
                   (``dist._compute_bucket_assignment_by_size`` as ``Reducer::rebuild_buckets``
                   calls it) and a real DDP's buckets watched while it trains
reduce_scatter     ``grad_reduction.TorchDDPGradReduction``: a bucket all-reduced by DDP, by
                   default and through its ``fp16_compress_hook`` / ``bf16_compress_hook``
optim, pipeline,   Unsupported: DDP replicates the optimizer (any ``torch.optim`` optimizer on
deferred_wgrad,    full grads), has no pipeline schedules, output layer or MXFP8
mxfp8
=================  ==================================================================

Where DDP departs from refgrad's spec by design, :data:`DOCUMENTED` and the grad reduction's
``behaviour()`` name torch's module and function, and the checks hold DDP to refgrad's model
of it (``refgrad.layout_torch``, ``refgrad.reduce_torch``).
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
from verify.candidates.torch_ddp.findings import FINDINGS

if TYPE_CHECKING:
    from verify.candidates.torch_ddp.grad_reduction import TorchDDPGradReduction
    from verify.candidates.torch_ddp.layout import TorchDDPLayout

REDUCER = "torch/csrc/distributed/c10d/reducer.cpp"
DOCUMENTED: dict[Behaviour, DocumentedBehaviour] = {
    Behaviour.DDP_BUCKETS: DocumentedBehaviour(
        "buckets sized in bytes (bucket_cap_mb, default 25 MiB with a 1 MiB first bucket), "
        "rebuilt after the first iteration in the order the grads became ready, params back to "
        "back with no padding and no shards",
        "torch.nn.parallel.distributed._BucketCapacityConfig.create (torch 2.13; before it, "
        "DistributedDataParallel.__init__) and DistributedDataParallel._ddp_init_helper; "
        "torch/csrc/distributed/c10d/reducer.cpp "
        "compute_bucket_assignment_by_size, Reducer::rebuild_buckets, Reducer::initialize_buckets"),
    Behaviour.PRESCALE: DocumentedBehaviour(
        "the DP mean is every grad multiplied by fp32(1/W) as it is copied into its bucket, "
        "then an all-reduce SUM",
        f"{REDUCER} Reducer::mark_variable_ready_dense (at::mul_out with 1 / div_factor_), "
        "torch.nn.parallel.DistributedDataParallel"),
    Behaviour.WIRE_COLLECTIVE: DocumentedBehaviour(
        "the all-reduce sums in the grad dtype in the backend's order (gloo: reverse ring)",
        f"{REDUCER} Reducer::all_reduce_bucket (torch.distributed.all_reduce, ProcessGroupGloo)"),
    Behaviour.COMPRESS_HOOK: DocumentedBehaviour(
        "fp16/bf16_compress_hook: the bucket cast to 16 bits, divided by W there, all-reduced "
        "(SUM, 16-bit partial sums, the backend's order), copied back into the bucket",
        "torch.distributed.algorithms.ddp_comm_hooks.default_hooks._compress_hook "
        "(fp16_compress_hook, bf16_compress_hook)"),
}
NOT_HERE = {
    Technique.DEFERRED_WGRAD: "has no output layer with deferred wgrad",
    Technique.PIPELINE: "has no pipeline schedules (torch.distributed.pipelining is not wired)",
    Technique.OPTIMIZER: "replicates the optimizer: any torch.optim optimizer steps the "
                         "all-reduced grads (no sharded optimizer to verify; torch-fsdp2 shards)",
    Technique.MXFP8: "has no MXFP8 parameters",
}
BF16_HOOK_REDIRECT = ("bf16_compress_hook: registered through a function of another name; DDP "
                      "refuses it by name without CUDA and NCCL 2.10 "
                      "(DistributedDataParallel._check_comm_hook), gloo runs it")


@dataclass(frozen=True)
class TorchDDPCandidate(Candidate):
    """torch's ``DistributedDataParallel`` as installed, run unmodified on gloo ranks."""

    name = "torch-ddp"
    code_modules = ("torch.nn.parallel", "torch.distributed.algorithms",
                    "verify.candidates.torch_ddp")
    # A DDP keeps its state in its own Reducer: configurations may share rank processes.
    isolates_configurations = False

    def info(self) -> CandidateInfo:
        return CandidateInfo(
            name=self.name, version=f"torch {torch.__version__}",
            description="torch.nn.parallel.DistributedDataParallel (C++ Reducer, comm hooks)",
            redirects=() if torch.cuda.is_available() else (BF16_HOOK_REDIRECT,),
            unsupported=tuple((t.value, f"{self.name} {why}") for t, why in NOT_HERE.items()))

    def documented(self, behaviour: Behaviour) -> DocumentedBehaviour | None:
        return DOCUMENTED.get(behaviour)

    def findings(self) -> tuple[Finding, ...]:
        return FINDINGS

    def layout(self) -> TorchDDPLayout:
        """The Reducer's buckets (``layout``)."""
        from verify.candidates.torch_ddp.layout import TorchDDPLayout

        return TorchDDPLayout()

    def grad_reduction(self) -> TorchDDPGradReduction:
        """A bucket all-reduced by DDP, plain or through a compress hook (``grad_reduction``)."""
        from verify.candidates.torch_ddp.grad_reduction import TorchDDPGradReduction

        return TorchDDPGradReduction()

    def deferred_wgrad(self):
        raise self.unsupported(Technique.DEFERRED_WGRAD, NOT_HERE[Technique.DEFERRED_WGRAD])

    def pipeline(self):
        raise self.unsupported(Technique.PIPELINE, NOT_HERE[Technique.PIPELINE])

    def optimizer(self):
        raise self.unsupported(Technique.OPTIMIZER, NOT_HERE[Technique.OPTIMIZER])

    def mxfp8(self):
        raise self.unsupported(Technique.MXFP8, NOT_HERE[Technique.MXFP8])

"""The seam's leaf vocabulary: which technique, a verdict that a candidate cannot run it, and
a documented departure from refgrad's spec. Every technique interface may import it (it
imports nothing of the seam); :mod:`verify.candidates.api` re-exports it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Technique(str, enum.Enum):
    """A technique a candidate implements; the value is its check's name."""

    LAYOUT = "layout"
    GRAD_REDUCTION = "reduce_scatter"
    DEFERRED_WGRAD = "deferred_wgrad"
    PIPELINE = "pipeline"
    OPTIMIZER = "optim"
    MXFP8 = "mxfp8"


class Unsupported(Exception):  # noqa: N818 - it is a verdict, not an error
    """This candidate cannot run ``technique`` (or a part of it) here; ``reason`` says why.

    Checks turn it into a SKIP that names the candidate and the reason.
    """

    def __init__(self, technique: Technique, reason: str) -> None:
        super().__init__(f"{technique.value}: {reason}")
        self.technique = technique
        self.reason = reason


@dataclass(frozen=True)
class DocumentedBehaviour:
    """A way a candidate departs from refgrad's spec by design, and where that lives.

    A check that meets it compares the candidate with refgrad's model of the behaviour (which
    must match within the comparison's bound, or the check FAILs) and reports how far that
    lands from the spec: a *documented difference*, not a failure. ``where`` names the module
    and function of the candidate that does it (for Megatron-Core, for example
    ``megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync``).
    """

    summary: str
    where: str

    def __post_init__(self) -> None:
        for name in ("summary", "where"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"DocumentedBehaviour.{name} must be a non-empty string")


class Behaviour(str, enum.Enum):
    """A departure from refgrad's spec that a check knows how to model. A candidate says
    whether it departs that way, and where in its code (:meth:`Candidate.documented`); the
    check then holds it to refgrad's model of the behaviour instead of the spec."""

    # Buffer views sit at 64-element offsets from the buffer's start; the start's own address
    # is whatever the allocator returned (layout check: "views 64-element aligned in memory").
    BUFFER_ALIGNMENT_FROM_ALLOCATOR = "buffer_alignment_from_allocator"
    # Every pipeline stage after the first, and every model chunk after the first, puts its
    # params in one bucket whatever bucket size was asked (pipeline check: the bucket count).
    ONE_BUCKET_AFTER_FIRST_STAGE = "one_bucket_after_first_stage"
    # Buckets sized in bytes (a smaller first one by default), filled in the order the grads
    # become ready, with no padding and no shards: torch's DDP Reducer (layout check: held to
    # ``refgrad.layout_torch.ddp_layout`` instead of ``refgrad.layout``).
    DDP_BUCKETS = "ddp_buckets"
    # No bucketed buffer at all: every parameter is sharded on its own along dim 0 (layout
    # check: the buffer parts do not apply; its parameter shards are held to
    # ``refgrad.layout_torch.fsdp2_shards``).
    DIM0_PARAMETER_SHARDS = "dim0_parameter_shards"


__all__ = ["Behaviour", "DocumentedBehaviour", "Technique", "Unsupported"]

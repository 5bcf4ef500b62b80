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


__all__ = ["DocumentedBehaviour", "Technique", "Unsupported"]

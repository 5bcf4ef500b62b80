"""What the seam hands a candidate of refgrad's pipeline specification.

A candidate of the ``pipeline`` technique trains refgrad's model, not one of its own: it builds
the case's stages from refgrad's description (:class:`StageModule` of a
:class:`LinearStackSpec`, the output layer's initial weight and its TP rows), names the
parameters as refgrad does, computes refgrad's loss, and (for the ``pipeline`` check, which
verifies gradients, not an optimizer) steps with refgrad's SGD update. These are
specifications, not an implementation under test, so the seam hands them over from here and a
candidate imports nothing of refgrad itself (``tests/candidates/test_candidate_imports.py``).
"""

from __future__ import annotations

from refgrad.pipeline import (
    EMBEDDING_PARAM,
    HEAD_PARAM,
    LinearStackSpec,
    StageModule,
    cast_params_,
    head_shard,
    head_weight_init,
    sgd_update,
    stage_loss,
    stage_param_name,
)

__all__ = [
    "EMBEDDING_PARAM",
    "HEAD_PARAM",
    "LinearStackSpec",
    "StageModule",
    "cast_params_",
    "head_shard",
    "head_weight_init",
    "sgd_update",
    "stage_loss",
    "stage_param_name",
]

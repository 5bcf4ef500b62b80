"""What one twin rank reports when it trains under a candidate's optimizer (neutral data, pickled
back from the rank). The SGD twin's ranks report the ``pipeline`` check's
:class:`verify.candidates.api.pipeline.RankResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class OptimRankResult:
    """Per step on one rank: losses, full reduced grads, params and optimizer state by name."""

    stage: int
    dp_rank: int
    tp_rank: int = 0
    losses: list[list[float]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    state: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    # per step: (stepped, grad norm (None: the candidate took none), clip coefficient or
    # None, loss scale or None)
    steps: list[tuple[bool, float | None, float | None, float | None]] = field(default_factory=list)
    # per step with overlap_param_gather at DP > 1: (gather in flight after the step,
    # every gather waited for by the next forward's pre-hooks)
    gathers_waited_in_hooks: list[tuple[bool, bool]] = field(default_factory=list)
    # per step: where each bucket's grad reduction was launched (the bucket rule's evidence)
    launch_sites: list[tuple[str, ...]] = field(default_factory=list)
    # MXFP8 params: after every step each param's (scale_bits, element_bits) by name, and
    # whether the param all-gather went through the grad buffer's bytes
    mxfp8: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    buffer_shared: bool = False

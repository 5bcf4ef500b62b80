"""Single-tensor collectives under whichever name this torch provides.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in
favour of the identical ``all_gather_single``/``reduce_scatter_single``; older
releases only have the former. Every fastgrad module goes through these two
helpers so the choice is made in one place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_gather_into(
    output: torch.Tensor,
    local: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Concatenate every rank's ``local`` along dim 0 into ``output``; a work handle if async."""
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return collective(output, local, group=group, async_op=async_op)


def reduce_scatter_into(
    output: torch.Tensor,
    full: torch.Tensor,
    *,
    op: Any = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``full`` over the group and keep this rank's dim-0 slice in ``output``."""
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return collective(output, full, op=op, group=group, async_op=async_op)

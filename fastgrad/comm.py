"""Single-tensor collectives under whichever name this torch provides.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in
favour of the identical ``all_gather_single``/``reduce_scatter_single``; older
releases only have the former. Every fastgrad module goes through these two
helpers so the choice is made in one place.

gloo's reduce-scatter (torch 2.13, ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``)
clones its whole input on every call, all-reduces the clone and copies this rank's chunk
out when waited for. :func:`reduce_scatter_into` with a ``scratch`` does exactly that in
a buffer the caller keeps: the same all-reduce, so the same bits, without a fresh
allocation (and its page faults) on every call.
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
    scratch: torch.Tensor | None = None,
) -> Any:
    """Reduce ``full`` over the group and keep this rank's dim-0 slice in ``output``.

    ``scratch`` (optional; like ``full``: dtype, device, numel, contiguous, sharing no
    memory with ``full`` or ``output``): on gloo the working copy that gloo would
    otherwise allocate on every call (see the module docstring); ignored elsewhere.
    The caller must not touch it until the returned work is waited for.
    """
    if scratch is not None and full.device.type == "cpu" and dist.get_backend(group) == "gloo":
        return _reduce_scatter_in_scratch(output, full, scratch, op=op, group=group,
                                          async_op=async_op)
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return collective(output, full, op=op, group=group, async_op=async_op)


class ChunkCopyWork:
    """Handle of :func:`reduce_scatter_into` on a scratch: ``wait()`` waits for the
    all-reduce, then copies this rank's chunk into the output (once)."""

    def __init__(self, work: Any, output: torch.Tensor, chunk: torch.Tensor) -> None:
        self._work = work
        self._output: torch.Tensor | None = output
        self._chunk = chunk

    def wait(self) -> bool:
        """Block until the all-reduce is done, then write the chunk into the output."""
        if self._output is not None:
            self._work.wait()
            self._output.copy_(self._chunk)
            self._output = None
        return True

    def is_completed(self) -> bool:
        """True once :meth:`wait` has written the output."""
        return self._output is None


def _reduce_scatter_in_scratch(
    output: torch.Tensor, full: torch.Tensor, scratch: torch.Tensor, *, op: Any,
    group: dist.ProcessGroup | None, async_op: bool,
) -> ChunkCopyWork | None:
    """gloo's reduce-scatter (clone, all-reduce, copy the chunk) with ``scratch`` as the clone."""
    for name, other in (("full", full), ("output", output)):
        if memory_overlaps(scratch, other):
            raise ValueError(f"scratch must not overlap {name}'s memory")
    if (scratch.dtype, scratch.device, scratch.numel()) != (full.dtype, full.device, full.numel()):
        raise ValueError(
            f"scratch must match full (dtype {full.dtype}, device {full.device}, "
            f"{full.numel()} elements), got {scratch.dtype}, {scratch.device}, {scratch.numel()}"
        )
    if not (scratch.is_contiguous() and full.is_contiguous()):
        raise ValueError("full and scratch must be contiguous")
    world_size = dist.get_world_size(group)
    if full.shape[0] != output.shape[0] * world_size or output.shape[1:] != full.shape[1:]:
        raise ValueError(
            f"output's shape {tuple(output.shape)} must be full's {tuple(full.shape)} with "
            f"dim 0 divided by the group size {world_size}"
        )
    scratch = scratch.view(full.shape)
    scratch.copy_(full)
    work = dist.all_reduce(scratch, op=op, group=group, async_op=True)
    handle = ChunkCopyWork(work, output, scratch.chunk(world_size)[dist.get_rank(group)])
    if async_op:
        return handle
    handle.wait()
    return None


def memory_overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two tensors on one device intersect."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + a.numel() * a.element_size()
    b_end = b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end

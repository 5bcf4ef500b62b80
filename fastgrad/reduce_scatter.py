"""Reduce-scatter that sends 16-bit data but accumulates in fp32 (Megatron-Core's algorithm).

A plain reduce-scatter in bf16/fp16 (NCCL's ring) rounds the partial sum to the
wire dtype after every hop, so its error grows with the data-parallel size.
:func:`reduce_scatter_with_fp32_accumulation` instead moves the raw 16-bit
shards with one ``all_to_all_single`` (the same bytes on the wire as a
reduce-scatter: ``(W-1)/W * S * b`` per rank) and then each rank sums the W
shards it received in an fp32 accumulator, in rank order 0..W-1, and rounds to
the 16-bit dtype once. The result is bitwise equal to
``refgrad.reduce_scatter.reduce_scatter(..., accumulate="fp32", order="rank")``.

Local reduction: on CUDA with Triton, one kernel that reads every shard once and
writes once (:mod:`fastgrad.kernels.reduction`); elsewhere a sequential torch
loop of fp32 adds in rank order. Production uses
``torch.sum(dim=0, dtype=float32)`` instead, whose order is an implementation
detail (vectorised/pairwise), so it is not guaranteed to match a rank-order
model bit for bit.

Averaging (``op=AVG``; the local reduction takes the same choice as a
:class:`gradvocab.Averaging`, ``SUM`` or ``AVG``, as refgrad's model does): the fp32 sum is
divided by W (IEEE division in fp32) and only then rounded to the wire dtype. Production
instead pre-scales every gradient by ``1/W`` in the gradient dtype before the collective,
which is exact only for power-of-two W and no underflow.

Pre-scaling (``prescale=s``): production's ``grad_data.mul_(s)`` before the
collective, folded into the local reduction so the bucket makes no extra
read-and-write pass. Every received element is multiplied by ``s`` and rounded
to the wire dtype exactly as torch's ``mul_`` does it on the sender (fp32
product, rounded to fp32, then to the dtype), then accumulated. The rounding is
elementwise and the all-to-all only moves elements, so scaling row by row on
the receiver gives the same bits as scaling the whole input on the sender.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fastgrad.comm import memory_overlaps
from fastgrad.kernels import triton_available
from gradvocab import Averaging

SUM = dist.ReduceOp.SUM
AVG = dist.ReduceOp.AVG

WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class FP32AccumulationWork:
    """Handle of an asynchronous call: :meth:`wait` finishes the all-to-all, then reduces.

    ``wait()`` may be called more than once; the reduction runs only the first time.
    """

    def __init__(
        self,
        all_to_all_work: dist.Work | None,
        shards: torch.Tensor,
        output: torch.Tensor,
        op: Averaging,
        prescale: float | None = None,
    ) -> None:
        self._all_to_all_work = all_to_all_work
        self._shards = shards
        self._output = output
        self._op = check_local_op(op)
        self._prescale = prescale
        self._done = False

    def wait(self) -> bool:
        """Block until the all-to-all is done, then write the fp32-accumulated result."""
        if not self._done:
            if self._all_to_all_work is not None:
                self._all_to_all_work.wait()
            reduce_shards_fp32(self._shards, self._output, op=self._op,
                               prescale=self._prescale)
            self._done = True
            # Drop the scratch reference so the caller's memory can be reused.
            self._shards = None  # type: ignore[assignment]
        return True

    def is_completed(self) -> bool:
        """True once :meth:`wait` has written the output."""
        return self._done


def check_prescale(prescale: object) -> float | None:
    """``prescale`` as a float (``None`` stays ``None``); TypeError/ValueError otherwise."""
    if prescale is None:
        return None
    if isinstance(prescale, bool) or not isinstance(prescale, (int, float)):
        raise TypeError(f"prescale must be a float or None, got {type(prescale).__name__}")
    if not math.isfinite(prescale):
        raise ValueError(f"prescale must be finite, got {prescale}")
    return float(prescale)


def check_local_op(op: object) -> Averaging:
    """``op`` if it is ``Averaging.SUM`` or ``Averaging.AVG`` (what the fp32 local reduction
    does after its sum: nothing, or divide by W); TypeError for anything but an Averaging (a
    bool included), ValueError for ``PRESCALE``/``POSTSCALE`` (a multiplier is ``prescale=``)."""
    if not isinstance(op, Averaging):
        raise TypeError(f"op must be Averaging.SUM or Averaging.AVG, got {type(op).__name__} {op!r}")
    if op not in (Averaging.SUM, Averaging.AVG):
        raise ValueError(f"op must be Averaging.SUM or Averaging.AVG (a pre-scale is prescale=), got {op}")
    return op


def reduce_shards_fp32(
    shards: torch.Tensor, output: torch.Tensor, *, op: Averaging, prescale: float | None = None
) -> None:
    """Sum the rows of ``shards`` ([W, n]) in fp32 in row order, / W for ``op=Averaging.AVG``,
    round once.

    Bitwise equal to refgrad's ``accumulate="fp32", order="rank"`` model on every path:
    each step is one IEEE fp32 addition (a 16-bit value converts to fp32 exactly).
    ``prescale``: each element is first replaced by ``shards[r] * prescale`` computed as
    torch's ``mul_`` computes it in the shards' dtype (see the module docstring).
    """
    op = check_local_op(op)
    prescale = check_prescale(prescale)
    _check_tensor("shards", shards)
    _check_tensor("output", output)
    if shards.dim() != 2:
        raise ValueError(f"shards must be 2-D [world_size, shard_numel], got shape {tuple(shards.shape)}")
    world_size, shard_numel = shards.shape
    if output.numel() != shard_numel:
        raise ValueError(
            f"output must have shard_numel={shard_numel} elements, got {output.numel()}"
        )
    if shards.dtype not in WIRE_DTYPES:
        raise TypeError(f"shards.dtype must be one of {WIRE_DTYPES}, got {shards.dtype}")
    if output.dtype != shards.dtype:
        raise TypeError(f"output.dtype must equal shards.dtype ({shards.dtype}), got {output.dtype}")
    if output.device != shards.device:
        raise ValueError(f"output must be on shards' device ({shards.device}), got {output.device}")
    if _use_triton(shards):
        from fastgrad.kernels.reduction import reduce_shards_fp32 as triton_reduce

        triton_reduce(shards, output.view(-1), op=op, prescale=prescale)
        return
    # A sequential loop, not torch.sum(dim=0): sum's reduction order over dim 0
    # is not specified, while this order is exactly rank 0, 1, ..., W-1. Each
    # shard is widened explicitly (exact) because an in-place fp32 += bf16 add
    # takes torch's slow mixed-dtype path on CPU.
    def row(rank: int) -> torch.Tensor:
        # torch's own elementwise multiply in the shards' dtype: the bits of grad_data.mul_.
        return shards[rank] if prescale is None else shards[rank] * prescale

    acc = row(0).to(torch.float32, copy=True)  # never alias an fp32 input row
    for rank in range(1, world_size):
        acc.add_(row(rank).to(torch.float32))
    if op is Averaging.AVG:
        # A 0-dim tensor divisor: CUDA turns a Python-scalar divisor into a
        # multiplication by its reciprocal, which is not IEEE division.
        acc.div_(torch.tensor(float(world_size), dtype=torch.float32, device=acc.device))
    output.view(-1).copy_(acc)


def _use_triton(shards: torch.Tensor) -> bool:
    return shards.is_cuda and triton_available()


def _check_tensor(name: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tensor.stride()})")
    return tensor


def reduce_scatter_with_fp32_accumulation(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - production's parameter name
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    scratch: torch.Tensor | None = None,
    op: dist.ReduceOp.RedOpType = SUM,
    prescale: float | None = None,
) -> FP32AccumulationWork | None:
    """Reduce-scatter ``input`` into ``output`` with 16-bit wire data and fp32 accumulation.

    ``input`` (numel divisible by the group size W) is split into W equal
    shards; rank r receives shard r from every rank through an all-to-all and
    writes ``round(sum_ranks_in_order_fp32(shard r) [/ W])`` to ``output``
    (numel = input.numel() // W). ``output`` may be a view of ``input`` (the
    buffer's own shard): it is written only after the all-to-all completed.
    ``scratch`` (same dtype, device and numel as ``input``, disjoint from both)
    receives the all-to-all; it is allocated when omitted. ``op`` is
    ``ReduceOp.SUM`` or ``ReduceOp.AVG``. With ``async_op=True`` the all-to-all
    is launched and a handle is returned whose ``wait()`` completes the reduction;
    the caller must not modify ``input`` or ``scratch`` before that.
    ``prescale``: production's gradient pre-scale ``input.mul_(prescale)``, applied
    inside the reduction instead (same bits; ``input`` itself is left unscaled).
    """
    prescale = check_prescale(prescale)
    if op not in (SUM, AVG):
        raise ValueError(f"op must be ReduceOp.SUM or ReduceOp.AVG, got {op!r}")
    if not isinstance(async_op, bool):
        raise TypeError(f"async_op must be a bool, got {type(async_op).__name__}")
    _check_tensor("input", input)
    _check_tensor("output", output)
    if input.dtype not in WIRE_DTYPES:
        raise TypeError(f"input.dtype must be one of {WIRE_DTYPES}, got {input.dtype}")
    if output.dtype != input.dtype:
        raise TypeError(
            f"output.dtype must equal input.dtype ({input.dtype}), got {output.dtype}"
        )
    if output.device != input.device:
        raise ValueError(
            f"output must be on input's device ({input.device}), got {output.device}"
        )
    world_size = dist.get_world_size(group)
    if input.numel() % world_size != 0:
        raise ValueError(
            f"input.numel() ({input.numel()}) must be divisible by the group size ({world_size})"
        )
    shard_numel = input.numel() // world_size
    if output.numel() != shard_numel:
        raise ValueError(
            f"output.numel() must be input.numel() // world_size = {shard_numel}, "
            f"got {output.numel()}"
        )
    if scratch is None:
        scratch = torch.empty(input.numel(), dtype=input.dtype, device=input.device)
    else:
        _check_tensor("scratch", scratch)
        if scratch.dtype != input.dtype:
            raise TypeError(
                f"scratch.dtype must equal input.dtype ({input.dtype}), got {scratch.dtype}"
            )
        if scratch.device != input.device:
            raise ValueError(
                f"scratch must be on input's device ({input.device}), got {scratch.device}"
            )
        if scratch.numel() != input.numel():
            raise ValueError(
                f"scratch.numel() must equal input.numel() ({input.numel()}), "
                f"got {scratch.numel()}"
            )
        for name, other in (("input", input), ("output", output)):
            if memory_overlaps(scratch, other):
                raise ValueError(f"scratch must not overlap {name}'s memory")
    shards = scratch.view(world_size, shard_numel)
    work = dist.all_to_all_single(
        scratch.view(-1), input.view(-1), group=group, async_op=async_op
    )
    handle = FP32AccumulationWork(work if async_op else None, shards, output,
                                  Averaging.from_reduce_op(op), prescale)
    if async_op:
        return handle
    handle.wait()
    return None

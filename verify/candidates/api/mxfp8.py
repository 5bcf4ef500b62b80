"""MXFP8 quantization and the MXFP8 param all-gather through the grad buffer, as typed interfaces.

The ``mxfp8`` check holds a candidate's quantizer (:meth:`MXFP8.quantize`, OCP MX v1.0:
blocks of 32 along the last dimension, E8M0 scales, E4M3 elements, four scale modes) and
dequantizer to ``refgrad.mxfp8`` bit for bit, its GPU kernel too (:meth:`MXFP8.gpu_kernel`),
and trains a small MXFP8 model on real DP ranks (:meth:`MXFP8.train_with_param_gather`) with
the grad buffer reused for the MXFP8 param all-gather and without it: every bit must agree,
the gathered params must be refgrad's quantization of the all-gathered masters, and the
allocation must shrink by exactly the bf16 param buffer.

How Megatron-Core implements it: the quantizer is Transformer Engine's ``MXFP8Quantizer``
(``transformer_engine.pytorch.tensor.mxfp8_tensor``; Megatron's ``fp8_utils``), the shared
buffer ``DistributedDataParallelConfig.reuse_grad_buf_for_mxfp8_param_ag`` with
``fp8_param_gather`` in ``distributed.param_and_grad_buffer``, the step its
``DistributedOptimizer``. Transformer Engine needs CUDA: on a CPU machine Megatron-Core's
``mxfp8()`` raises :class:`verify.candidates.api.Unsupported`.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from refgrad.mxfp8 import SCALE_MODES
from verify.candidates.api.scope import TechniqueScope

BLOCK_SIZE = 32  # elements per MXFP8 block (OCP MX v1.0)


def validate_scale_mode(scale_mode: str) -> None:
    """ValueError unless ``scale_mode`` is one of refgrad's four (floor, ceil, even, rceil)."""
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")


class MXFP8Kernel(ABC):
    """One quantization kernel: ``x`` -> ``(scale_bits, element_bits)``, named for the report."""

    name: str

    @abstractmethod
    def __call__(self, x: torch.Tensor, *, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`MXFP8.quantize`, on the kernel's device."""


@dataclass(frozen=True)
class ParamGatherRun:
    """A small MXFP8 MLP trained with the candidate's distributed optimizer (AdamW) on every
    rank of a DP group, its MXFP8 params all-gathered after every step.

    ``shapes``: the weights ``[out, in]``, first layer first (``in`` a multiple of 32: the
    blocks run along rows); ``reuse_grad_buf_for_mxfp8_param_ag``: gather through the grad
    buffer's memory (Megatron-Core's flag); ``seed``: the initial weights (the same on every
    rank) and, with the rank, the data. Runs differing only in the sharing flag must see the
    same data.
    """

    shapes: tuple[tuple[int, int], ...]
    bucket_size: int
    reuse_grad_buf_for_mxfp8_param_ag: bool
    grad_reduce_in_fp32: bool
    iterations: int
    seed: int = 0
    scale_mode: str = "floor"

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("ParamGatherRun.shapes must name at least one weight")
        for k, (rows, cols) in enumerate(self.shapes):
            if rows < 1 or cols < 1 or cols % BLOCK_SIZE:
                raise ValueError(f"ParamGatherRun.shapes[{k}] = {(rows, cols)}: sizes must be >= 1 "
                                 f"and the columns a multiple of {BLOCK_SIZE}")
            if k and cols != self.shapes[k - 1][0]:
                raise ValueError(f"ParamGatherRun.shapes[{k}] takes {cols} inputs but layer {k - 1} "
                                 f"has {self.shapes[k - 1][0]} outputs")
        for name in ("reuse_grad_buf_for_mxfp8_param_ag", "grad_reduce_in_fp32"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ParamGatherRun.{name} must be a bool")
        for name in ("bucket_size", "iterations", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or operator.index(value) < (0 if name == "seed" else 1):
                raise ValueError(f"ParamGatherRun.{name} must be an int >= "
                                 f"{0 if name == 'seed' else 1}, got {value!r}")
        validate_scale_mode(self.scale_mode)


@dataclass(frozen=True)
class ParamGatherStep:
    """What one rank holds around one step of a :class:`ParamGatherRun`.

    ``scale_bits``/``element_bits``: each weight's MXFP8 codes the step's forward used (from
    the gather after the previous step; the first from the initial masters); ``grads``: the
    whole grad buffer after the reduce-scatter; ``masters_before``/``masters_after``: this
    rank's fp32 master shard of each bucket before and after the optimizer step.
    """

    scale_bits: tuple[torch.Tensor, ...]
    element_bits: tuple[torch.Tensor, ...]
    grads: torch.Tensor
    masters_before: tuple[torch.Tensor, ...]
    masters_after: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class ParamGatherResult:
    """One rank's :class:`ParamGatherRun`: a :class:`ParamGatherStep` per iteration, and the
    buffer: its padded ``numel``, the bytes of its param and grad allocations (storage
    sizes), whether param and grad memory were shared, this rank's shard of each bucket and
    each weight's range in the buffer (``(start, end)`` elements)."""

    steps: tuple[ParamGatherStep, ...]
    numel: int
    allocated_bytes: int
    sharing: bool
    shard_ranges: tuple[tuple[int, int], ...]
    param_ranges: tuple[tuple[int, int], ...]


@runtime_checkable
class MXFP8(TechniqueScope, Protocol):
    """The candidate's MXFP8 quantization and its MXFP8 param all-gather."""

    def quantize(self, x: torch.Tensor, *, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """MXFP8 codes of ``x`` (fp32, bf16 or fp16; last dimension a multiple of 32):
        ``(scale_bits, element_bits)``, uint8 on ``x``'s device, ``[..., n / 32]`` E8M0 and
        ``[..., n]`` E4M3."""
        ...

    def dequantize(self, scale_bits: torch.Tensor, element_bits: torch.Tensor, *,
                   dtype: torch.dtype) -> torch.Tensor:
        """``element · 2^scale`` per element, in ``dtype``."""
        ...

    def gpu_kernel(self) -> MXFP8Kernel:
        """The candidate's CUDA quantization kernel (fastgrad: Triton); Unsupported when it
        has none or it cannot run here."""
        ...

    def train_with_param_gather(self, run: ParamGatherRun, rank: int,
                                dp_group: dist.ProcessGroup) -> ParamGatherResult:
        """Run ``run`` as DP rank ``rank`` of ``dp_group`` (call on every rank of it)."""
        ...

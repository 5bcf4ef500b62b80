"""fastgrad's MXFP8 behind :mod:`verify.candidates.interfaces`.

``fastgrad.mxfp8.quantize`` / ``dequantize`` (the Triton kernel on CUDA when Triton is
installed, else the torch path), ``fastgrad.kernels.mxfp8.quantize_triton`` as the GPU
kernel, and the toy training of :func:`verify.candidates.fastgrad.mxfp8_toy.train_toy_rank`
(``fastgrad.mxfp8_sharing.MXFP8ParamGradBuffer`` with fastgrad's distributed AdamW) for
the param all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastgrad import mxfp8 as fast
from verify.candidates.fastgrad.mxfp8_toy import train_toy_rank
from verify.candidates.interfaces import (
    MXFP8,
    MXFP8_BLOCK,
    MXFP8Kernel,
    ParamGatherResult,
    ParamGatherRun,
    ParamGatherStep,
    Technique,
    Unsupported,
)


@dataclass(frozen=True)
class TritonKernel(MXFP8Kernel):
    """``fastgrad.kernels.mxfp8.quantize_triton``."""

    name: str = "triton"

    def __call__(self, x: torch.Tensor, *, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        from fastgrad.kernels.mxfp8 import quantize_triton

        return quantize_triton(x, scale_mode=scale_mode)


@dataclass(frozen=True)
class FastgradMXFP8(MXFP8):
    """fastgrad's quantizer, dequantizer, Triton kernel and MXFP8 param/grad buffer (a test's
    broken quantizer overrides :meth:`quantize` in a subclass)."""

    def quantize(self, x: torch.Tensor, *, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        return fast.quantize(x, scale_mode=scale_mode)

    def dequantize(self, scale_bits: torch.Tensor, element_bits: torch.Tensor, *,
                   dtype: torch.dtype) -> torch.Tensor:
        return fast.dequantize(scale_bits, element_bits, dtype=dtype)

    def gpu_kernel(self) -> MXFP8Kernel:
        if not torch.cuda.is_available():
            raise Unsupported(Technique.MXFP8, "fastgrad's Triton kernel needs CUDA")
        if not fast.triton_usable(torch.empty(1, device="cuda"), MXFP8_BLOCK):
            raise Unsupported(Technique.MXFP8, "fastgrad's Triton kernel: triton is not installed")
        return TritonKernel()

    def train_with_param_gather(self, run: ParamGatherRun, rank: int,
                                dp_group: dist.ProcessGroup) -> ParamGatherResult:
        raw = train_toy_rank(
            rank, dist.get_world_size(dp_group), run.reuse_grad_buf_for_mxfp8_param_ag,
            run.grad_reduce_in_fp32, run.iterations, "adam", run.scale_mode, run.seed,
            shapes=run.shapes, bucket_size=run.bucket_size, dp_group=dp_group,
        )
        steps = tuple(
            ParamGatherStep(
                scale_bits=tuple(snap["scale_bits"]), element_bits=tuple(snap["element_bits"]),
                grads=snap["grads"], masters_before=tuple(snap["masters_before"]),
                masters_after=tuple(snap["masters_after"]))
            for snap in raw["snapshots"]
        )
        return ParamGatherResult(
            steps=steps, numel=raw["numel"], allocated_bytes=raw["allocated_bytes"],
            sharing=raw["sharing"], shard_ranges=tuple(tuple(r) for r in raw["shard_ranges"]),
            param_ranges=tuple(tuple(r) for r in raw["param_ranges"]),
        )

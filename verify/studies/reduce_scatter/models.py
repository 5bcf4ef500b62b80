"""The reduction models of ``verify accumulation`` and its input distributions.

Every model reduces a ``[W, columns]`` tensor over its rows (ranks) the way a real
collective does, bitwise equal to ``refgrad.reduce_scatter`` (tested):

* ``ring``: NCCL's ring reduce-scatter; the chunk ending on rank c is summed
  from rank c+1 around to rank c, rounding to the wire dtype after every hop;
* ``tree``: pairwise summation in the wire dtype (rounding after every add);
* ``fp32``: production's all-to-all + fp32 accumulation in rank order, one
  rounding to the wire dtype at the end;
* ``compress_hook``: torch DDP's ``fp16_compress_hook`` / ``bf16_compress_hook``
  (``default_hooks._compress_hook``): the grads cast to the wire dtype and divided by N
  there (``div_`` on CUDA: times fp32(1/N), rounded to the wire dtype), then NCCL's ring
  SUM in the wire dtype; the result is the mean;
* ``fsdp2``: FSDP2's reduce-scatter with ``reduce_dtype`` the wire dtype
  (``_get_gradient_divide_factors``): bf16 is ``ReduceOp.AVG``, which NCCL runs as a
  pre-multiplication by 1/N rounded to bf16, then the ring SUM; fp16 divides by a power-of-two
  pre-factor, ring-sums, divides by the rest (on CUDA). The result is the mean.

The mean-producing methods are measured as N times their mean (exact in float64 and, for a
power-of-two N, in the wire dtype: the ULP figures then compare it with the correctly rounded
sum; at other N that product is rounded to the wire dtype once more).

torch's elementwise fp16/bf16 addition is correctly rounded because it computes
in fp32 and 24 >= 2·p + 2 makes that double rounding innocuous. Each model issues
O(W) torch calls on whole rows, never O(W) calls per column block of a row: the
ring's per-chunk rank order is gathered once (one indexing call), then summed
row by row.
"""

from __future__ import annotations

import torch

from gradvocab import Averaging
from refgrad.formats import format_of
from refgrad.reduce_torch import fsdp2_divide_factors

METHODS: tuple[str, ...] = ("ring", "tree", "fp32", "compress_hook", "fsdp2")
MEAN_METHODS: tuple[str, ...] = ("compress_hook", "fsdp2")
METHOD_LABELS = {
    "ring": "ring (wire)",
    "tree": "tree (wire)",
    "fp32": "fp32-accumulate",
    "compress_hook": "DDP compress hook",
    "fsdp2": "FSDP2 reduce_dtype",
    "rank": "rank order (wire)",
    "ring_reverse": "reverse ring (wire)",
}
DISTRIBUTIONS: tuple[str, ...] = ("normal", "gradient", "same_sign")
DISTRIBUTION_HELP = {
    "normal": "iid N(0, 1) on every rank",
    "gradient": (
        "gradient-like: per-element scale 2^U(-16,0), a shared mean plus per-rank "
        "heavy-tailed (log-normal scale-mixture) noise"
    ),
    "same_sign": "|N(0, 1)|: every addend positive, no cancellation",
}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"fp16": "float16", "float16": "float16", "half": "float16",
                 "bf16": "bfloat16", "bfloat16": "bfloat16"}
UNIT_ROUNDOFF = {name: float(format_of(name).unit_roundoff) for name in DTYPES}


def ring_reduce(
    stacked: torch.Tensor, chunk_numel: int, first_chunk: int = 0, *, reverse: bool = False
) -> torch.Tensor:
    """NCCL-ring model over whole chunks: ``stacked`` is ``[W, q * chunk_numel]``, the
    columns of chunks ``first_chunk .. first_chunk + q - 1``; chunk c is summed in the
    wire dtype from rank c+1 around to rank c (``reverse``: from rank c-1 down to rank c,
    the ring run the other way, as gloo does). Returns ``[q * chunk_numel]``.
    """
    world_size, columns = stacked.shape
    if chunk_numel <= 0 or columns % chunk_numel:
        raise ValueError(
            f"stacked has {columns} columns, not a whole number of chunks of {chunk_numel}"
        )
    chunks = columns // chunk_numel
    if reverse or not 0 <= first_chunk <= world_size - chunks:
        by_chunk = stacked.view(world_size, chunks, chunk_numel)
        chunk_ids = torch.arange(chunks, device=stacked.device)
        steps = torch.arange(1, world_size + 1, device=stacked.device).unsqueeze(1)
        rows = (chunk_ids + first_chunk + (-steps if reverse else steps)) % world_size
        addends = by_chunk[rows, chunk_ids]  # [step, chunk, :], one gather
    else:
        # Chunk c's addend at step t is row c + first_chunk + 1 + t (mod W). Over the rows
        # stacked twice the mod disappears, and the addends of all steps are one strided
        # view: offset (first_chunk + 1 + t) * columns + c * (columns + chunk_numel) + j.
        twice = torch.cat([stacked, stacked[: first_chunk + chunks]])
        addends = twice.as_strided(
            (world_size, chunks, chunk_numel),
            (columns, columns + chunk_numel, 1),
            twice.storage_offset() + (first_chunk + 1) * columns,
        )
    first, *rest = addends.unbind(0)  # every step's view in one call
    acc = first.clone()
    for addend in rest:
        acc.add_(addend)
    return acc.reshape(-1)


def rank_reduce(stacked: torch.Tensor) -> torch.Tensor:
    """Rank order 0..W-1 in the wire dtype (rounding after every addition)."""
    first, *rest = stacked.unbind(0)
    acc = first.clone()
    for addend in rest:
        acc.add_(addend)
    return acc


def tree_reduce(stacked: torch.Tensor) -> torch.Tensor:
    """Pairwise in the wire dtype: adjacent pairs per level, an odd one out passed up."""
    level = stacked
    while level.shape[0] > 1:
        pairs = level.shape[0] // 2
        summed = level[0 : 2 * pairs : 2] + level[1 : 2 * pairs : 2]
        level = torch.cat([summed, level[-1:]]) if level.shape[0] % 2 else summed
    return level[0].clone()


def fp32_reduce(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank order accumulated in fp32, rounded once: (wire-dtype result, fp32 accumulator)."""
    # One exact widening of the whole block (a mixed-dtype add_ is torch's slow path);
    # an fp32 input is read, never modified.
    first, *rest = stacked.to(torch.float32).unbind(0)
    acc = first.clone()
    for addend in rest:
        acc.add_(addend)
    return acc.to(stacked.dtype), acc


def generate(
    distribution: str, world_size: int, columns: int, generator: torch.Generator
) -> torch.Tensor:
    """``[world_size, columns]`` float32 samples of a named distribution."""
    if distribution == "normal":
        return torch.randn(world_size, columns, generator=generator)
    if distribution == "same_sign":
        return torch.randn(world_size, columns, generator=generator).abs_()
    if distribution == "gradient":
        scale = torch.exp2(-16.0 * torch.rand(columns, generator=generator))
        shared = 0.5 * torch.randn(columns, generator=generator)
        noise = torch.randn(world_size, columns, generator=generator)
        # In place (the same kernels and bits as exp(0.75 * x)): no block-sized temporaries.
        noise.mul_(torch.randn(world_size, columns, generator=generator).mul_(0.75).exp_())
        return noise.add_(shared).mul_(scale)
    raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")


def divide_like_torch(block: torch.Tensor, divisor: float, *, device: str = "cuda") -> torch.Tensor:
    """``block.div_(divisor)`` on a 16-bit tensor as torch computes it on ``device``: on CUDA
    times ``fp32(1 / fp32(divisor))``, on the CPU divided by ``fp32(divisor)``, in fp32, then
    rounded to the block's dtype (``refgrad.reduce_torch.divide_like_torch``)."""
    d32 = torch.tensor(divisor, dtype=torch.float32)
    if device == "cuda":
        wide = block.float() * (torch.tensor(1.0, dtype=torch.float32) / d32)
    elif device == "cpu":
        wide = block.float() / d32
    else:
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    return wide.to(block.dtype)


def compress_hook_prescale(stacked: torch.Tensor, *, device: str = "cuda") -> torch.Tensor:
    """What the compress hook all-reduces: every rank's 16-bit grads divided by N."""
    return divide_like_torch(stacked, stacked.shape[0], device=device)


def compress_hook_reduce(stacked: torch.Tensor, chunk_numel: int, first_chunk: int = 0, *,
                         device: str = "cuda", reverse: bool = False) -> torch.Tensor:
    """DDP's compress hook on ``[N, columns]`` 16-bit grads: divided by N, ring-summed in the
    wire dtype (``reverse``: gloo's ring). Returns the mean, in the wire dtype."""
    return ring_reduce(compress_hook_prescale(stacked, device=device), chunk_numel, first_chunk,
                       reverse=reverse)


def fsdp2_prescale(stacked: torch.Tensor, *, backend: str = "nccl", device: str = "cuda"
                   ) -> tuple[torch.Tensor, float | None, Averaging]:
    """FSDP2's input to the collective (reduce_dtype = the block's dtype), the post-divide
    factor and the collective's op (``Averaging.AVG`` or ``.SUM``): pre-divided (fp16), or
    pre-multiplied by 1/N rounded to the dtype (AVG on NCCL: ``ncclDevPreMulSum``, then SUM)."""
    world = stacked.shape[0]
    factors = fsdp2_divide_factors(stacked.dtype, world)
    op, pre = factors.op, factors.predivide
    if pre is not None and pre != 1:
        stacked = divide_like_torch(stacked, pre, device=device)
    if op is Averaging.AVG and backend == "nccl":
        scalar = torch.tensor(1.0 / world, dtype=torch.float32).to(stacked.dtype).float()
        stacked, op = (stacked.float() * scalar).to(stacked.dtype), Averaging.SUM
    return stacked, factors.postdivide, op


def fsdp2_finish(summed: torch.Tensor, world: int, post: float | None, op: Averaging, *,
                 device: str = "cuda") -> torch.Tensor:
    """After the ring: gloo's AVG divides the sum by N (on the CPU); the fp16 post-divide."""
    if op is Averaging.AVG:
        summed = divide_like_torch(summed, world, device="cpu")
    if post is not None and post != 1:
        summed = divide_like_torch(summed, post, device=device)
    return summed


def fsdp2_reduce(stacked: torch.Tensor, chunk_numel: int, first_chunk: int = 0, *,
                 backend: str = "nccl", device: str = "cuda") -> torch.Tensor:
    """FSDP2's reduce-scatter with ``reduce_dtype`` the wire dtype, on ``backend`` (NCCL: its
    ring and its AVG; gloo: its reverse ring, AVG a division of the sum). Returns the mean."""
    inputs, post, op = fsdp2_prescale(stacked, backend=backend, device=device)
    summed = ring_reduce(inputs, chunk_numel, first_chunk, reverse=backend == "gloo")
    return fsdp2_finish(summed, stacked.shape[0], post, op, device=device)


def as_sum(mean: torch.Tensor, world: int) -> torch.Tensor:
    """N times a mean, in its dtype (exact for a power-of-two N barring overflow)."""
    return (mean.double() * world).to(mean.dtype)

"""The reduction models of ``verify accumulation`` and its input distributions.

Every model reduces a ``[W, columns]`` tensor over its rows (ranks) the way a real
collective does, bitwise equal to ``refgrad.reduce_scatter`` (tested):

* ``ring``: NCCL's ring reduce-scatter; the chunk ending on rank c is summed
  from rank c+1 around to rank c, rounding to the wire dtype after every hop;
* ``tree``: pairwise summation in the wire dtype (rounding after every add);
* ``fp32``: production's all-to-all + fp32 accumulation in rank order, one
  rounding to the wire dtype at the end.

torch's elementwise fp16/bf16 addition is correctly rounded because it computes
in fp32 and 24 >= 2·p + 2 makes that double rounding innocuous. Each model issues
O(W) torch calls on whole rows, never O(W) calls per column block of a row: the
ring's per-chunk rank order is gathered once (one indexing call), then summed
row by row.
"""

from __future__ import annotations

import torch

METHODS: tuple[str, ...] = ("ring", "tree", "fp32")
METHOD_LABELS = {
    "ring": "ring (wire)",
    "tree": "tree (wire)",
    "fp32": "fp32-accumulate",
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
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


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

"""The reduce_scatter check's inputs: rank-specific data with wire-dtype ties, order-sensitive
data, average-sensitive data, and the DDP bucket cases."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradvocab import Averaging
from verify.candidates.interfaces import ReductionConfig

MODES = ("sync", "async", "scratch", "in_place")
# What a collective does by its own op, asked of every candidate: a sum, or ReduceOp.AVG.
COLLECTIVE_AVERAGINGS = (Averaging.SUM, Averaging.AVG)
DTYPE_NAMES = ("float16", "bfloat16")
ITERATIONS = 2
# W at which the local reduction sees order-sensitive inputs (W=2 is commutative: a+b == b+a).
ORDER_SENSITIVE_LOCAL_SIZES = (3, 4, 5, 8)
# W at which the multi-rank part also averages (AVG) inputs made to tell the two averages
# apart: 1/W is inexact in every binary format, so production's pre-scale rounds (see
# average_sensitive_input); quick mode keeps the first two.
AVERAGE_SIZES = (3, 5, 6)
# Per dtype: exponents of the cancelling pair (+B on one rank, -B on another) and of the
# small values on the other ranks. The gap is at least 2^25, more than fp32's 24 bits, so
# a small value added while the fp32 partial sum holds B is lost, and one added after B
# and -B have cancelled is kept. No sum can overflow: |B| < 2^15 (fp16), < 2^41 (bf16).
_ORDER_EXPONENTS = {"float16": ((13, 14), (-14, -12)), "bfloat16": ((30, 40), (-10, 0))}


def rank_input(
    rank: int, world_size: int, numel: int, dtype: torch.dtype, it: int, seed: int
) -> torch.Tensor:
    """Rank-specific gradient-like data with a few exact wire-dtype ties."""
    g = torch.Generator().manual_seed(seed * 7919 + 1000 * world_size + 100 * it + rank)
    x = torch.randn(numel, generator=g) * torch.exp2(-14 * torch.rand(numel, generator=g))
    x = x * (rank + 1)
    x[:3] = torch.tensor([1.0, 2.0**-11, -(2.0**-9)])
    return x.to(dtype)


def order_sensitive_input(
    rank: int, world_size: int, numel: int, dtype: torch.dtype, it: int, seed: int
) -> torch.Tensor:
    """Rank ``rank``'s values of a [W, numel] matrix whose fp32 sums depend on the rank order.

    In every column two random ranks hold +B and -B and the others small values 2^25 or
    more below B (random signs and mantissas), so the fp32 sum keeps exactly the small
    values that come after both B's: another order keeps others. The whole matrix comes
    from one generator (every rank derives the same one), and rank ``rank`` takes its row.
    """
    (big_lo, big_hi), (small_lo, small_hi) = _ORDER_EXPONENTS[str(dtype).removeprefix("torch.")]
    g = torch.Generator().manual_seed(seed * 7919 + 50_000 + 1000 * world_size + 100 * it)
    shape = (world_size, numel)

    def values(lo: int, hi: int) -> torch.Tensor:
        exponents = torch.randint(lo, hi + 1, shape, generator=g).to(torch.float64)
        mantissas = 1 + torch.rand(shape, generator=g, dtype=torch.float64)
        return mantissas * torch.exp2(exponents)

    big, small = values(big_lo, big_hi), values(small_lo, small_hi)
    signs = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    # Per column, the ranks holding +B and -B: the first two of a random permutation.
    holders = torch.argsort(torch.rand(shape, generator=g), dim=0)
    matrix = signs * small
    columns = torch.arange(numel)
    matrix[holders[0], columns] = big[0]
    matrix[holders[1], columns] = -big[0]
    return matrix[rank].to(dtype)


def average_sensitive_input(
    rank: int, world_size: int, numel: int, dtype: torch.dtype, it: int, seed: int
) -> torch.Tensor:
    """Rank ``rank``'s values of a [W, numel] matrix on which AVG's two roundings differ.

    Ranks 0..W-2 hold random values (random signs, full mantissas, exponents -2..2); the
    last rank holds minus their sum rounded to ``dtype``, so the exact column sum is
    that rounding's residual, far below every addend (often 0). Averaging the fp32 sum
    (one rounding of sum / W) keeps it; production's pre-scale ``grad *= 1/W`` in the
    16-bit dtype rounds every addend first, by up to half an ULP of x/W, which swamps the
    residual whenever 1/W is inexact (W not a power of two): most elements differ.
    """
    g = torch.Generator().manual_seed(seed * 7919 + 90_000 + 1000 * world_size + 100 * it)
    shape = (world_size - 1, numel)
    exponents = torch.randint(-2, 3, shape, generator=g).to(torch.float64)
    mantissas = 1 + torch.rand(shape, generator=g, dtype=torch.float64)
    signs = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    others = (signs * mantissas * torch.exp2(exponents)).to(dtype)
    # The float64 sum of at most a few 16-bit values in [2^-2, 2^3) is exact.
    last = -others.double().sum(dim=0).to(dtype)
    return torch.cat([others, last.unsqueeze(0)])[rank]


INPUTS = {"rank": rank_input, "order_sensitive": order_sensitive_input,
          "average_sensitive": average_sensitive_input}
BUCKET_SHARD = 128  # elements per rank in a DDP bucket case: no candidate pads W * 128


@dataclass(frozen=True)
class BucketCase:
    """One DDP bucket reduction of the check: ``size`` ranks, the candidate's DDP under
    ``config``, inputs by name (``INPUTS``). ``after_fp32``: built after a DDP with the
    fp32-accumulating reduce-scatter reduced once in the same process (a direct use of the
    API: a process-wide setting leaking from one DDP into the next shows here)."""

    size: int
    config: ReductionConfig
    inputs: str = "rank"
    after_fp32: bool = False
    # the dtype the reduction runs in when not the grads' (GradReduction.reduce_in: torch DDP's
    # compress hooks, FSDP2's reduce_dtype), and the grads' dtypes
    reduce_dtype: str | None = None
    dtypes: tuple[str, ...] = DTYPE_NAMES

    def __post_init__(self) -> None:
        if self.inputs not in INPUTS:
            raise ValueError(f"BucketCase.inputs must be one of {sorted(INPUTS)}, got {self.inputs!r}")
        if self.size < 2:
            raise ValueError(f"BucketCase.size must be >= 2, got {self.size}")
        for name in (*self.dtypes, *((self.reduce_dtype,) if self.reduce_dtype else ())):
            if name not in ("float32", *DTYPE_NAMES):
                raise ValueError(f"BucketCase dtypes must be float32, float16 or bfloat16, got {name!r}")

    @property
    def label(self) -> str:
        inputs = "" if self.inputs == "rank" else f" {self.inputs.replace('_', '-')} inputs"
        after = (" (built after an fp32-accumulating DDP in the same process)"
                 if self.after_fp32 else "")
        reduced = ("" if self.reduce_dtype is None
                   else f" of {'/'.join(self.dtypes)} grads reduced in {self.reduce_dtype}")
        return f"DDP bucket reduction W={self.size} {config_label(self.config)}{reduced}{inputs}{after}"



def spec_averaging(config: ReductionConfig) -> Averaging:
    """The spec's averaging a bucket reduced under ``config`` is held to (refgrad's collective
    ``op``): the exact mean (``AVG``: fp32 sum / W, one rounding) however the candidate
    averages, or ``SUM``."""
    return Averaging.AVG if config.averaging.averages else Averaging.SUM


def config_label(config: ReductionConfig) -> str:
    """How reports name a bucket reduction's configuration."""
    averaging = {Averaging.SUM: "sum", Averaging.AVG: "AVG in the collective",
                 Averaging.PRESCALE: "pre-scale 1/W"}[config.averaging]
    collective = ("fp32-accumulating reduce-scatter" if config.reduce_scatter_with_fp32_accumulation
                  else "reduce-scatter" if config.use_distributed_optimizer else "all-reduce")
    return f"{collective}, {averaging}"


PRESCALED = ReductionConfig()
AVG_IN_COLLECTIVE = ReductionConfig(averaging=Averaging.AVG)
ALL_REDUCE = ReductionConfig(use_distributed_optimizer=False)
FP32_PRESCALED = ReductionConfig(reduce_scatter_with_fp32_accumulation=True)
FP32_AVG_IN_COLLECTIVE = ReductionConfig(reduce_scatter_with_fp32_accumulation=True,
                                         averaging=Averaging.AVG)
FP32_SUM = ReductionConfig(averaging=Averaging.SUM, reduce_scatter_with_fp32_accumulation=True)


BUCKET_SIZES = (2, 3)  # W = 2: 1/2 exact, one addition; W = 3: neither


def bucket_cases(average_sizes: tuple[int, ...]) -> list[BucketCase]:
    """The DDP bucket cases in run order: the plain collectives first, then the
    fp32-accumulating ones (rank-specific, order-sensitive at W = 3, average-sensitive at
    ``average_sizes``), then a plain reduce-scatter at W = 3 built after an fp32-accumulating
    one in its own process, then the reductions in another dtype than the grads'."""
    sizes = BUCKET_SIZES
    cases = [BucketCase(w, config) for config in (PRESCALED, AVG_IN_COLLECTIVE, ALL_REDUCE)
             for w in sizes]
    cases += [BucketCase(w, config) for config in (FP32_PRESCALED, FP32_AVG_IN_COLLECTIVE, FP32_SUM)
              for w in sizes]
    cases += [BucketCase(w, FP32_SUM, "order_sensitive") for w in sizes if w >= 3]
    cases += [BucketCase(w, config, "average_sensitive") for config in (FP32_PRESCALED,
                                                                       FP32_AVG_IN_COLLECTIVE)
              for w in average_sizes]
    cases.append(BucketCase(3, PRESCALED, after_fp32=True))
    # reduced in another dtype than the grads' (torch DDP's compress hooks on the all-reduce,
    # FSDP2's reduce_dtype on the reduce-scatter)
    cases += [BucketCase(w, ALL_REDUCE, reduce_dtype=wire, dtypes=("float32",))
              for wire in DTYPE_NAMES for w in sizes]
    cases += [BucketCase(w, AVG_IN_COLLECTIVE, reduce_dtype=reduce, dtypes=grads)
              for reduce, grads in (("float32", DTYPE_NAMES), ("bfloat16", ("float32",)),
                                    ("float16", ("float32",)))
              for w in sizes]
    return cases

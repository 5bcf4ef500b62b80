"""The deferred_wgrad check's cases and their rank-specific data (a random lane and an exact-grid lane)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

SEQ, BATCH, HIDDEN, VOCAB = 4, 2, 8, 8
ITERATIONS = 2
WORLD = 2
LANES = ("random", "grid")


@dataclass(frozen=True)
class WgradCase:
    """One configuration of the output layer to run deferred and immediate."""

    tp: int
    sequence_parallel: bool
    num_microbatches: int
    limit: int
    main_grad_dtype: str  # "float32" | "bfloat16"
    lane: str  # "random" (bf16 normals) | "grid" (values in {-1, 0, 1}·2^-k)

    def __post_init__(self) -> None:
        for name in ("tp", "num_microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WgradCase.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 0:
            raise ValueError(f"WgradCase.limit must be an int >= 0, got {self.limit!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(
                f"WgradCase.sequence_parallel must be a bool, got {type(self.sequence_parallel).__name__}"
            )
        if self.main_grad_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"WgradCase.main_grad_dtype must be 'float32' or 'bfloat16', got {self.main_grad_dtype!r}"
            )
        if self.lane not in LANES:
            raise ValueError(f"WgradCase.lane must be one of {LANES}, got {self.lane!r}")

    @property
    def label(self) -> str:
        sp = "sp" if self.sequence_parallel else "nosp"
        return (
            f"tp{self.tp}-{sp}-M{self.num_microbatches}-limit{self.limit}-"
            f"{self.main_grad_dtype}-{self.lane}"
        )

    @property
    def reorders(self) -> bool:
        """True when deferral changes the order of the fp32 adds (0 < limit < M)."""
        return 0 < self.limit < self.num_microbatches


def build_cases(quick: bool) -> list[WgradCase]:
    """Every case the check runs; ``quick`` drops M = 8."""
    counts = (1, 3) if quick else (1, 3, 8)
    parallel = ((1, False), (2, False), (2, True))
    cases = []
    for (tp, sp), m, dtype, lane in itertools.product(
        parallel, counts, ("float32", "bfloat16"), LANES
    ):
        for limit in sorted({0, 1, 2, m}):
            cases.append(WgradCase(tp, sp, m, limit, dtype, lane))
    return cases


def compared_with_refgrad(case: WgradCase, quick: bool) -> bool:
    """The cases whose result is also compared with refgrad (Fraction arithmetic is slow).

    Each parallel layout and dtype in both lanes, with the drain reordering the adds
    (M = 3, limit 1); the full run adds one microbatch alone and a long step (M = 8, limit 2).
    """
    picked = {(3, 1)} if quick else {(3, 1), (1, 0), (8, 2)}
    return (case.num_microbatches, case.limit) in picked


def case_data(
    case: WgradCase, seed: int, data_rank: int
) -> tuple[torch.Tensor, list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Full (unsharded) weight, inputs and output grads: ``xs[it][k]``, ``gos[it][k]``."""
    # Not hash(label): str hashes are salted per process, and the parent regenerates this data.
    offset = int.from_bytes(case.label.encode()[-8:], "little") + len(case.label)
    g = torch.Generator().manual_seed(seed * 7919 + data_rank * 104_729 + offset)

    def tensor(shape, scale_exp: int) -> torch.Tensor:
        if case.lane == "grid":
            # Products are multiples of 2^-5 with |p| <= 2^-5; 8 tokens x 2M <= 16
            # microbatches sum to <= 2^2: every partial sum is exact even in bf16.
            return (torch.randint(-1, 2, shape, generator=g) * 2.0**-scale_exp).bfloat16()
        return torch.randn(shape, generator=g).bfloat16()

    weight = tensor((VOCAB, HIDDEN), 3)
    xs = [[tensor((SEQ, BATCH, HIDDEN), 2) for _ in range(case.num_microbatches)] for _ in range(ITERATIONS)]
    gos = [[tensor((SEQ, BATCH, VOCAB), 3) for _ in range(case.num_microbatches)] for _ in range(ITERATIONS)]
    return weight, xs, gos

"""The layout check's cases: hand-derived small layouts and random parameter lists."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from refgrad.layout import Layout
from refgrad.layout_torch import DDPBucketCaps, ddp_layout
from verify.candidates.interfaces import LayoutCase

# --------------------------------------------------------------------------- hand-derived cases


@dataclass(frozen=True)
class HandCase:
    """A small layout worked out by hand (derivation in ``why``)."""

    name: str
    numels: tuple[int, ...]
    dp_size: int
    bucket_size: int | None
    use_distributed_optimizer: bool
    high_busbw: bool
    shared_embedding: tuple[int, ...]
    param_index_map: tuple[tuple[int, int, int], ...]
    bucket_indices: tuple[tuple[int, int], ...]
    per_bucket_numel_unpadded: tuple[int, ...]
    why: str = ""

    def kwargs(self) -> dict[str, Any]:
        return {
            "dp_size": self.dp_size,
            "bucket_size": self.bucket_size,
            "use_distributed_optimizer": self.use_distributed_optimizer,
            "pad_buckets_for_high_nccl_busbw": self.high_busbw,
            "shared_embedding": self.shared_embedding,
        }

    def case(self) -> LayoutCase:
        """The same problem as the candidate is asked it."""
        return LayoutCase(self.numels, self.dp_size, self.bucket_size,
                          self.use_distributed_optimizer, self.high_busbw, self.shared_embedding)


HAND_CASES: tuple[HandCase, ...] = (
    HandCase(
        "no distributed optimizer: packed tightly, reversed",
        (3, 5, 7), 4, None, False, False, (),
        # reverse order 7,5,3: [0,7) [7,12) [12,15); one bucket, nothing padded.
        ((12, 15, 0), (7, 12, 0), (0, 7, 0)), ((0, 15),), (15,),
    ),
    HandCase(
        "start padding to 64, end padding to lcm(2,128)=128",
        (10, 100, 30), 2, None, True, False, (),
        # 30 at [0,30); pad64(30)=64: 100 at [64,164); pad64(164)=192: 10 at [192,202);
        # unpadded 202 (gaps included), end pad(202,128)=256.
        ((192, 202, 0), (64, 164, 0), (0, 30, 0)), ((0, 256),), (202,),
    ),
    HandCase(
        "bucket_size split, dp=3: lcm(3,128)=384",
        (50, 60, 70, 80), 3, 100, True, False, (),
        # 80 at [0,80) (80<100); 70 at [128,198), 198>=100 closes: unpadded 198 -> end 384.
        # 60 at [384,444) (60<100); 50 at [448,498), 114>=100 closes: unpadded 114 -> 768.
        ((448, 498, 1), (384, 444, 1), (128, 198, 0), (0, 80, 0)),
        ((0, 384), (384, 768)), (198, 114),
    ),
    HandCase(
        "shared embedding registered first closes the open bucket at its padded start",
        (40, 20, 10), 2, None, True, False, (0,),
        # 10 at [0,10); 20 at [64,84); pad64(84)=128 closes bucket 0 (unpadded 128, end 128);
        # 40 at [128,168) alone, closes: unpadded 40, end pad(168,128)=256.
        ((128, 168, 1), (64, 84, 0), (0, 10, 0)), ((0, 128), (128, 256)), (128, 40),
    ),
    HandCase(
        "shared embedding first in layout order gets no empty bucket in front",
        (10, 20), 2, None, True, False, (1,),
        # 20 (shared) at [0,20) in bucket 0, closes: end 128; 10 at [128,138): end 256.
        ((128, 138, 1), (0, 20, 0)), ((0, 128), (128, 256)), (20, 10),
    ),
    HandCase(
        "shared embedding ignored without the distributed optimizer",
        (40, 20, 10), 2, None, False, False, (0,),
        ((30, 70, 0), (10, 30, 0), (0, 10, 0)), ((0, 70),), (70,),
    ),
    HandCase(
        "a param larger than bucket_size: the check runs after adding",
        (500, 10), 1, 100, True, False, (),
        # 10 at [0,10); 500 at [64,564); 564>=100 closes: end pad(564,128)=640.
        ((64, 564, 0), (0, 10, 0)), ((0, 640),), (564,),
    ),
    HandCase(
        "high busbw, dp=3: lcm(3,128,65536)=196608",
        (1,), 3, None, True, True, (),
        ((0, 1, 0),), ((0, 196_608),), (1,),
    ),
    HandCase(
        "high busbw, dp=64: lcm(64,128,65536)=65536; shard 1024",
        (1000, 64), 64, 1000, True, True, (),
        # 64 at [0,64) (<1000); 1000 at [64,1064), 1064>=1000 closes: end 65536.
        ((64, 1064, 0), (0, 64, 0)), ((0, 65_536),), (1064,),
    ),
)


def hand_case_mismatch(case: HandCase, layout: Layout) -> str:
    """'' when ``layout`` matches the hand-derived values, else what differs."""
    got = (
        tuple(tuple(int(v) for v in t) for t in layout.param_index_map),
        tuple(tuple(int(v) for v in b) for b in layout.bucket_indices),
        tuple(int(u) for u in layout.per_bucket_numel_unpadded),
    )
    want = (case.param_index_map, case.bucket_indices, case.per_bucket_numel_unpadded)
    return "" if got == want else f"got {got}, hand-derived {want}"


# --------------------------------------------------------------------------- random cases


def random_case(rng: random.Random) -> LayoutCase:
    """A random layout problem: dp 1..1024 (powers of two and not), shared embeddings anywhere."""
    n = rng.randint(1, 16)
    numels = [
        rng.choice((rng.randint(1, 70), rng.randint(1, 3000), rng.randint(1, 200_000)))
        for _ in range(n)
    ]
    dp = rng.choice((2 ** rng.randint(0, 10), rng.randint(1, 1024)))
    bucket_size = rng.choice((None, rng.randint(1, 500), rng.randint(1, 300_000)))
    shared = rng.choice(((), (0,), (n - 1,), (n // 2,), tuple({0, n - 1})))
    if shared and bucket_size is not None and rng.random() < 0.5:
        numels[shared[0]] = bucket_size + rng.randint(1, 1000)  # larger than a bucket
    return LayoutCase(tuple(numels), dp, bucket_size, rng.random() < 0.75, rng.random() < 0.5, shared)


def compare_layouts(reference: Layout, candidate: Layout) -> str:
    """'' when identical, else the first differing field."""
    ref, cand = reference.to_dict(), candidate.to_dict()
    for key in ref:
        if ref[key] != cand.get(key):
            return f"{key} differs"
    return ""


def ddp_layout_of(case: LayoutCase) -> Layout:
    """refgrad's model of torch DDP's buckets for ``case``: fp32 params, ``bucket_cap_mb``
    from the case's bucket size (``LayoutCase.ddp_bucket_cap_mb``), grads ready in reverse
    registration order."""
    caps = DDPBucketCaps.from_bucket_cap_mb(case.ddp_bucket_cap_mb)
    return ddp_layout(case.numels, element_size=4, caps=caps, dp_size=case.dp_size)

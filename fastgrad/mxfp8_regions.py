"""Lifecycle guard of the MXFP8 sharing mode: which bytes of the shared buffer hold live params.

With ``reuse_grad_buf_for_mxfp8_param_ag`` the same bytes hold all-gathered
bf16 params and fp32/bf16 grads at different times (``fastgrad.buffer``'s
MXFP8 mode). Production silently computes garbage when the order is wrong;
:class:`ParamRegionGuard` records, per bucket, what its param bytes hold
(:class:`RegionState`) so ``fastgrad.mxfp8_sharing`` can refuse, with a
:class:`gradvocab.LifecycleError`, any write of grads over live params.
Without sharing the param and grad bytes never overlap and nothing is refused.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch

from fastgrad.bucket import Bucket
from fastgrad.mxfp8 import MXFP8Parameter
from gradvocab import LifecycleError


class RegionState(enum.Enum):
    """What a bucket's param bytes hold right now."""

    FREE = "free"  # nothing live: the bytes belong to the grads (zeroed or accumulating)
    STAGED = "staged"  # this rank's shard holds its bf16 params, ready to all-gather
    GATHERING = "gathering"  # an all-gather into the whole bucket is in flight
    GATHERED = "gathered"  # the whole bucket holds the all-gathered bf16 params
    LIVE = "live"  # copied out, but not zeroed: a non-quantized param lives in the buffer


_LIVE_WHOLE_BUCKET = (RegionState.GATHERING, RegionState.GATHERED, RegionState.LIVE)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class BucketRegion:
    """One bucket's param bytes: their state, staging freshness and all-gather handle."""

    def __init__(self, bucket: Bucket, *, param_element_size: int, grad_element_size: int) -> None:
        self.bucket = bucket
        self.state = RegionState.FREE
        self.shard_fresh = False  # local param shard equals the master shard since the last step
        self.gather_handle: Any = None
        self.holds_non_quantized = any(not isinstance(p, MXFP8Parameter) for p in bucket.params)
        self._param_size = param_element_size
        self._grad_size = grad_element_size

    def live_param_bytes(self) -> tuple[int, int] | None:
        """Byte range (in the shared allocation) holding live params, or None."""
        if self.state is RegionState.STAGED:
            lo, hi = self.bucket.local_shard_range
        elif self.state in _LIVE_WHOLE_BUCKET:
            lo, hi = self.bucket.start, self.bucket.end
        else:
            return None
        return lo * self._param_size, hi * self._param_size

    def grad_bytes(self) -> tuple[int, int]:
        """Byte range of the bucket's grads in the shared allocation."""
        return self.bucket.start * self._grad_size, self.bucket.end * self._grad_size

    def __repr__(self) -> str:
        return f"BucketRegion(bucket={self.bucket.bucket_id}, state={self.state.value})"


class ParamRegionGuard:
    """Per-bucket :class:`BucketRegion` records; refuses grad writes over live param bytes."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        *,
        sharing: bool,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
    ) -> None:
        self.sharing = sharing
        self.param_element_size = torch.empty((), dtype=param_dtype).element_size()
        self.grad_element_size = torch.empty((), dtype=grad_dtype).element_size()
        self.regions = [
            BucketRegion(
                b,
                param_element_size=self.param_element_size,
                grad_element_size=self.grad_element_size,
            )
            for b in buckets
        ]
        self._by_bucket = {id(r.bucket): r for r in self.regions}

    def region(self, bucket: Bucket) -> BucketRegion:
        """The record of ``bucket``; a ValueError for a bucket of another buffer."""
        try:
            return self._by_bucket[id(bucket)]
        except KeyError:
            raise ValueError("bucket is not in this buffer") from None

    def conflicts(self, byte_range: tuple[int, int]) -> list[BucketRegion]:
        """Regions whose live param bytes overlap ``byte_range`` of the shared allocation."""
        if not self.sharing:
            return []
        return [
            r
            for r in self.regions
            if (live := r.live_param_bytes()) is not None and _overlaps(live, byte_range)
        ]

    def refuse_live(self, action: str, byte_range: tuple[int, int]) -> None:
        """Raise a LifecycleError if ``action`` would write over ``byte_range`` holding live params."""
        conflicts = self.conflicts(byte_range)
        if conflicts:
            r = conflicts[0]
            reason = (
                "it keeps a non-quantized param that lives in the buffer"
                if r.state is RegionState.LIVE
                else f"its params are {r.state.value} and not yet copied out and zeroed"
            )
            raise LifecycleError(
                f"{action} would overwrite live params: bytes {byte_range} of the shared "
                f"param/grad buffer overlap bucket {r.bucket.bucket_id}'s param bytes "
                f"{r.live_param_bytes()} ({reason})"
            )

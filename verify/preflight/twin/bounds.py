"""How far the twin may be from refgrad when the reduction order is the backend's, and how a
tensor is held to refgrad's (bitwise, or within ULPs of its largest element)."""

from __future__ import annotations

import math

import torch

from refgrad.formats import FLOAT32
from verify.metrics import bitwise_equal, compare

UNIT_ROUNDOFF_FP32 = float(FLOAT32.unit_roundoff)


def ulp_bound_factor(dp: int) -> int:
    """ULPs of a tensor's largest element allowed per step when the reduction order is free."""
    return 8 * (dp - 1) * dp


def same_nans(ref: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors with the NaNs they share set to 0: IEEE 754 leaves a NaN result's sign and
    payload to the hardware (an overflowed fp16 step's inf - inf), so only NaN-ness is compared."""
    both = ref.isnan() & got.isnan()
    if not bool(both.any()):
        return ref, got
    return ref.masked_fill(both, 0), got.masked_fill(both, 0)


def within(ref: torch.Tensor, got: torch.Tensor, bound_ulps: int | None,
           candidate: str = "the candidate") -> tuple[bool, int, str]:
    """(ok, max ULP, detail); bitwise when ``bound_ulps`` is None. ``candidate`` names the
    implementation in the detail."""
    ref, got = same_nans(ref.reshape(-1), got.reshape(-1))
    cmp = compare(ref, got)
    if cmp.bitwise_equal:
        return True, 0, ""
    diff = (got.double() - ref.double()).abs().reshape(-1)
    worst = int(diff.argmax())
    detail = (f"{cmp.n_mismatch}/{cmp.n} elements differ, max {cmp.max_ulp} ULP; element {worst}: "
              f"refgrad {float(ref.reshape(-1)[worst])!r}, {candidate} "
              f"{float(got.reshape(-1)[worst])!r}")
    if bound_ulps is None:
        return False, cmp.max_ulp, detail
    # The bound is for finite values; a non-finite one must be bitwise the same.
    finite = ref.isfinite() & got.isfinite()
    if not bitwise_equal(ref[~finite], got[~finite]) or bool(
            (ref.isfinite() != got.isfinite()).any()):
        return False, cmp.max_ulp, detail + " (a non-finite value differs)"
    if not bool(finite.any()):
        return True, cmp.max_ulp, detail
    scale = float(ref[finite].abs().max())
    # fp32 ULP of the largest element: float64's ulp x 2^29 (52 - 23 mantissa bits).
    allowed = bound_ulps * (math.ulp(scale) * 2.0**29 if scale > 0 else UNIT_ROUNDOFF_FP32)
    return bool(diff[finite].max() <= allowed), cmp.max_ulp, detail + f" (bound {allowed:.3g})"

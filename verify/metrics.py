"""Expressing the difference between a reference tensor and a candidate tensor.

ULP distance uses the ordered-integer mapping: a bit pattern is read as a
sign-magnitude integer and turned into a two's-complement-ordered integer in
int64 (``-magnitude`` when the sign bit is set). Adjacent representable values
are then adjacent integers, +0 and -0 both map to 0, and the distance between
two values is the absolute difference of their ordered integers. Every
supported format is at most 32 bits wide, so that difference is below 2**33 and
cannot overflow int64, even for opposite-sign extremes.

Conventions (documented here once, relied on by the tests):

- NaN against NaN is distance 0 (any payload, any sign).
- NaN against a non-NaN is a *NaN mismatch*: it is flagged in
  ``UlpDistance.nan_mismatch`` and its ``ulps`` entry is 0, never a huge number.
- Infinity is the code just past the largest finite value, so ``inf`` vs
  ``max_finite`` is 1 ULP and ``inf`` vs ``-inf`` is a finite distance. Such
  pairs are also counted separately as *Inf mismatches* by :func:`compare`.
- float8_e8m0fnu is unsigned (no sign bit, no zero, no inf); its ordered
  integer is the bit pattern itself and 0xFF is its only NaN.
- ``bitwise_equal`` in :func:`compare` means identical bit patterns: two NaNs
  with different payloads, or +0 against -0, are *not* bitwise equal even though
  their ULP distance is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from refgrad.formats import FloatFormat, format_of, tensor_bit_patterns, tensor_same_width_ints

__all__ = [
    "HISTOGRAM_BUCKETS",
    "Comparison",
    "Mismatch",
    "UlpDistance",
    "assert_bitwise_equal",
    "assert_ulp_close",
    "bitwise_equal",
    "compare",
    "format_comparison",
    "supported_dtypes",
    "ulp_distance",
]


def _layout(dtype: torch.dtype) -> FloatFormat:
    """The bit layout of ``dtype``: refgrad's format descriptor, the one source of truth."""
    if dtype in supported_dtypes():
        return format_of(dtype)
    names = ", ".join(str(d) for d in supported_dtypes())
    raise TypeError(f"dtype {dtype} is not supported for ULP metrics; supported: {names}")


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes :func:`ulp_distance` and :func:`compare` accept."""
    return (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e8m0fnu,
    )


def _magnitude_and_sign(bits: torch.Tensor, layout: FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    if not layout.signed:
        return bits, torch.zeros_like(bits, dtype=torch.bool)
    sign_bit = 1 << (layout.total_bits - 1)
    return bits & (sign_bit - 1), (bits & sign_bit) != 0


def _nan_mask(bits: torch.Tensor, layout: FloatFormat) -> torch.Tensor:
    magnitude, _ = _magnitude_and_sign(bits, layout)
    if layout.nan_style == "ff":
        return bits == 0xFF
    if layout.nan_style == "all_ones":
        return magnitude == (1 << (layout.total_bits - 1)) - 1
    exponent_field = magnitude >> layout.mantissa_bits
    mantissa_field = magnitude & ((1 << layout.mantissa_bits) - 1)
    return (exponent_field == (1 << layout.exponent_bits) - 1) & (mantissa_field != 0)


def _inf_mask(bits: torch.Tensor, layout: FloatFormat) -> torch.Tensor:
    if not layout.has_inf:
        return torch.zeros_like(bits, dtype=torch.bool)
    magnitude, _ = _magnitude_and_sign(bits, layout)
    return magnitude == ((1 << layout.exponent_bits) - 1) << layout.mantissa_bits


def _ordered(bits: torch.Tensor, layout: FloatFormat) -> torch.Tensor:
    """Sign-magnitude bits -> integers whose order is the numeric order (+0 == -0)."""
    magnitude, negative = _magnitude_and_sign(bits, layout)
    return torch.where(negative, -magnitude, magnitude)


def _check_pair(a: Any, b: Any, names: tuple[str, str]) -> FloatFormat:
    for value, name in zip((a, b), names):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if a.dtype != b.dtype:
        raise TypeError(
            f"{names[0]} and {names[1]} must have the same dtype, got {a.dtype} and {b.dtype}"
        )
    if a.shape != b.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same shape, "
            f"got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.device != b.device:
        raise ValueError(
            f"{names[0]} and {names[1]} must be on the same device, got {a.device} and {b.device}"
        )
    return _layout(a.dtype)


@dataclass(frozen=True)
class UlpDistance:
    """Elementwise ULP distances; ``nan_mismatch`` marks NaN-vs-number pairs (ulps 0 there)."""

    ulps: torch.Tensor
    nan_mismatch: torch.Tensor


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> UlpDistance:
    """Elementwise distance in units in the last place between same-dtype tensors.

    Returns int64 distances (0 for +0 vs -0 and for NaN vs NaN) and a bool mask
    of NaN-vs-number pairs, whose distance is reported as 0 rather than a huge
    number. See the module docstring for the conventions.
    """
    layout = _check_pair(a, b, ("a", "b"))
    ulps, nan_a, nan_b = _distance_from_bits(tensor_bit_patterns(a), tensor_bit_patterns(b), layout)
    return UlpDistance(ulps=ulps, nan_mismatch=nan_a ^ nan_b)


def _distance_from_bits(
    bits_a: torch.Tensor, bits_b: torch.Tensor, layout: FloatFormat
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ULP distances with 0 wherever either side is NaN, NaN mask of a, NaN mask of b)."""
    nan_a = _nan_mask(bits_a, layout)
    nan_b = _nan_mask(bits_b, layout)
    distance = (_ordered(bits_a, layout) - _ordered(bits_b, layout)).abs_()
    distance.masked_fill_(nan_a | nan_b, 0)
    return distance, nan_a, nan_b


# Histogram bucket labels and their inclusive ULP ranges (None = unbounded).
HISTOGRAM_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("0", 0, 0),
    ("1", 1, 1),
    ("2", 2, 2),
    ("3-4", 3, 4),
    ("5-8", 5, 8),
    (">8", 9, None),
)


def _json_float(x: float) -> float | str:
    """JSON has no inf/nan: those become the strings 'inf', '-inf', 'nan'."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


@dataclass(frozen=True)
class Mismatch:
    """One differing element: where it is and both sides (values, bits, ULPs)."""

    flat_index: int
    index: tuple[int, ...]
    reference: float
    candidate: float
    reference_bits: int
    candidate_bits: int
    ulps: int
    nan_mismatch: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "flat_index": self.flat_index,
            "index": list(self.index),
            "reference": _json_float(self.reference),
            "candidate": _json_float(self.candidate),
            "reference_bits": hex(self.reference_bits),
            "candidate_bits": hex(self.candidate_bits),
            "ulps": self.ulps,
            "nan_mismatch": self.nan_mismatch,
        }


@dataclass(frozen=True)
class Comparison:
    """Summary of reference vs candidate.

    - ``bitwise_equal``/``n_mismatch``: identical bit patterns (NaN payloads and
      the sign of zero count).
    - ``max_ulp``/``mean_ulp``/``histogram``: over the elements that are not NaN
      mismatches (those have no ULP distance); ``mean_ulp`` divides by that count
      (0.0 when there is none). Histogram keys are ``HISTOGRAM_BUCKETS`` labels.
    - ``max_abs_error``/``max_rel_error``: computed in float64 over elements where
      both sides are finite. Relative error is ``|c - r| / |r|``; at ``r == 0`` it
      is 0 when ``c == 0`` and ``inf`` otherwise. Both are 0.0 when no element is
      finite on both sides.
    - ``nan_mismatch``: exactly one side is NaN. ``inf_mismatch``: neither side
      is NaN, at least one side is infinite, and the values differ.
    - ``first_mismatch``/``worst_mismatch``: the first element whose bits differ,
      and the element with the largest ULP distance (``None`` when equal).
    """

    dtype: str
    shape: tuple[int, ...]
    n: int
    bitwise_equal: bool
    n_mismatch: int
    max_ulp: int
    mean_ulp: float
    histogram: dict[str, int]
    max_abs_error: float
    max_rel_error: float
    nan_mismatch: int
    inf_mismatch: int
    first_mismatch: Mismatch | None = None
    worst_mismatch: Mismatch | None = field(default=None)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (non-finite floats become 'inf'/'-inf'/'nan' strings)."""
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "n": self.n,
            "bitwise_equal": self.bitwise_equal,
            "n_mismatch": self.n_mismatch,
            "max_ulp": self.max_ulp,
            "mean_ulp": _json_float(self.mean_ulp),
            "histogram": dict(self.histogram),
            "max_abs_error": _json_float(self.max_abs_error),
            "max_rel_error": _json_float(self.max_rel_error),
            "nan_mismatch": self.nan_mismatch,
            "inf_mismatch": self.inf_mismatch,
            "first_mismatch": None if self.first_mismatch is None else self.first_mismatch.to_dict(),
            "worst_mismatch": None if self.worst_mismatch is None else self.worst_mismatch.to_dict(),
        }


def _unravel(flat_index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))


def _mismatch_at(
    flat_index: int,
    shape: tuple[int, ...],
    ref_values: torch.Tensor,
    cand_values: torch.Tensor,
    ref_bits: torch.Tensor,
    cand_bits: torch.Tensor,
    distance: UlpDistance,
) -> Mismatch:
    return Mismatch(
        flat_index=flat_index,
        index=_unravel(flat_index, shape),
        reference=float(ref_values[flat_index]),
        candidate=float(cand_values[flat_index]),
        reference_bits=int(ref_bits[flat_index]),
        candidate_bits=int(cand_bits[flat_index]),
        ulps=int(distance.ulps[flat_index]),
        nan_mismatch=bool(distance.nan_mismatch[flat_index]),
    )


def compare(reference: torch.Tensor, candidate: torch.Tensor) -> Comparison:
    """Compare two same-dtype, same-shape tensors; see :class:`Comparison` for the fields."""
    return _compare(reference, candidate)[0]


def _compare(
    reference: torch.Tensor, candidate: torch.Tensor
) -> tuple[Comparison, UlpDistance, torch.Tensor, Any]:
    """:func:`compare`, plus the flat distances, Inf-mismatch mask and an element describer."""
    layout = _check_pair(reference, candidate, ("reference", "candidate"))
    shape = tuple(reference.shape)
    ref = reference.detach().reshape(-1).cpu()
    cand = candidate.detach().reshape(-1).cpu()
    n = ref.numel()

    ref_bits = tensor_bit_patterns(ref)
    cand_bits = tensor_bit_patterns(cand)
    ulps_all, ref_nan, cand_nan = _distance_from_bits(ref_bits, cand_bits, layout)
    distance = UlpDistance(ulps=ulps_all, nan_mismatch=ref_nan ^ cand_nan)
    differs = ref_bits != cand_bits
    n_mismatch = int(differs.sum())

    either_inf = _inf_mask(ref_bits, layout) | _inf_mask(cand_bits, layout)
    inf_mismatch = either_inf & ~(ref_nan | cand_nan) & (distance.ulps != 0)

    with_distance = ~distance.nan_mismatch
    ulps = distance.ulps[with_distance]
    # Bucket i holds (upper bound of bucket i-1, upper bound of bucket i].
    upper_bounds = torch.tensor([high for _, _, high in HISTOGRAM_BUCKETS[:-1]], dtype=torch.int64)
    counts = torch.bincount(
        torch.bucketize(ulps, upper_bounds), minlength=len(HISTOGRAM_BUCKETS)
    ).tolist()
    histogram = {label: count for (label, _, _), count in zip(HISTOGRAM_BUCKETS, counts)}
    max_ulp = int(ulps.max()) if ulps.numel() else 0
    mean_ulp = float(ulps.to(torch.float64).mean()) if ulps.numel() else 0.0

    # Widening to float64 is exact for every supported format.
    ref_values = ref.to(torch.float64)
    cand_values = cand.to(torch.float64)
    both_finite = torch.isfinite(ref_values) & torch.isfinite(cand_values)
    abs_error = (cand_values - ref_values).abs()[both_finite]
    ref_magnitude = ref_values.abs()[both_finite]
    rel_error = torch.where(
        ref_magnitude > 0,
        abs_error / torch.where(ref_magnitude > 0, ref_magnitude, torch.ones_like(ref_magnitude)),
        torch.where(abs_error > 0, torch.full_like(abs_error, math.inf), abs_error),
    )
    max_abs_error = float(abs_error.max()) if abs_error.numel() else 0.0
    max_rel_error = float(rel_error.max()) if rel_error.numel() else 0.0

    def describe(flat_index: int) -> Mismatch:
        return _mismatch_at(
            flat_index, shape, ref_values, cand_values, ref_bits, cand_bits, distance
        )

    first = worst = None
    if n_mismatch:
        first_index = int(torch.nonzero(differs)[0, 0])
        first = describe(first_index)
        worst_index = int(torch.argmax(distance.ulps))
        if int(distance.ulps[worst_index]) == 0:
            worst_index = first_index
        worst = describe(worst_index)

    result = Comparison(
        dtype=str(reference.dtype).removeprefix("torch."),
        shape=shape,
        n=n,
        bitwise_equal=n_mismatch == 0,
        n_mismatch=n_mismatch,
        max_ulp=max_ulp,
        mean_ulp=mean_ulp,
        histogram=histogram,
        max_abs_error=max_abs_error,
        max_rel_error=max_rel_error,
        nan_mismatch=int(distance.nan_mismatch.sum()),
        inf_mismatch=int(inf_mismatch.sum()),
        first_mismatch=first,
        worst_mismatch=worst,
    )
    return result, distance, inf_mismatch, describe


def _describe_element(m: Mismatch, side: str, width_hex: int) -> str:
    value = m.reference if side == "reference" else m.candidate
    bits = m.reference_bits if side == "reference" else m.candidate_bits
    return f"{value!r} (0x{bits:0{width_hex}x})"


def format_comparison(
    result: Comparison, header: str, extra: tuple[tuple[str, Mismatch], ...] = ()
) -> str:
    """A human-readable multi-line report of a failed comparison."""
    width_hex = {"float32": 8, "float16": 4, "bfloat16": 4}.get(result.dtype, 2)
    pct = 100.0 * result.n_mismatch / result.n if result.n else 0.0
    lines = [
        header,
        "",
        f"dtype {result.dtype}, shape {list(result.shape)}",
        f"Mismatched elements (bitwise): {result.n_mismatch} / {result.n} ({pct:.1f}%)",
    ]
    described = (
        ("First bitwise mismatch", result.first_mismatch),
        *extra,
        ("Greatest ULP distance", result.worst_mismatch),
    )
    shown: set[int] = set()
    for title, m in described:
        if m is None:
            continue
        if m.flat_index in shown:
            lines.append(f"{title}: the same element (index {m.index})")
            continue
        shown.add(m.flat_index)
        ulp_text = "NaN mismatch" if m.nan_mismatch else f"{m.ulps} ULP"
        lines.append(
            f"{title} at index {m.index}: reference {_describe_element(m, 'reference', width_hex)}, "
            f"candidate {_describe_element(m, 'candidate', width_hex)}, {ulp_text}"
        )
    histogram = ", ".join(f"{k}: {v}" for k, v in result.histogram.items())
    lines += [
        f"Max ULP distance: {result.max_ulp} (mean {result.mean_ulp:.3g})",
        f"ULP histogram: {histogram}",
        f"Greatest absolute difference: {result.max_abs_error!r}",
        f"Greatest relative difference: {result.max_rel_error!r}",
        f"NaN mismatches: {result.nan_mismatch}, Inf mismatches: {result.inf_mismatch}",
    ]
    return "\n".join(lines)


def _with_msg(report: str, msg: str | None) -> str:
    return report if msg is None else f"{msg}\n\n{report}"


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same dtype, the same shape and identical bit patterns.

    Unlike ``torch.equal``, which compares values: -0 and +0 are *not* equal, and two NaNs
    with identical bits (sign and payload) *are*. Any dtype of 8 to 64 bits: every float
    format, integers and bool (whose bits are their values). A dtype or shape difference
    is ``False``; tensors on different devices are a ValueError, as in :func:`compare`.
    """
    for value, name in ((a, "a"), (b, "b")):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device, got {a.device} and {b.device}")
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # torch.equal on integers is exact equality, so on these views it compares bits.
    return torch.equal(tensor_same_width_ints(a), tensor_same_width_ints(b))


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, msg: str | None = None) -> None:
    """Raise AssertionError with a readable report unless :func:`bitwise_equal` holds.

    ``a`` is treated as the reference. Shape or dtype differences raise
    ValueError/TypeError from :func:`compare`. Dtypes without ULPs (integers, bool,
    float64) are held to their bits too; the report names the first differing element.
    """
    if bitwise_equal(a, b):
        return
    if a.dtype == b.dtype and a.shape == b.shape and a.dtype not in supported_dtypes():
        differs = (tensor_same_width_ints(a) != tensor_same_width_ints(b)).reshape(-1).cpu()
        first = int(torch.nonzero(differs)[0, 0])
        report = (f"Tensors are not bitwise equal!\n\ndtype {a.dtype}, shape {list(a.shape)}: "
                  f"{int(differs.sum())} / {differs.numel()} elements differ; the first at index "
                  f"{_unravel(first, tuple(a.shape))}: reference {a.reshape(-1)[first].item()!r}, "
                  f"candidate {b.reshape(-1)[first].item()!r}")
        raise AssertionError(_with_msg(report, msg))
    result = compare(a, b)
    raise AssertionError(_with_msg(format_comparison(result, "Tensors are not bitwise equal!"), msg))


def assert_ulp_close(
    a: torch.Tensor, b: torch.Tensor, *, max_ulp: int, msg: str | None = None
) -> None:
    """Raise AssertionError unless every element is within ``max_ulp`` ULPs.

    NaN against a number and any Inf mismatch always fail (an Inf next to the
    largest finite value is 1 ULP away but is an overflow, not a rounding
    difference). NaN against NaN passes.
    """
    if isinstance(max_ulp, bool) or not isinstance(max_ulp, int):
        raise TypeError(f"max_ulp must be an int, got {type(max_ulp).__name__}")
    if max_ulp < 0:
        raise ValueError(f"max_ulp must be >= 0, got {max_ulp}")
    result, distance, inf_mismatch, describe = _compare(a, b)
    violations = distance.nan_mismatch | inf_mismatch | (distance.ulps > max_ulp)
    if bool(violations.any()):
        first_violation = int(torch.nonzero(violations)[0, 0])
        header = (
            f"Tensors are not within {max_ulp} ULP! "
            f"{int(violations.sum())} element(s) violate the bound."
        )
        extra = ((f"First element beyond {max_ulp} ULP", describe(first_violation)),)
        raise AssertionError(_with_msg(format_comparison(result, header, extra), msg))

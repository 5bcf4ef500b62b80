"""What torch's casts to narrow float formats do, release by release, beside refgrad's rules.

Facts about torch that the ``formats`` and ``mxfp8`` checks hold torch's casts to: the
overflow policy of its float32 -> float8_e4m3fn cast (it changed in torch 2.13), and the
results that are not the correctly rounded ones (:data:`KNOWN_TORCH_BEHAVIOURS`), each with
a concrete example.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from packaging.version import InvalidVersion, Version

from refgrad import formats as F

# round_to_bits(fmt, value, overflow) -> bits; the candidate the check holds to the rules.
RoundFunction = Callable[[F.FloatFormat, object, "str | None"], int]
# cast(tensor, dtype) -> tensor; torch's cast unless a test swaps in a broken one.
CastFunction = Callable[[torch.Tensor, torch.dtype], torch.Tensor]


def torch_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's own cast: the behaviour the checks characterise."""
    return t.to(dtype)


# torch's cast to float8_e4m3fn past the largest finite value: up to 2.12.x OCP FP8's
# non-saturating conversion, a magnitude past 464 (448 plus half its ULP) or an infinity
# becomes NaN with the input's sign (S.1111.111); PyTorch PR #178817 ("Properly saturate E4M3
# on finite-overflow on CPU/C++ conversion code", merged 2026-04-17 22:21 UTC) made it
# saturate to ±448, first released in 2.13.0. Read in torch/headeronly/util/Float8_e4m3fn.h of
# the 2.11.0, 2.12.0, 2.12.1 and 2.13.0 wheels, and seen on the CPU in 2.11.0 and 2.13.0.
FIRST_RELEASE_SATURATING_E4M3FN = Version("2.13.0")
# A 2.13.0 nightly (2.13.0.devYYYYMMDD) is dated: from this date on it holds the change.
FIRST_NIGHTLY_SATURATING_E4M3FN = 20260418


def torch_version_of(torch_version: str, what: str = "torch_version") -> Version:
    """``torch_version`` parsed (PEP 440, as torch numbers its builds), or a ValueError naming
    ``what``."""
    try:
        return Version(torch_version)
    except (InvalidVersion, TypeError) as exc:
        raise ValueError(f"{what} must be a torch version such as '2.13.0+cpu', "
                         f"got {torch_version!r}") from exc


def torch_cast_overflow(fmt: F.FloatFormat, torch_version: str) -> str | None:
    """The overflow policy of that torch release's float32 cast to ``fmt``.

    None where the version cannot tell: a 2.13.0 alpha such as ``2.13.0a0+git<hash>`` (a
    source build, as NGC containers ship) may come from before the change or after it.
    """
    if fmt.name != "float8_e4m3fn":
        return fmt.default_overflow  # no other format's policy changed in 2.11 to 2.13
    version = torch_version_of(torch_version)
    base = Version(version.base_version)
    if base != FIRST_RELEASE_SATURATING_E4M3FN:
        return "saturate" if base > FIRST_RELEASE_SATURATING_E4M3FN else "nan"
    if version.dev is not None and version.pre is None:  # a dated nightly
        return "saturate" if version.dev >= FIRST_NIGHTLY_SATURATING_E4M3FN else "nan"
    if version.pre is None or version.pre[0] == "rc":  # the release; its candidates
        return "saturate"
    return None


def observed_overflow(fmt: F.FloatFormat, cast: CastFunction = torch_cast) -> str | None:
    """The overflow policy ``cast`` shows on 1000.0 (past every policy's threshold for
    e4m3fn), or None if it shows none of them."""
    bits = int(F.tensor_bit_patterns(cast(torch.tensor([1000.0]), fmt.torch_dtype))[0])
    if bits == fmt.max_finite_bits:
        return "saturate"
    return "nan" if F.is_nan_bits(fmt, bits) else None


def overflow_policy(fmt: F.FloatFormat, torch_version: str, cast: CastFunction = torch_cast) -> str:
    """The overflow policy to hold ``cast`` to: the release's (:func:`torch_cast_overflow`);
    where the version cannot tell, the one ``cast`` shows; the format's default if it shows
    none (the comparisons then fail)."""
    return (torch_cast_overflow(fmt, torch_version) or observed_overflow(fmt, cast)
            or fmt.default_overflow)


@dataclass(frozen=True)
class KnownTorchBehaviour:
    """A torch cast result that is not the correctly rounded one, with one concrete example.

    ``correct_bits`` is refgrad's ``round_to_bits(target, example, overflow)``;
    ``None`` when the value has no encoding in the target (refgrad raises).
    ``torch_bits`` is what torch (CPU) returns for ``example`` held in ``source_dtype`` and
    cast with ``.to(target_dtype)``: in every release seen (2.11 to 2.13) where
    ``under_policy`` is None; else where torch's overflow policy for the target is
    ``under_policy``, and under the other policy torch gives ``correct_bits``.
    """

    name: str
    source_dtype: str
    target_dtype: str
    example: float
    torch_bits: int
    correct_bits: int | None
    overflow: str | None
    explanation: str
    under_policy: str | None = None

    def __post_init__(self) -> None:
        if self.under_policy is not None and self.correct_bits is None:
            raise ValueError(f"{self.name}: under_policy= needs correct_bits, what torch gives "
                             "under the other policy")

    def present_under(self, policy: str) -> bool:
        """Whether torch behaves so where its overflow policy for the target is ``policy``."""
        return self.under_policy is None or policy == self.under_policy

    def expected_torch_bits(self, policy: str) -> int | None:
        """What torch is recorded to return for ``example`` under that overflow policy."""
        return self.torch_bits if self.present_under(policy) else self.correct_bits

    def torch_result(self, cast: CastFunction = torch_cast) -> int:
        """The bits ``cast`` (torch's own by default) gives for ``example``."""
        source = torch.tensor([self.example], dtype=getattr(torch, self.source_dtype))
        if source.item() != self.example and self.example == self.example:
            raise ValueError(f"{self.name}: example {self.example!r} is not exact in {self.source_dtype}")
        return int(F.tensor_bit_patterns(cast(source, getattr(torch, self.target_dtype)))[0])

    def refgrad_result(self, round_to_bits: RoundFunction = F.round_to_bits) -> int | None:
        """refgrad's bits for ``example`` under ``overflow``; None where it has no encoding."""
        fmt = F.format_of(self.target_dtype)
        try:
            return round_to_bits(fmt, self.example, self.overflow)
        except ValueError:
            return None


KNOWN_TORCH_BEHAVIOURS: tuple[KnownTorchBehaviour, ...] = (
    KnownTorchBehaviour(
        "float64->bfloat16 double rounding", "float64", "bfloat16",
        1 + 2**-8 + 2**-30, 0x3F80, 0x3F81, None,
        "torch casts float64 to float32 first (rounding 1+2^-8+2^-30 to the bf16 midpoint "
        "1+2^-8), then ties to even gives 1.0; the value is above the midpoint, so the "
        "correctly rounded result is 1+2^-7.",
    ),
    KnownTorchBehaviour(
        "float64->float16 double rounding", "float64", "float16",
        1 + 2**-11 + 2**-40, 0x3C00, 0x3C01, None,
        "Same double rounding through float32: 1+2^-11+2^-40 becomes the fp16 midpoint "
        "1+2^-11 and ties to even to 1.0 instead of rounding up to 1+2^-10.",
    ),
    KnownTorchBehaviour(
        "float64->float8_e4m3fn double rounding", "float64", "float8_e4m3fn",
        1 + 2**-4 + 2**-40, 0x38, 0x39, None,
        "float64 goes through float32: 1+2^-4+2^-40 becomes the e4m3 midpoint 1+2^-4, which "
        "ties to even (1.0) instead of rounding up to 1.125.",
    ),
    KnownTorchBehaviour(
        "float64->float8_e5m2 double rounding", "float64", "float8_e5m2",
        1 + 2**-3 + 2**-40, 0x3C, 0x3D, None,
        "float64 goes through float32: 1+2^-3+2^-40 becomes the e5m2 midpoint 1+2^-3, which "
        "ties to even (1.0) instead of rounding up to 1.25.",
    ),
    KnownTorchBehaviour(
        "float64->float8_e8m0fnu double rounding", "float64", "float8_e8m0fnu",
        1.5 - 2**-40, 0x80, 0x7F, None,
        "float64 goes through float32: 1.5-2^-40 becomes the tie 1.5 and rounds up to 2.0; "
        "the value is below the midpoint between 1 and 2, so the nearest is 1.0.",
    ),
    KnownTorchBehaviour(
        "float32 zero->float8_e8m0fnu", "float32", "float8_e8m0fnu",
        0.0, 0x00, None, None,
        "e8m0 has no zero; torch returns 0x00, i.e. 2^-127, where refgrad rejects the value "
        "(round_to_bits raises ValueError). Zero amax must be handled before the cast.",
    ),
    KnownTorchBehaviour(
        "float32 negative->float8_e8m0fnu", "float32", "float8_e8m0fnu",
        -3.0, 0x81, None, None,
        "e8m0 is unsigned; torch drops the sign and rounds |x| (3.0 is a tie, up to 4.0), "
        "where refgrad rejects negative values.",
    ),
    KnownTorchBehaviour(
        "float32 subnormal->float8_e8m0fnu rounds up", "float32", "float8_e8m0fnu",
        2.0**-127 + 2.0**-129, 0x01, 0x00, None,
        "1.25·2^-127 is a float32 subnormal; its nearest e8m0 value is 2^-127 (0x00), but "
        "torch gives 2^-126. Every float32 in the open interval (2^-127, 1.5·2^-127) is "
        "rounded up this way (torch appears to read a subnormal's fraction as if it were "
        "normal); inputs there are excluded from the agreement comparisons.",
    ),
    KnownTorchBehaviour(
        "float32 out of range->float8_e4m3fn saturates", "float32", "float8_e4m3fn",
        1000.0, 0x7E, 0x7F, "nan",
        "torch saturates to 448 (refgrad's default policy for e4m3fn, the MX element rule); "
        "the OCP FP8 non-saturating conversion (overflow='nan') gives NaN 0x7F, as torch did "
        "before 2.13 (PyTorch PR #178817).",
        under_policy="saturate",
    ),
    KnownTorchBehaviour(
        "float32 inf->float8_e4m3fn saturates", "float32", "float8_e4m3fn",
        float("inf"), 0x7E, 0x7F, "nan",
        "e4m3fn has no infinity; torch maps +inf to 448 (saturate, like PTX satfinite), the "
        "non-saturating OCP conversion gives NaN 0x7F, as torch did before 2.13.",
        under_policy="saturate",
    ),
)


# float32 inputs in this open interval hit the e8m0 subnormal behaviour above.
E8M0_TORCH_SUBNORMAL_ROUND_UP = (2.0**-127, 1.5 * 2.0**-127)


def outside_known_torch_behaviours(fmt: F.FloatFormat, values: torch.Tensor) -> torch.Tensor:
    """Mask of float32 ``values`` whose cast to ``fmt`` is not a known torch behaviour."""
    if fmt.name != "float8_e8m0fnu":
        return torch.ones_like(values, dtype=torch.bool)
    low, high = E8M0_TORCH_SUBNORMAL_ROUND_UP
    return (values > 0) & ~((values > low) & (values < high))



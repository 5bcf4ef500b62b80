"""Self-check of refgrad.formats: round trips, torch cast agreement, known torch behaviours.

Three kinds of evidence:

1. Every 8-bit pattern (and a sample, or all, of the 16-bit patterns) survives
   ``decode`` -> ``round_to_bits``; NaN patterns come back as a NaN.
2. Casting float32 to each narrower format with torch gives the same bits as
   ``round_to_bits``, on values built *at* every representable value, *at* the
   midpoint between neighbours, and one float32 ULP either side of it (plus
   random values). The expected bits of those constructed values follow from
   the rounding rule alone: the lower neighbour below the midpoint, the upper
   one above it, the even pattern at it (float8_e8m0fnu: the upper one, its
   documented tie rule), and the format's overflow policy past the largest
   finite value.
3. Where torch's casts differ from correct rounding (other source dtypes,
   policies), each difference is recorded in :data:`KNOWN_TORCH_BEHAVIOURS` with
   a concrete example and reported as a finding.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch.torch_version import Version

from refgrad import formats as F
from verify.check import Check, CheckContext, CheckRecorder
from verify.metrics import bitwise_equal

FLOAT32_CAST_TARGETS: tuple[F.FloatFormat, ...] = (
    F.FLOAT16,
    F.BFLOAT16,
    F.FLOAT8_E4M3FN,
    F.FLOAT8_E5M2,
    F.FLOAT8_E8M0FNU,
)

# The value one ULP past the largest finite value, had the format one more code:
# the upper neighbour that defines the overflow threshold (max + half that ULP).
# Hand-derived from each format's top binade.
VIRTUAL_NEXT_AFTER_MAX: dict[str, Fraction] = {
    "float16": Fraction(65536),  # 65504 + 32
    "bfloat16": Fraction(2) ** 128,  # (2 - 2^-7)·2^127 + 2^120
    "float8_e4m3fn": Fraction(480),  # 448 + 32 (0x7F would be 480 but is NaN)
    "float8_e5m2": Fraction(65536),  # 57344 + 8192
    "float8_e8m0fnu": Fraction(2) ** 128,  # 2^127 · 2
}

# round_to_bits(fmt, value, overflow) -> bits; the candidate the check holds to the rules.
RoundFunction = Callable[[F.FloatFormat, object, "str | None"], int]
# cast(tensor, dtype) -> tensor; torch's cast unless a test swaps in a broken one.
CastFunction = Callable[[torch.Tensor, torch.dtype], torch.Tensor]


def torch_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's own cast: the behaviour this check characterises."""
    return t.to(dtype)


# torch's float32 -> float8_e4m3fn cast past the largest finite value (448). Up to 2.12.x it
# is OCP FP8's non-saturating conversion: NaN (S.1111.111), for inf too. PyTorch PR #178817
# ("Properly saturate E4M3 on finite-overflow on CPU/C++ conversion code", merged
# 2026-04-17) made it saturate to ±448; torch 2.13.0 is the first release with it. Read in
# torch/headeronly/util/Float8_e4m3fn.h of the 2.11.0, 2.12.0, 2.12.1 and 2.13.0 wheels, and
# seen on the CPU in 2.11.0 and 2.13.0.
FIRST_TORCH_SATURATING_E4M3FN = (2, 13)


def torch_release(torch_version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string; a pre-release (``2.13.0a0+...``, as NGC
    containers ship) counts as its release."""
    release = Version(torch_version).release
    return release[0], release[1] if len(release) > 1 else 0


def torch_cast_overflow(fmt: F.FloatFormat, torch_version: str) -> str:
    """The overflow policy of torch's float32 cast to ``fmt`` in that torch release."""
    if fmt.name == "float8_e4m3fn" and torch_release(torch_version) < FIRST_TORCH_SATURATING_E4M3FN:
        return "nan"
    return fmt.default_overflow


@dataclass(frozen=True)
class CastCandidates:
    """float32 inputs for a cast to ``fmt`` and the bits correct rounding must give."""

    fmt: F.FloatFormat
    values: torch.Tensor  # float32
    expected_bits: torch.Tensor  # int64 patterns of fmt
    kinds: tuple[str, ...]  # one label per value: "exact", "tie", "above", "below"


def _overflow_bits(fmt: F.FloatFormat, negative: bool, overflow: str) -> int:
    sign = fmt.sign_bit if negative else 0
    if overflow == "inf":
        return sign | (((1 << fmt.exponent_bits) - 1) << fmt.mantissa_bits)
    if overflow == "saturate":
        return sign | fmt.max_finite_bits
    return fmt.canonical_nan_bits


def float32_cast_candidates(
    fmt: F.FloatFormat, patterns: torch.Tensor, overflow: str | None = None
) -> CastCandidates:
    """Build values at, between and around the given positive finite patterns of ``fmt``.

    ``patterns`` are int64 positive finite patterns (<= ``fmt.max_finite_bits``).
    For each pattern p with upper neighbour p+1: the value of p, the midpoint,
    and the float32 neighbours of the midpoint; for signed formats the negated
    values too. Values come from torch's widening to float64, which is exact.
    ``overflow`` is the policy past the largest finite value (default: the format's).
    """
    overflow = fmt.default_overflow if overflow is None else overflow
    if patterns.numel() and int(patterns.max()) > fmt.max_finite_bits:
        raise ValueError(f"patterns must be <= max_finite_bits ({fmt.max_finite_bits:#x})")
    dtype = fmt.torch_dtype
    low = F.tensor_from_bit_patterns(patterns, dtype).to(torch.float64)
    at_top = patterns == fmt.max_finite_bits
    next_patterns = torch.where(at_top, patterns, patterns + 1)
    high = F.tensor_from_bit_patterns(next_patterns, dtype).to(torch.float64)
    high = torch.where(at_top, torch.full_like(high, float(VIRTUAL_NEXT_AFTER_MAX[fmt.name])), high)
    midpoint64 = (low + high) / 2  # exact: one bit more than the format's precision
    midpoint = midpoint64.to(torch.float32)
    if not bitwise_equal(midpoint.to(torch.float64), midpoint64):
        raise AssertionError(f"{fmt.name}: a midpoint is not exactly representable in float32")
    above = torch.nextafter(midpoint, torch.full_like(midpoint, float("inf")))
    below = torch.nextafter(midpoint, torch.full_like(midpoint, float("-inf")))

    upper_bits = torch.where(at_top, torch.full_like(patterns, _overflow_bits(fmt, False, overflow)),
                             patterns + 1)
    if fmt.name == "float8_e8m0fnu":
        tie_bits = upper_bits  # documented tie rule: 1.5·2^k rounds up
    else:
        tie_bits = torch.where(patterns % 2 == 0, patterns, upper_bits)

    values = [low.to(torch.float32), midpoint, above, below]
    expected = [patterns, tie_bits, upper_bits, patterns]
    kinds = ["exact", "tie", "above", "below"]
    if fmt.signed:
        nan_bits = fmt.canonical_nan_bits
        values += [-v for v in values]
        expected += [torch.where(e == nan_bits, e, e | fmt.sign_bit) for e in expected]
        kinds += [f"-{k}" for k in kinds]
    n = patterns.numel()
    return CastCandidates(
        fmt=fmt,
        values=torch.cat(values),
        expected_bits=torch.cat(expected),
        kinds=tuple(k for k in kinds for _ in range(n)),
    )


def positive_finite_patterns(fmt: F.FloatFormat) -> torch.Tensor:
    """Every positive finite pattern of ``fmt``, as int64 (0 .. max_finite_bits)."""
    return torch.arange(fmt.max_finite_bits + 1, dtype=torch.int64)


def refgrad_round_float32(
    fmt: F.FloatFormat,
    values: torch.Tensor,
    overflow: str | None = None,
    round_to_bits: RoundFunction = F.round_to_bits,
) -> torch.Tensor:
    """``round_to_bits`` of each float32 value (exact: Python floats are binary64)."""
    bits = [round_to_bits(fmt, float(x), overflow) for x in values.tolist()]
    return torch.tensor(bits, dtype=torch.int64)


@dataclass(frozen=True)
class KnownTorchBehaviour:
    """A torch cast result that is not the correctly rounded one, with one concrete example.

    ``correct_bits`` is refgrad's ``round_to_bits(target, example, overflow)``;
    ``None`` when the value has no encoding in the target (refgrad raises).
    ``torch_bits`` is what torch (CPU) returns for ``example`` held in ``source_dtype`` and
    cast with ``.to(target_dtype)``: in every release seen (2.11 to 2.13) where ``since`` is
    None, else from release ``since`` on; before it torch gives ``correct_bits``.
    """

    name: str
    source_dtype: str
    target_dtype: str
    example: float
    torch_bits: int
    correct_bits: int | None
    overflow: str | None
    explanation: str
    since: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.since is not None and self.correct_bits is None:
            raise ValueError(f"{self.name}: since= needs correct_bits, what torch gave before it")

    def present_in(self, torch_version: str) -> bool:
        """Whether that torch release behaves so (else it gives ``correct_bits``)."""
        return self.since is None or torch_release(torch_version) >= self.since

    def expected_torch_bits(self, torch_version: str) -> int | None:
        """What that torch release is recorded to return for ``example``."""
        return self.torch_bits if self.present_in(torch_version) else self.correct_bits

    def torch_result(self, cast: CastFunction = torch_cast) -> int:
        """The bits ``cast`` (torch's own by default) gives for ``example``."""
        source = torch.tensor([self.example], dtype=getattr(torch, self.source_dtype))
        if source.item() != self.example and self.example == self.example:
            raise ValueError(f"{self.name}: example {self.example!r} is not exact in {self.source_dtype}")
        return int(F.tensor_bit_patterns(cast(source, getattr(torch, self.target_dtype)))[0])

    def refgrad_result(self, round_to_bits: RoundFunction = F.round_to_bits) -> int | None:
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
        since=FIRST_TORCH_SATURATING_E4M3FN,
    ),
    KnownTorchBehaviour(
        "float32 inf->float8_e4m3fn saturates", "float32", "float8_e4m3fn",
        float("inf"), 0x7E, 0x7F, "nan",
        "e4m3fn has no infinity; torch maps +inf to 448 (saturate, like PTX satfinite), the "
        "non-saturating OCP conversion gives NaN 0x7F, as torch did before 2.13.",
        since=FIRST_TORCH_SATURATING_E4M3FN,
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


def _expect_roundtrip(
    rec: CheckRecorder,
    fmt: F.FloatFormat,
    patterns: list[int],
    tag: str,
    round_to_bits: RoundFunction,
) -> None:
    failures = []
    for bits in patterns:
        back = round_to_bits(fmt, F.decode(fmt, bits), None)
        ok = F.is_nan_bits(fmt, back) if F.is_nan_bits(fmt, bits) else back == bits
        if not ok:
            failures.append(f"{bits:#x}->{back:#x}")
    rec.expect(
        f"{fmt.name}: decode -> round_to_bits round-trips ({tag}, {len(patterns)} patterns)",
        not failures,
        "failures: " + ", ".join(failures[:10]) if failures else "",
    )


def _compare_cast(
    rec: CheckRecorder,
    label: str,
    fmt: F.FloatFormat,
    expected: torch.Tensor,
    values: torch.Tensor,
    cast: CastFunction,
) -> None:
    """Bitwise comparison of expected bits with the cast of float32 ``values``.

    Where the rule gives NaN, the cast must give a NaN, of either sign: torch keeps the
    input's sign on the NaN of an e4m3fn overflow (OCP's S.1111.111), refgrad returns one
    canonical NaN, and a NaN's sign carries no value (as for the NaN payloads below).
    """
    candidate = cast(values, fmt.torch_dtype)
    wanted = F.tensor_from_bit_patterns(expected, fmt.torch_dtype)
    nan = torch.isnan(wanted.to(torch.float32))  # widening keeps NaN, exactly
    rec.compare(label, wanted[~nan], candidate[~nan])
    if bool(nan.any()):
        rec.expect(f"{label}: NaN where the rule gives NaN ({int(nan.sum())} values)",
                   bool(torch.isnan(candidate[nan].to(torch.float32)).all()))


def _sample(patterns: torch.Tensor, size: int, rng: random.Random) -> torch.Tensor:
    if patterns.numel() <= size:
        return patterns
    chosen = sorted(rng.sample(range(patterns.numel()), size))
    # Always include both ends: zero/min subnormal and the overflow threshold.
    return torch.unique(torch.cat([patterns[chosen], patterns[:2], patterns[-2:]]))


def _random_float32(fmt: F.FloatFormat, n: int, generator: torch.Generator) -> torch.Tensor:
    """Random float32 bit patterns, plus random values spread over ``fmt``'s exponent range."""
    raw = torch.randint(-(2**31), 2**31, (n,), generator=generator, dtype=torch.int64)
    arbitrary = raw.to(torch.int32).view(torch.float32)
    low_exp = fmt.min_exponent - fmt.mantissa_bits - 2
    high_exp = fmt.min_exponent + (1 << fmt.exponent_bits) + 1
    exponents = torch.randint(low_exp, high_exp, (n,), generator=generator).to(torch.float64)
    fractions = 1 + torch.rand(n, generator=generator, dtype=torch.float64)
    signs = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0).to(torch.float64)
    in_range = (signs * fractions * torch.exp2(exponents)).to(torch.float32)
    return torch.cat([arbitrary, in_range])


@dataclass(frozen=True)
class FormatsCandidate:
    """What the ``formats`` check holds to the rounding rule: refgrad's rounding and torch's cast."""

    round_to_bits: RoundFunction = F.round_to_bits
    cast: CastFunction = torch_cast
    torch_version: str = str(torch.__version__)  # the release whose cast policies apply

    @classmethod
    def default(cls) -> FormatsCandidate:
        """``refgrad.formats.round_to_bits`` and torch's own casts."""
        return cls()


def run(ctx: CheckContext, rec: CheckRecorder, candidate: FormatsCandidate) -> None:
    """The ``formats`` check: round trips, the rounding rule, and torch's float32 casts."""
    round_to_bits, cast, version = candidate.round_to_bits, candidate.cast, candidate.torch_version
    rng = random.Random(ctx.seed)

    # 1. Round trips.
    for fmt in (F.FLOAT8_E4M3FN, F.FLOAT8_E5M2, F.FLOAT8_E8M0FNU):
        _expect_roundtrip(rec, fmt, list(range(256)), "all", round_to_bits)
    for fmt in (F.FLOAT16, F.BFLOAT16):
        if ctx.quick:
            patterns = sorted(rng.sample(range(1 << 16), 2048))
            _expect_roundtrip(rec, fmt, patterns, "sample", round_to_bits)
        else:
            _expect_roundtrip(rec, fmt, list(range(1 << 16)), "all", round_to_bits)

    # 2. torch's float32 casts vs the rounding rule and vs refgrad.
    rows = []
    excluded = 0
    for offset, fmt in enumerate(FLOAT32_CAST_TARGETS):
        every = positive_finite_patterns(fmt)
        torch_patterns = _sample(every, 2048, rng) if ctx.quick else every
        torch_overflow = torch_cast_overflow(fmt, version)
        constructed = float32_cast_candidates(fmt, torch_patterns, torch_overflow)
        keep = outside_known_torch_behaviours(fmt, constructed.values)
        excluded += int((~keep).sum())
        _compare_cast(
            rec,
            f"float32->{fmt.name}: torch vs rounding rule "
            f"({torch_patterns.numel()} patterns: at, tie, ±1 float32 ULP around ties)",
            fmt, constructed.expected_bits[keep], constructed.values[keep], cast,
        )
        n_constructed = int(keep.sum())
        checked = every if fmt.total_bits == 8 else _sample(every, 128 if ctx.quick else 4096, rng)
        subset = float32_cast_candidates(fmt, checked)
        refgrad_bits = refgrad_round_float32(fmt, subset.values, None, round_to_bits)
        rec.compare(
            f"float32->{fmt.name}: refgrad vs rounding rule ({checked.numel()} patterns)",
            F.tensor_from_bit_patterns(subset.expected_bits, fmt.torch_dtype),
            F.tensor_from_bit_patterns(refgrad_bits, fmt.torch_dtype),
        )
        randoms = _random_float32(fmt, 200 if ctx.quick else 4000, ctx.generator(offset))
        nan_input = torch.isnan(randoms)
        keep = outside_known_torch_behaviours(fmt, randoms) | nan_input
        excluded += int((~keep).sum())
        randoms = randoms[keep]
        nan_input = nan_input[keep]
        finite = randoms[~nan_input]
        _compare_cast(
            rec, f"float32->{fmt.name}: torch vs refgrad ({finite.numel()} random values)",
            fmt, refgrad_round_float32(fmt, finite, torch_overflow, round_to_bits), finite, cast,
        )
        nan_out_torch = torch.isnan(cast(randoms[nan_input], fmt.torch_dtype).to(torch.float32))
        nan_out_ref = [
            F.is_nan_bits(fmt, int(b))
            for b in refgrad_round_float32(fmt, randoms[nan_input], None, round_to_bits)
        ]
        rec.expect(
            f"float32->{fmt.name}: NaN inputs give NaN in torch and refgrad",
            bool(nan_out_torch.all()) and all(nan_out_ref),
        )
        rows.append([fmt.name, torch_overflow, n_constructed, subset.values.numel(),
                     randoms.numel()])
    rec.table(
        "float32 -> narrow casts compared",
        ["target", f"torch {version} overflow", "torch vs rule (values)",
         "refgrad vs rule (values)", "random values"],
        rows,
        [
            "rule = the bits implied by nearest/ties-to-even and the overflow policy (torch's "
            "for its casts; refgrad's default for refgrad); a NaN matches a NaN of either sign",
            f"{excluded} inputs excluded as known torch behaviours (e8m0: zero, negative, "
            "float32 subnormals in (2^-127, 1.5·2^-127))",
        ],
    )

    # 3. Other sources: fp16/bf16 -> fp8 directly must equal going through float32 (exact).
    for source in (torch.float16, torch.bfloat16):
        every_source = F.tensor_from_bit_patterns(torch.arange(1 << 16, dtype=torch.int64), source)
        for target in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
            direct = cast(every_source, target)
            via_float32 = cast(every_source.to(torch.float32), target)
            # NaN payloads differ between the two paths (torch detail); values must not.
            finite = ~torch.isnan(every_source)
            rec.compare(
                f"{str(source)[6:]}->{str(target)[6:]}: direct cast vs via float32 "
                f"({int(finite.sum())} non-NaN patterns)",
                via_float32[finite], direct[finite],
            )

    # 4. Known torch behaviours: refgrad's side must hold; torch's side is reported.
    rows = []
    for known in KNOWN_TORCH_BEHAVIOURS:
        refgrad_bits = known.refgrad_result(round_to_bits)
        torch_bits = known.torch_result(cast)
        recorded = known.expected_torch_bits(version)
        rec.expect(
            f"known behaviour '{known.name}': refgrad gives the correctly rounded result",
            refgrad_bits == known.correct_bits,
            f"refgrad {refgrad_bits!r}, recorded {known.correct_bits!r}",
        )
        absent = "" if known.present_in(version) else (
            f", absent before torch {known.since[0]}.{known.since[1]}")
        status = f"as recorded{absent}" if torch_bits == recorded else (
            f"CHANGED: torch {version} gives {torch_bits:#04x} (recorded {recorded:#04x}{absent})"
        )
        correct = "no encoding" if known.correct_bits is None else f"{known.correct_bits:#04x}"
        rec.note(
            f"torch {known.source_dtype}->{known.target_dtype} of {known.example!r}: "
            f"torch {torch_bits:#04x}, correct {correct}"
            f"{'' if known.overflow is None else f' (overflow={known.overflow})'} [{status}]. "
            f"{known.explanation}"
        )
        rows.append([known.name, repr(known.example), f"{torch_bits:#04x}", correct, status])
    rec.table(
        f"Known torch cast behaviours (torch {version}, CPU)",
        ["behaviour", "example", "torch bits", "correct bits", "status"],
        rows,
    )


CHECK = Check(
    name="formats",
    summary="refgrad.formats round trips and agreement with torch's float32 casts",
    run=run,
    default_candidate=FormatsCandidate.default(),
)

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
   documented tie rule), and past the largest finite value torch's overflow
   policy for the running release (:func:`verify.torch_casts.overflow_policy`:
   the format's default, except float8_e4m3fn before torch 2.13, which gives
   NaN).
3. Where torch's casts differ from correct rounding (other source dtypes,
   policies), each difference is recorded in :data:`verify.torch_casts.KNOWN_TORCH_BEHAVIOURS`
   with a concrete example and reported as a finding.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction

import torch

from refgrad import formats as F
from verify.check import Check, CheckContext, CheckRecorder
from verify.metrics import bitwise_equal
from verify.torch_casts import (
    KNOWN_TORCH_BEHAVIOURS,
    CastFunction,
    RoundFunction,
    observed_overflow,
    outside_known_torch_behaviours,
    overflow_policy,
    torch_cast,
    torch_cast_overflow,
    torch_version_of,
)

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
        not_nan = ~torch.isnan(candidate[nan].to(torch.float32))
        examples = [f"{x!r} -> {b:#04x}" for x, b in zip(
            values[nan][not_nan][:5].tolist(),
            F.tensor_bit_patterns(candidate[nan][not_nan][:5]).tolist())]
        rec.expect(f"{label}: NaN where the rule gives NaN ({int(nan.sum())} values)",
                   not bool(not_nan.any()),
                   f"{int(not_nan.sum())} not NaN, e.g. " + ", ".join(examples) if examples else "")


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

    def __post_init__(self) -> None:
        torch_version_of(self.torch_version, "FormatsCandidate.torch_version")

    @classmethod
    def default(cls) -> FormatsCandidate:
        """``refgrad.formats.round_to_bits`` and torch's own casts."""
        return cls()


def _torch_policy(rec: CheckRecorder, fmt: F.FloatFormat, version: str, cast: CastFunction) -> str:
    """torch's overflow policy for ``fmt`` in ``version``; where the version cannot tell (a
    2.13.0 alpha), the one its cast shows, said in a note."""
    policy = overflow_policy(fmt, version, cast)
    if torch_cast_overflow(fmt, version) is None:
        seen = observed_overflow(fmt, cast)
        rec.note(f"torch {version} is a 2.13.0 pre-release, built before or after PyTorch PR "
                 f"#178817 changed its {fmt.name} overflow from NaN to saturation; its cast of "
                 f"1000.0 shows {seen or 'neither'}, the policy held to here")
    return policy


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

    # 2. torch's float32 casts vs the rounding rule and vs refgrad, under torch's policies.
    policies = {fmt.name: _torch_policy(rec, fmt, version, cast) for fmt in FLOAT32_CAST_TARGETS}
    rows = []
    excluded = 0
    for offset, fmt in enumerate(FLOAT32_CAST_TARGETS):
        every = positive_finite_patterns(fmt)
        torch_patterns = _sample(every, 2048, rng) if ctx.quick else every
        torch_overflow = policies[fmt.name]
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
        policy = policies[known.target_dtype]
        recorded = known.expected_torch_bits(policy)
        rec.expect(
            f"known behaviour '{known.name}': refgrad gives the correctly rounded result",
            refgrad_bits == known.correct_bits,
            f"refgrad {refgrad_bits!r}, recorded {known.correct_bits!r}",
        )
        absent = "" if known.present_under(policy) else (
            f", absent: this torch's {known.target_dtype} overflow is {policy!r}")
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

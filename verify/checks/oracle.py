"""Self-check of the exact-sum oracles: verify.oracle against refgrad.exact and hand-derived cases.

Evidence, in order of independence from the code under test:

1. Hand-derived cases (:data:`HAND_CASES`): inputs whose correctly rounded sum
   was worked out on paper (ties to even, sticky bits, the fp16 overflow
   threshold at max + half an ULP, signed zeros, NaN/inf rules). Both oracles
   must give exactly the written bit pattern.
2. Constructed rounding midpoints: for random target values ``y`` the inputs
   sum exactly to ``y + ulp(y)/2`` (optionally nudged by ±2^-149), hidden among
   cancelling pairs spread over the whole float32 range. The expected result
   follows from the rounding rule alone: the even neighbour at the tie, the
   lower or upper one when nudged.
3. IEEE hardware as a witness: for two float32 terms, float32 addition is
   correctly rounded by IEEE 754, so ``a + b`` must equal the oracle bitwise.
4. verify.oracle against refgrad.exact on seeded adversarial families: every
   float32/bfloat16/float16 bit pattern (NaN, inf, subnormals included), the
   full exponent range, subnormals, massive cancellation, signed zeros and
   specials, near-overflow sums, into every target format.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from refgrad import exact
from refgrad import formats as F
from verify import oracle
from verify.check import Check, CheckContext, CheckRecorder

SumFunction = Callable[..., torch.Tensor]
"""``correctly_rounded_sum(stacked [W, ...] tensor, dtype, overflow=None) -> tensor``."""


@dataclass(frozen=True)
class OracleCandidate:
    """The vectorised exact sum under test (normally ``verify.oracle.correctly_rounded_sum``)."""

    correctly_rounded_sum: SumFunction = oracle.correctly_rounded_sum

    @classmethod
    def default(cls) -> OracleCandidate:
        """``verify.oracle.correctly_rounded_sum``."""
        return cls()

_MAX32 = (2.0 - 2.0**-23) * 2.0**127


@dataclass(frozen=True)
class HandCase:
    """One column summed over ranks, with its hand-derived correctly rounded bits."""

    label: str
    inputs: tuple[float, ...]  # one exactly representable value per rank
    input_dtype: torch.dtype
    target: torch.dtype
    expected_bits: int
    overflow: str | None = None

    def stacked(self) -> torch.Tensor:
        """The inputs as a [W, 1] tensor (Python floats are exact; the values are representable)."""
        return torch.tensor(self.inputs, dtype=self.input_dtype).reshape(-1, 1)


_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16

# Every expected pattern below is derived by hand from the rounding rule; the
# comment says how. (ulp(1) is 2^-23 in fp32, 2^-10 in fp16, 2^-7 in bf16.)
HAND_CASES: tuple[HandCase, ...] = (
    # 1 + 2^-23 exactly: the two half-ULPs add up to one ULP before the single rounding.
    HandCase("fp32 1 + 2^-24 + 2^-24", (1.0, 2.0**-24, 2.0**-24), _F32, _F32, 0x3F800001),
    # 1 + 2^-24 is the midpoint of 1 and 1 + 2^-23; 1 (mantissa 0) is even.
    HandCase("fp32 tie 1 + 2^-24 -> 1", (1.0, 2.0**-24), _F32, _F32, 0x3F800000),
    # Midpoint of 1 + 2^-23 (odd) and 1 + 2^-22 (even).
    HandCase(
        "fp32 tie (1+2^-23) + 2^-24 -> 1+2^-22", (1.0 + 2.0**-23, 2.0**-24), _F32, _F32, 0x3F800002
    ),
    # A sticky 2^-149 above the midpoint rounds up, below it rounds down.
    HandCase("fp32 just above tie", (1.0, 2.0**-24, 2.0**-149), _F32, _F32, 0x3F800001),
    HandCase("fp32 just below tie", (1.0, 2.0**-24, -(2.0**-149)), _F32, _F32, 0x3F800000),
    HandCase(
        "fp32 negative -(1 + 2^-24 + 2^-24)",
        (-1.0, -(2.0**-24), -(2.0**-24)),
        _F32,
        _F32,
        0xBF800001,
    ),
    # 1 + 1024 * 2^-24 = 1 + 2^-14 = 0x3F800000 + 2^9; a running fp32 sum would stay at 1.
    HandCase("fp32 1 + 1024 x 2^-24", (1.0,) + (2.0**-24,) * 1024, _F32, _F32, 0x3F800200),
    # The huge terms cancel exactly; the smallest subnormal survives.
    HandCase(
        "fp32 cancellation leaves 2^-149",
        (1.5 * 2.0**127, 2.0**-149, -1.5 * 2.0**127),
        _F32,
        _F32,
        0x00000001,
    ),
    HandCase("fp32 max + max -> inf", (_MAX32, _MAX32), _F32, _F32, 0x7F800000),
    HandCase(
        "fp32 max + max - max = max exactly", (_MAX32, _MAX32, -_MAX32), _F32, _F32, 0x7F7FFFFF
    ),
    # ulp(max) = 2^104: max + 2^103 is the overflow threshold, a tie whose even side is 2^128.
    HandCase("fp32 max + half ulp -> inf", (_MAX32, 2.0**103), _F32, _F32, 0x7F800000),
    HandCase("fp32 max + quarter ulp -> max", (_MAX32, 2.0**102), _F32, _F32, 0x7F7FFFFF),
    HandCase(
        "fp32 max + half ulp saturate", (_MAX32, 2.0**103), _F32, _F32, 0x7F7FFFFF, "saturate"
    ),
    HandCase("fp32 max - max -> +0", (_MAX32, -_MAX32), _F32, _F32, 0x00000000),
    HandCase("fp32 -0 + -0 -> -0", (-0.0, -0.0), _F32, _F32, 0x80000000),
    HandCase("fp32 -0 alone -> -0", (-0.0,), _F32, _F32, 0x80000000),
    HandCase("fp32 -0 + +0 -> +0", (-0.0, 0.0), _F32, _F32, 0x00000000),
    HandCase("fp32 -1 + 1 -> +0", (-1.0, 1.0), _F32, _F32, 0x00000000),
    HandCase("fp32 -1 + -0 + 1 -> +0", (-1.0, -0.0, 1.0), _F32, _F32, 0x00000000),
    # Canonical NaN of refgrad.formats: exponent all ones, quiet bit only.
    HandCase("fp32 inf + -inf -> NaN", (float("inf"), float("-inf")), _F32, _F32, 0x7FC00000),
    HandCase("fp32 NaN + inf -> NaN", (float("nan"), float("inf")), _F32, _F32, 0x7FC00000),
    HandCase("fp32 inf + 1 + max -> inf", (float("inf"), 1.0, _MAX32), _F32, _F32, 0x7F800000),
    HandCase("fp32 -inf + -inf -> -inf", (float("-inf"), float("-inf")), _F32, _F32, 0xFF800000),
    HandCase("fp32 2^-149 + 2^-149 -> 2^-148", (2.0**-149, 2.0**-149), _F32, _F32, 0x00000002),
    HandCase(
        "fp32 2^-126 - 2^-149 -> largest subnormal",
        (2.0**-126, -(2.0**-149)),
        _F32,
        _F32,
        0x007FFFFF,
    ),
    # fp16: max 65504, ulp 32 there; 65520 is the tie whose even side is 2^16 -> overflow.
    HandCase("fp16 65504 + 16 -> inf", (65504.0, 16.0), _F32, _F16, 0x7C00),
    HandCase("fp16 65504 + 15.5 -> 65504", (65504.0, 15.5), _F32, _F16, 0x7BFF),
    HandCase("fp16 65504 + 16 saturate -> 65504", (65504.0, 16.0), _F32, _F16, 0x7BFF, "saturate"),
    HandCase("fp16 65504 + 16 nan policy -> NaN", (65504.0, 16.0), _F32, _F16, 0x7E00, "nan"),
    # fp16 subnormal quantum 2^-24: 2^-25 ties between 0 (even) and 2^-24.
    HandCase("fp16 2^-25 -> +0 (tie to even)", (2.0**-25,), _F32, _F16, 0x0000),
    HandCase("fp16 -2^-25 -> -0 (tie to even)", (-(2.0**-25),), _F32, _F16, 0x8000),
    HandCase("fp16 2^-25 + 2^-40 -> 2^-24", (2.0**-25, 2.0**-40), _F32, _F16, 0x0001),
    HandCase("fp16 3 x 2^-25 -> 2 x 2^-24 (tie to even)", (3 * 2.0**-25,), _F32, _F16, 0x0002),
    HandCase("fp16 inputs 1 + 2^-11 -> 1", (1.0, 2.0**-11), _F16, _F16, 0x3C00),
    HandCase(
        "fp16 inputs 1 + 2^-11 + 2^-11 -> 1 + 2^-10", (1.0, 2.0**-11, 2.0**-11), _F16, _F16, 0x3C01
    ),
    HandCase("bf16 tie 1 + 2^-8 -> 1", (1.0, 2.0**-8), _F32, _BF16, 0x3F80),
    HandCase("bf16 just above tie", (1.0, 2.0**-8, 2.0**-30), _F32, _BF16, 0x3F81),
    HandCase("bf16 tie (1+2^-7) + 2^-8 -> 1+2^-6", (1.0 + 2.0**-7, 2.0**-8), _F32, _BF16, 0x3F82),
    HandCase("bf16 inputs tie 1 + 2^-8 -> 1", (1.0, 2.0**-8), _BF16, _BF16, 0x3F80),
    HandCase("bf16 inputs 256 x 2^-8 + 1 -> 2", (1.0,) + (2.0**-8,) * 256, _BF16, _BF16, 0x4000),
    # e4m3fn: 240 = 1.875·2^7 (0x77); 248 ties 240 (odd) and 256 (0x78, even).
    HandCase("e4m3fn tie 240 + 8 -> 256", (240.0, 8.0), _F32, torch.float8_e4m3fn, 0x78),
    # 448 (0x7E) is max; 464 ties 448 (even) and 480 (would be 0x7F = NaN).
    HandCase("e4m3fn 448 + 16 -> 448", (448.0, 16.0), _F32, torch.float8_e4m3fn, 0x7E),
    HandCase("e4m3fn 448 + 17 saturates", (448.0, 17.0), _F32, torch.float8_e4m3fn, 0x7E),
    HandCase("e4m3fn 448 + 17 nan policy", (448.0, 17.0), _F32, torch.float8_e4m3fn, 0x7F, "nan"),
    # e5m2: max 57344, ulp 8192 there; 57344 + 4096 ties to 2^16 -> inf (0x7C).
    HandCase("e5m2 57344 + 4096 -> inf", (57344.0, 4096.0), _F32, torch.float8_e5m2, 0x7C),
    HandCase("e5m2 57344 + 4095 -> 57344", (57344.0, 4095.0), _F32, torch.float8_e5m2, 0x7B),
)


# ---------------------------------------------------------------- adversarial inputs


def random_patterns(g: torch.Generator, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Uniformly random bit patterns of ``dtype``: NaN, inf, subnormals and all exponents."""
    width = torch.empty(0, dtype=dtype).element_size() * 8
    return F.tensor_from_bit_patterns(torch.randint(0, 1 << width, tuple(shape), generator=g), dtype)


def full_exponent_spread(
    g: torch.Generator, shape: Sequence[int], exponents: tuple[int, int] = (0, 254)
) -> torch.Tensor:
    """Finite float32 values with a uniformly random biased exponent (0 = subnormal) and sign."""
    shape = tuple(shape)
    sign = torch.randint(0, 2, shape, generator=g) << 31
    exponent = torch.randint(exponents[0], exponents[1] + 1, shape, generator=g) << 23
    mantissa = torch.randint(0, 1 << 23, shape, generator=g)
    return F.tensor_from_bit_patterns(sign | exponent | mantissa, torch.float32)


def _shuffle_rows(g: torch.Generator, stacked: torch.Tensor) -> torch.Tensor:
    """Each column's entries in an independent random rank order."""
    order = torch.rand(stacked.shape, generator=g).argsort(dim=0)
    return stacked.gather(0, order)


def massive_cancellation(g: torch.Generator, ranks: int, columns: int) -> torch.Tensor:
    """Pairs ``a, -a`` over the whole float32 range hiding a few tiny residues, shuffled."""
    pairs = (ranks - 2) // 2
    big = full_exponent_spread(g, (pairs, columns), exponents=(100, 254))
    residue = full_exponent_spread(g, (ranks - 2 * pairs, columns), exponents=(0, 110))
    return _shuffle_rows(g, torch.cat([big, -big, residue]))


def signed_zeros_and_specials(g: torch.Generator, ranks: int, columns: int) -> torch.Tensor:
    """Columns drawn from ±0, ±inf, NaN, ±max, ±1 and the smallest subnormal."""
    pool = torch.tensor(
        [
            0.0,
            -0.0,
            -0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            _MAX32,
            -_MAX32,
            1.0,
            -1.0,
            2.0**-149,
        ]
    )
    # Mostly -0 so that many columns are all -0; rarer specials so that many columns have none.
    weights = torch.tensor([2.0, 30.0, 30.0, 30.0, 0.3, 0.3, 0.2, 1.0, 1.0, 1.0, 1.0, 1.0])
    picks = torch.multinomial(weights, ranks * columns, replacement=True, generator=g)
    return pool[picks].reshape(ranks, columns)


def near_overflow(g: torch.Generator, ranks: int, columns: int) -> torch.Tensor:
    """Large values of both signs near float32 max, whose exact sums straddle the overflow threshold."""
    return full_exponent_spread(g, (ranks, columns), exponents=(250, 254))


@dataclass(frozen=True)
class Midpoints:
    """Inputs whose exact sums are at (or one subnormal beside) a rounding midpoint of ``target``."""

    stacked: torch.Tensor  # [W, n] float32
    target: torch.dtype
    expected_bits: torch.Tensor  # [n] int64, from the rounding rule alone
    n_ties: int


def midpoints(g: torch.Generator, target: torch.dtype, ranks: int, columns: int) -> Midpoints:
    """Columns summing exactly to ``y + ulp(y)/2`` (+ a nudge of 0 or ±2^-149), among cancelling pairs.

    ``y`` is a random positive finite value of ``target`` below its maximum; the
    expected bits are those of ``y`` or its successor: the even one of the two at
    an exact tie, the lower one when nudged down, the upper one when nudged up.
    """
    if ranks < 6:
        raise ValueError(f"ranks must be >= 6 to hold the midpoint pieces, got {ranks}")
    fmt = F.format_of(target)
    # The smallest target value whose half-ULP is a float32 number (>= 2^-149).
    lowest = 2 << fmt.mantissa_bits if fmt is F.FLOAT32 else 0
    y_bits = torch.randint(lowest, fmt.max_finite_bits, (columns,), generator=g)
    y = F.tensor_from_bit_patterns(y_bits, target).float()  # widening to float32 is exact
    successor = F.tensor_from_bit_patterns(y_bits + 1, target).float()
    half_ulp = ((successor.double() - y.double()) / 2).float()  # a power of two: exact
    # y = y_high + y_low exactly: y_high drops 12 mantissa bits, y_low is those bits.
    y_high = F.tensor_from_bit_patterns(F.tensor_bit_patterns(y) & ~0xFFF, torch.float32)
    y_low = (y.double() - y_high.double()).float()
    nudge_kind = torch.randint(-1, 2, (columns,), generator=g)
    nudge = nudge_kind.float() * 2.0**-149
    negative = torch.randint(0, 2, (columns,), generator=g).bool()
    sign = torch.where(negative, -1.0, 1.0)
    pieces = torch.stack([y_high, y_low, half_ulp, nudge]) * sign
    pairs = (ranks - 4) // 2
    filler = full_exponent_spread(g, (pairs, columns))
    zeros = torch.zeros(ranks - 4 - 2 * pairs, columns)
    stacked = _shuffle_rows(g, torch.cat([pieces, filler, -filler, zeros]))

    tie_choice = torch.where(y_bits % 2 == 0, y_bits, y_bits + 1)
    chosen = torch.where(
        nudge_kind < 0, y_bits, torch.where(nudge_kind > 0, y_bits + 1, tie_choice)
    )
    expected = chosen | (negative.long() * fmt.sign_bit)
    return Midpoints(stacked, target, expected, int((nudge_kind == 0).sum()))


# ---------------------------------------------------------------- the check


def _reference(
    stacked: torch.Tensor, target: torch.dtype, overflow: str | None = None
) -> torch.Tensor:
    return exact.correctly_rounded_sum(list(stacked), target, overflow)


def check_oracle(ctx: CheckContext, rec: CheckRecorder, candidate: SumFunction) -> None:
    """Hold ``candidate`` (normally verify.oracle.correctly_rounded_sum) to refgrad.exact and hand cases."""
    columns = 24 if ctx.quick else 1024
    g = ctx.generator(2)

    hand_failures = []
    for case in HAND_CASES:
        expected = case.expected_bits
        reference = exact.correctly_rounded_sum(list(case.stacked()), case.target, case.overflow)
        got_ref = int(F.tensor_bit_patterns(reference)[0])
        got_cand = int(F.tensor_bit_patterns(candidate(case.stacked(), case.target, overflow=case.overflow))[0])
        if got_ref != expected or got_cand != expected:
            hand_failures.append(
                f"{case.label}: expected {expected:#x}, refgrad {got_ref:#x}, candidate {got_cand:#x}"
            )
    rec.expect(
        f"{len(HAND_CASES)} hand-derived cases: refgrad.exact and the candidate give the written bits",
        not hand_failures,
        "; ".join(hand_failures),
    )

    rows = []
    for target in oracle.TARGET_DTYPES:
        mid = midpoints(g, target, ranks=12, columns=columns)
        got = candidate(mid.stacked, target)
        ref = _reference(mid.stacked, target)
        expected = F.tensor_from_bit_patterns(mid.expected_bits, target)
        name = F.format_of(target).name
        rec.compare(f"midpoints into {name}: candidate vs rounding rule", expected, got)
        rec.compare(f"midpoints into {name}: refgrad.exact vs rounding rule", expected, ref)
        rows.append([name, columns, mid.n_ties, int((F.tensor_bit_patterns(got) == mid.expected_bits).sum())])
    rec.table(
        "constructed rounding midpoints (12 ranks, cancelling pairs over the whole float32 range)",
        ["target", "columns", "exact ties", "candidate correct"],
        rows,
    )

    pair = full_exponent_spread(g, (2, 4 * columns))
    # Signed-zero rules, exact cancellation, overflow both ways, a tie: then random pairs.
    pair[:, :8] = torch.tensor(
        [
            [-0.0, -0.0, 0.0, 1.0, _MAX32, -_MAX32, 2.0**-149, 1.0],
            [-0.0, 0.0, -0.0, -1.0, _MAX32, -_MAX32, -(2.0**-149), 2.0**-24],
        ]
    )
    rec.compare(
        "2 ranks into float32: IEEE float32 addition (correctly rounded by IEEE 754) vs candidate",
        pair[0] + pair[1],
        candidate(pair, torch.float32),
    )

    families: list[tuple[str, torch.Tensor]] = [
        (
            "random float32 patterns (NaN/inf/subnormal)",
            random_patterns(g, (6, columns), torch.float32),
        ),
        ("random bfloat16 patterns", random_patterns(g, (16, columns), torch.bfloat16)),
        ("random float16 patterns", random_patterns(g, (16, columns), torch.float16)),
        ("random float8_e4m3fn patterns", random_patterns(g, (16, columns), torch.float8_e4m3fn)),
        ("full float32 exponent range", full_exponent_spread(g, (24, columns))),
        (
            "subnormals and the smallest normals",
            full_exponent_spread(g, (24, columns), exponents=(0, 2)),
        ),
        ("massive cancellation", massive_cancellation(g, 48, columns)),
        ("signed zeros and specials", signed_zeros_and_specials(g, 6, columns)),
        ("near float32 overflow", near_overflow(g, 8, columns)),
    ]
    for label, stacked in families:
        values = [F.decode_tensor(row) for row in stacked]
        sums = [exact.ieee_sum(column) for column in zip(*values)]
        for target in oracle.TARGET_DTYPES:
            fmt = F.format_of(target)
            ref = F.round_values_to_tensor(fmt, sums, (stacked.shape[1],))
            got = candidate(stacked, target)
            rec.compare(f"{label} [{stacked.shape[0]} ranks] into {fmt.name}", ref, got)
    rec.note(
        "refgrad.exact.ieee_sum + refgrad.formats rounding is the reference for the families; "
        "verify.oracle uses float64 band sums and integer limbs (proof in verify/oracle.py)"
    )


def _on_cuda(
    correctly_rounded_sum: SumFunction, stacked: torch.Tensor, dtype: torch.dtype, *args, **kwargs
) -> torch.Tensor:
    """The vectorised oracle computed on the GPU, returned on the CPU for comparison."""
    return correctly_rounded_sum(stacked.cuda(), dtype, *args, **kwargs).cpu()


def run(ctx: CheckContext, rec: CheckRecorder, candidate: OracleCandidate) -> None:
    """The ``oracle`` check: the candidate's sum on the CPU (and on CUDA with ``--device cuda``)."""
    check_oracle(ctx, rec, candidate.correctly_rounded_sum)
    if ctx.device == "cuda":
        check_oracle(ctx, rec, functools.partial(_on_cuda, candidate.correctly_rounded_sum))
    else:
        rec.skip("verify.oracle on CUDA tensors: run `verify run --device cuda`")


CHECK = Check(
    name="oracle",
    summary="verify.oracle (vectorised exact sum) equals refgrad.exact and hand-derived roundings",
    run=run,
    default_candidate=OracleCandidate.default(),
)

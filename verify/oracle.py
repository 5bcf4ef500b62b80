"""A vectorised, exact correctly-rounded sum for large sweeps.

``correctly_rounded_sum(tensors_or_stacked, dtype)`` gives, for every element,
the exact sum over the first dimension (ranks) rounded once, to nearest with
ties to even, to ``dtype``: the same bits as :func:`refgrad.exact.correctly_rounded_sum`,
hundreds of times faster. Inputs may be float32, float16, bfloat16,
float8_e4m3fn or float8_e5m2; targets float32, float16, bfloat16, float8_e4m3fn
or float8_e5m2. IEEE rules for NaN, infinities and signed zero are those of
``refgrad.exact.ieee_sum``; overflow follows ``refgrad.formats`` (``overflow=``).

Why the result is exact (proof sketch)
======================================

Notation: every input is first widened to float32, which is exact for all the
input formats (each is a subset of float32; ``tests/verify/test_oracle.py``
checks the cast against ``refgrad.formats.decode`` for every 8- and 16-bit
pattern). A finite float32 ``x`` with biased exponent field ``E`` (0..254) is an
integer multiple of ``2^(max(E,1)-150)`` and ``|x| < 2^(E-126)``.

1. *Bands.* Put ``x`` in band ``j = E >> 4`` (0..15, read from bits 27..30) and
   let ``u_j = 2^(16j-150)``. Every ``E`` in band ``j`` has ``max(E,1) >= 16j``,
   so ``x = k·u_j`` for an integer ``k``, and ``E <= 16j+15`` gives
   ``|x| < 2^(16j-111) = 2^39·u_j``, i.e. ``|k| < 2^39``.
2. *Exact float64 band sums.* Sum the values of one band in float64 over a group
   of at most ``2^13`` rows (``scatter_add_``, in whatever order the
   implementation likes: sequential, pairwise, SIMD lanes or GPU atomics). The
   sum of *any subset* of the group's band-``j`` values is ``K·u_j`` with
   ``|K| < 2^13·2^39 = 2^52``: an integer below 2^53 times a power of two between
   2^-150 and 2^90, which is a normal binary64 number. IEEE 754 addition returns
   the exact result whenever it is representable, so every addition, whatever
   the association, is exact, and the accumulator is the exact band sum
   ``A_j``. (Widening float32→float64 is exact; a run-time probe refuses to run
   if flush-to-zero/denormals-are-zero mode would turn float32 subnormals into
   zeros.)
3. *Integers.* ``I_j = A_j · 2^(150-16j)`` is an exact multiplication by a power
   of two and yields an integer ``|I_j| < 2^52``, converted exactly to int64.
   Groups of rows add in int64: at most ``2^10`` groups keep ``|I_j| < 2^62``
   (hence the limit ``W <= 2^23``). Now ``N = S·2^150 = Σ_j I_j·2^(16j)``
   exactly, where ``S`` is the exact finite sum.
4. *Limbs.* Carry-propagating ``N`` into 20 base-2^16 limbs (arithmetic shift is
   floor division, so each step keeps the value) leaves limbs 0..18 in
   ``[0, 2^16)`` (no int64 overflow: a limb below 2^62 receives a carry below
   2^47) and, because ``|N| < 2^23·2^128·2^150 = 2^301 < 2^304``, a top
   limb in {-1, 0} that is the sign. Negating every limb of a negative ``N`` and
   propagating again gives the limbs of ``|N|``.
5. *One rounding.* With ``P`` the position of the leading bit of ``|N|``, the
   target's precision ``p`` and ``q_min`` the position of its smallest subnormal
   (>= 1 for every supported target), the result's last-bit position is
   ``q = max(P-p+1, q_min)``: the IEEE quantum of ``S``, in the same basis.
   ``T = floor(|N| / 2^(q-1))`` is below ``2^(p+1)``,
   so it lies in three consecutive limbs; the sticky bit is "some bit below
   ``q-1`` is set", read from the limbs below and a mask. Round to nearest even
   on ``(T >> 1, T & 1, sticky)`` is then exact integer arithmetic. For a value
   ``k·2^q`` with ``q >= q_min`` the IEEE encoding of the magnitude is
   ``((q-q_min) << mantissa_bits) + k`` (subnormals, normals, and a carry out of
   the significand into the next binade alike); an encoding beyond the largest
   finite one is overflow and takes the policy's bits.
6. *Specials and zeros.* A NaN or infinity lands in band 15 and makes that
   float64 accumulator non-finite (a finite band-15 sum is below
   ``2^13·2^128``), so exactly the columns with a special are detected there and
   recomputed from the inputs: NaN if any NaN or both infinities, else the
   infinity. An exact zero is -0 only when every input of the column is -0.
   The bits of NaN, ±inf, overflow and -0 are taken from
   ``refgrad.formats.round_to_bits`` itself, so both oracles share those rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refgrad.formats import (
    BFLOAT16,
    FLOAT8_E4M3FN,
    FLOAT8_E5M2,
    FLOAT16,
    FLOAT32,
    FloatFormat,
    Special,
    format_of,
    round_to_bits,
    tensor_from_bit_patterns,
)

__all__ = ["INPUT_DTYPES", "MAX_RANKS", "TARGET_DTYPES", "correctly_rounded_sum"]

INPUT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
_TARGET_FORMATS: tuple[FloatFormat, ...] = (FLOAT32, FLOAT16, BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2)
TARGET_DTYPES: tuple[torch.dtype, ...] = tuple(f.torch_dtype for f in _TARGET_FORMATS)

# A band spans 16 binades (band = biased float32 exponent >> 4) and a limb 16 bits, so
# band j's unit 2^(16j-150) is exactly limb j's weight (proof steps 1 and 3).
_LIMB_BITS = 16
_BAND_OF_BITS_SHIFT = 23 + 4  # float32 mantissa bits + log2(binades per band)
_BANDS = 16
_LIMBS = 20  # 320 bits > 2^301, the largest |S|·2^150 (see the proof, step 4)
_ROWS_PER_GROUP = 1 << 13  # keeps float64 band sums below 2^52 units (step 2)
_MAX_GROUPS = 1 << 10  # keeps int64 band sums below 2^62 (step 3)
MAX_RANKS = _ROWS_PER_GROUP * _MAX_GROUPS
_BASE_EXPONENT = -150  # N = S · 2^150 is an integer for every float32 sum
_ELEMENTS_PER_CHUNK = 1 << 18  # working-set size for the banding pass
_COLUMNS_PER_FINISH = 4096



def _stack(tensors_or_stacked: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """A [W, ...] tensor of one supported dtype, validated."""
    if isinstance(tensors_or_stacked, torch.Tensor):
        stacked = tensors_or_stacked
        if stacked.dim() == 0:
            raise ValueError(
                "tensors_or_stacked must have a leading rank dimension, got a 0-d tensor"
            )
        if stacked.dtype not in INPUT_DTYPES:
            raise TypeError(
                f"tensors_or_stacked has dtype {stacked.dtype}; supported: {INPUT_DTYPES}"
            )
    else:
        tensors = list(tensors_or_stacked)
        if not tensors:
            raise ValueError("tensors_or_stacked must contain at least one tensor")
        for index, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"tensors_or_stacked[{index}] must be a torch.Tensor, got {type(t).__name__}"
                )
            if t.dtype not in INPUT_DTYPES:
                raise TypeError(
                    f"tensors_or_stacked[{index}] has dtype {t.dtype}; supported: {INPUT_DTYPES}"
                )
            if t.shape != tensors[0].shape:
                raise ValueError(
                    f"tensors_or_stacked must all have the same shape: [{index}] has "
                    f"{tuple(t.shape)}, [0] has {tuple(tensors[0].shape)}"
                )
            if t.device != tensors[0].device:
                raise ValueError(
                    f"tensors_or_stacked must all be on one device: [{index}] is on "
                    f"{t.device}, [0] on {tensors[0].device}"
                )
        if len({t.dtype for t in tensors}) > 1:
            tensors = [t.float() for t in tensors]  # widening to float32 is exact
        stacked = torch.stack(tensors)
    stacked = stacked.detach()
    if stacked.shape[0] == 0:
        raise ValueError("tensors_or_stacked must hold at least one rank (dimension 0 is empty)")
    if stacked.shape[0] > MAX_RANKS:
        raise ValueError(
            f"at most {MAX_RANKS} tensors can be summed exactly, got {stacked.shape[0]}"
        )
    return stacked


def _target_format(dtype: torch.dtype) -> FloatFormat:
    if dtype not in TARGET_DTYPES:
        raise TypeError(f"dtype must be one of {TARGET_DTYPES}, got {dtype}")
    return format_of(dtype)


def _check_subnormals_survive(device: torch.device) -> None:
    """Refuse to run when denormals-are-zero would silently drop subnormal inputs."""
    smallest = torch.ones(1, dtype=torch.int32, device=device).view(torch.float32)
    half_smallest = torch.ones(1, dtype=torch.int16, device=device).view(torch.float16)
    if (smallest.double().item() != FLOAT32.min_positive
            or half_smallest.float().item() != FLOAT16.min_positive):
        raise RuntimeError(
            "subnormal inputs are flushed to zero on this device (torch.set_flush_denormal(True)?); "
            "verify.oracle needs exact subnormals"
        )


def _band_integers(stacked: torch.Tensor, special_columns: torch.Tensor) -> torch.Tensor:
    """I_j (proof step 3): [16, n] int64 with S·2^150 = Σ_j I_j·2^(16j); marks special columns."""
    ranks = stacked.shape[0]
    flat = stacked.reshape(ranks, -1)
    n = flat.shape[1]
    device = flat.device
    band_integers = torch.zeros(_BANDS, n, dtype=torch.int64, device=device)
    to_integer = torch.tensor(
        [2.0 ** (-_BASE_EXPONENT - _LIMB_BITS * j) for j in range(_BANDS)],
        dtype=torch.float64,
        device=device,
    ).unsqueeze(1)
    for row0 in range(0, ranks, _ROWS_PER_GROUP):
        rows = flat[row0 : row0 + _ROWS_PER_GROUP]
        columns_per_chunk = max(1, _ELEMENTS_PER_CHUNK // rows.shape[0])
        for col0 in range(0, n, columns_per_chunk):
            chunk = rows[:, col0 : col0 + columns_per_chunk]
            if chunk.dtype != torch.float32:
                chunk = chunk.float()
            band = ((chunk.view(torch.int32) >> _BAND_OF_BITS_SHIFT) & (_BANDS - 1)).long()
            band_sums = torch.zeros(_BANDS, chunk.shape[1], dtype=torch.float64, device=device)
            band_sums.scatter_add_(0, band, chunk.double())
            finite = torch.isfinite(band_sums[_BANDS - 1])
            special_columns[col0 : col0 + chunk.shape[1]] |= ~finite
            band_sums[_BANDS - 1].masked_fill_(~finite, 0.0)
            band_integers[:, col0 : col0 + chunk.shape[1]] += (band_sums * to_integer).long()
    return band_integers


def _propagate_carries(limbs: torch.Tensor) -> None:
    """In place: limbs 0..K-2 into [0, 2^16), the top limb keeps the sign (step 4)."""
    mask = (1 << _LIMB_BITS) - 1
    for k in range(limbs.shape[0] - 1):
        carry = limbs[k] >> _LIMB_BITS
        limbs[k] &= mask
        limbs[k + 1] += carry


def _round_magnitudes(
    band_integers: torch.Tensor, fmt: FloatFormat
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(magnitude bits in fmt, negative, exact zero) of Σ_j I_j·2^(16j)·2^-150 (step 5)."""
    n = band_integers.shape[1]
    device = band_integers.device
    limbs = torch.zeros(_LIMBS, n, dtype=torch.int64, device=device)
    limbs[:_BANDS] = band_integers
    _propagate_carries(limbs)
    negative = limbs[-1] < 0
    limbs = torch.where(negative, -limbs, limbs)
    _propagate_carries(limbs)

    nonzero = limbs != 0
    limb_index = torch.arange(_LIMBS, device=device).unsqueeze(1)
    top = torch.where(nonzero, limb_index, -1).amax(0)
    is_zero = top < 0
    top = top.clamp_min(0)
    top_limb = limbs.gather(0, top.unsqueeze(0))[0]
    # top_limb < 2^16, so float64 holds it exactly and frexp's exponent is its bit length.
    bit_length = torch.frexp(top_limb.double()).exponent.long()
    leading = _LIMB_BITS * top + bit_length - 1

    q_min = fmt.min_exponent - fmt.mantissa_bits - _BASE_EXPONENT
    last_bit = torch.clamp_min(leading - fmt.mantissa_bits, q_min)
    round_pos = last_bit - 1
    limb_at = (round_pos // _LIMB_BITS).unsqueeze(0)
    shift = round_pos & (_LIMB_BITS - 1)
    padded = torch.cat([limbs, torch.zeros(3, n, dtype=torch.int64, device=device)])
    window = (
        (padded.gather(0, limb_at)[0] >> shift)
        + (padded.gather(0, limb_at + 1)[0] << (_LIMB_BITS - shift))
        + (padded.gather(0, limb_at + 2)[0] << (2 * _LIMB_BITS - shift))
    )
    if bool((window >> (fmt.mantissa_bits + 2)).any()):
        raise AssertionError("verify.oracle: rounding window exceeds p+1 bits (proof step 5)")
    nonzero_limbs_below = torch.cumsum(nonzero.long(), 0) - nonzero.long()
    sticky = (padded.gather(0, limb_at)[0] & ((1 << shift) - 1)) != 0
    sticky |= nonzero_limbs_below.gather(0, limb_at)[0] > 0

    round_bit = window & 1
    kept = window >> 1
    kept += round_bit & (sticky.long() | (kept & 1))
    magnitude_bits = ((last_bit - q_min) << fmt.mantissa_bits) + kept
    return magnitude_bits, negative, is_zero


def _special_bits(fmt: FloatFormat, overflow: str | None) -> dict[str, int]:
    """The bit patterns refgrad.formats gives to each non-ordinary outcome."""
    too_big = 2 * fmt.max_finite  # rounds to 2·max_finite > max_finite: overflow
    return {
        "nan": round_to_bits(fmt, Special.NAN, overflow),
        "pos_inf": round_to_bits(fmt, Special.POS_INF, overflow),
        "neg_inf": round_to_bits(fmt, Special.NEG_INF, overflow),
        "neg_zero": round_to_bits(fmt, Special.NEG_ZERO, overflow),
        "pos_overflow": round_to_bits(fmt, too_big, overflow),
        "neg_overflow": round_to_bits(fmt, -too_big, overflow),
    }


def correctly_rounded_sum(
    tensors_or_stacked: torch.Tensor | Sequence[torch.Tensor],
    dtype: torch.dtype,
    overflow: str | None = None,
) -> torch.Tensor:
    """Exact elementwise sum over ranks, rounded once (nearest, ties to even) to ``dtype``.

    ``tensors_or_stacked`` is a [W, ...] tensor (summed over dimension 0) or a
    sequence of W same-shape tensors on one device. Returns a tensor of shape
    ``[...]`` and dtype ``dtype`` on the inputs' device, bitwise equal to
    ``refgrad.exact.correctly_rounded_sum`` (see the module docstring for the proof).
    ``overflow``: ``"inf"``, ``"saturate"`` or ``"nan"``; ``None`` is the format's default.
    """
    fmt = _target_format(dtype)
    specials = _special_bits(fmt, overflow)  # also validates ``overflow``
    stacked = _stack(tensors_or_stacked)
    _check_subnormals_survive(stacked.device)
    ranks, out_shape = stacked.shape[0], stacked.shape[1:]
    flat = stacked.reshape(ranks, -1)
    n = flat.shape[1]
    device = flat.device

    special_columns = torch.zeros(n, dtype=torch.bool, device=device)
    band_integers = _band_integers(flat, special_columns)
    bits = torch.empty(n, dtype=torch.int64, device=device)
    zero_columns = torch.zeros(n, dtype=torch.bool, device=device)
    for col0 in range(0, n, _COLUMNS_PER_FINISH):
        block = slice(col0, col0 + _COLUMNS_PER_FINISH)
        magnitude, negative, is_zero = _round_magnitudes(band_integers[:, block], fmt)
        overflowed = magnitude > fmt.max_finite_bits
        signed = magnitude | (negative.long() * fmt.sign_bit)
        signed = torch.where(
            overflowed & negative,
            specials["neg_overflow"],
            torch.where(overflowed, specials["pos_overflow"], signed),
        )
        bits[block] = signed
        zero_columns[block] = is_zero

    zero_columns &= ~special_columns
    if bool(zero_columns.any()):
        index = zero_columns.nonzero().squeeze(1)
        values = flat.index_select(1, index).float().view(torch.int32)
        all_negative_zero = (values == torch.iinfo(torch.int32).min).all(0)
        bits[index] = torch.where(
            all_negative_zero,
            torch.full_like(index, specials["neg_zero"]),
            torch.zeros_like(index),
        )
    if bool(special_columns.any()):
        index = special_columns.nonzero().squeeze(1)
        values = flat.index_select(1, index).float()
        has_nan = torch.isnan(values).any(0)
        has_pos_inf = (values == float("inf")).any(0)
        has_neg_inf = (values == float("-inf")).any(0)
        is_nan = has_nan | (has_pos_inf & has_neg_inf)
        bits[index] = torch.where(
            is_nan,
            specials["nan"],
            torch.where(has_pos_inf, specials["pos_inf"], specials["neg_inf"]),
        )
    return tensor_from_bit_patterns(bits, fmt.torch_dtype).reshape(out_shape)

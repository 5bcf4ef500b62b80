"""The "formats" and "metrics" self-checks pass, and fail when fed broken candidates."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch

from refgrad import formats as F
from verify.check import CheckContext
from verify.checks import check_by_name
from verify.checks.formats import FormatsCandidate
from verify.checks.metrics import MetricsCandidate
from verify.metrics import UlpDistance, compare, ulp_distance

QUICK = CheckContext(quick=True)



def test_formats_check_passes_quick():
    result = check_by_name("formats").execute(QUICK)
    assert result.error is None, result.error
    assert result.passed, result.failed_labels()
    assert result.comparisons and result.expectations
    # Every known torch behaviour is reported as a finding with its example.
    assert len(result.notes) >= 9
    assert any("float64->bfloat16" in f and "0x3f80" in f for f in result.notes)


def test_metrics_check_passes_quick():
    result = check_by_name("metrics").execute(QUICK)
    assert result.error is None, result.error
    assert result.passed, result.failed_labels()


def truncating_round_to_bits(fmt, value, overflow=None):
    """Broken candidate: rounds toward zero instead of to nearest."""
    bits = F.round_to_bits(fmt, value, overflow)
    exact = Fraction(value) if isinstance(value, float) and value == value and abs(value) != float(
        "inf") else value
    if not isinstance(exact, Fraction) or exact == 0 or F.is_nan_bits(fmt, bits):
        return bits
    rounded = F.decode(fmt, bits)
    has_smaller_magnitude = bits & ~fmt.sign_bit > 0
    if isinstance(rounded, Fraction) and abs(rounded) > abs(exact) and has_smaller_magnitude:
        return bits - 1  # the next pattern toward zero (same sign)
    return bits


def _run_formats(**candidates):
    return check_by_name("formats").execute(QUICK, FormatsCandidate(**candidates))


def test_formats_check_fails_for_truncating_rounding():
    result = _run_formats(round_to_bits=truncating_round_to_bits)
    assert not result.passed
    failed = result.failed_labels()
    assert any("refgrad vs rounding rule" in label for label in failed)
    assert any("known behaviour" in label for label in failed)


def test_formats_check_fails_for_truncating_bf16_cast():
    def truncating_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.bfloat16 and t.dtype == torch.float32:
            kept = t.contiguous().view(torch.int32) & -65536  # drop the low 16 bits
            return kept.view(torch.float32).to(dtype)  # now exact: plain truncation
        return t.to(dtype)

    result = _run_formats(cast=truncating_cast)
    failed = result.failed_labels()
    assert not result.passed
    assert any("float32->bfloat16: torch vs rounding rule" in label for label in failed)
    assert all("bfloat16" in label for label in failed)


def _e4m3fn_past_the_threshold(t: torch.Tensor) -> torch.Tensor:
    """Where a cast to e4m3fn overflows: a magnitude past 464 (448 plus half its ULP; 464
    itself ties to even, 448), infinities included, NaN not. Hand-derived."""
    return t.to(torch.float32).abs() > 464  # exact widening


def non_saturating_e4m3fn_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's e4m3fn cast as releases before 2.13 made it, by OCP FP8's non-saturating rule:
    past the threshold a NaN with the input's sign (S.1111.111). Hand-derived, so the check's
    pre-2.13 expectations are exercised on any torch (on torch 2.11 it equals torch's cast)."""
    out = t.to(dtype)
    if dtype != torch.float8_e4m3fn:
        return out
    nan_bits = torch.where(t < 0, 0xFF, 0x7F).to(torch.uint8)
    return torch.where(_e4m3fn_past_the_threshold(t), nan_bits, out.view(torch.uint8)).view(dtype)


def saturating_e4m3fn_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's e4m3fn cast from 2.13 on: past the threshold ±448 (0x7E/0xFE). Hand-derived."""
    out = t.to(dtype)
    if dtype != torch.float8_e4m3fn:
        return out
    max_bits = torch.where(t < 0, 0xFE, 0x7E).to(torch.uint8)
    return torch.where(_e4m3fn_past_the_threshold(t), max_bits, out.view(torch.uint8)).view(dtype)


def _e4m3fn_labels(result) -> list[str]:
    return [label for label in result.failed_labels() if "float8_e4m3fn" in label]


@pytest.mark.parametrize("cast, release, other_release", [
    (non_saturating_e4m3fn_cast, "2.11.0", "2.13.0"),
    (saturating_e4m3fn_cast, "2.13.0", "2.12.1"),
])
def test_formats_check_holds_each_torch_release_to_its_own_e4m3fn_overflow(cast, release,
                                                                            other_release):
    """Before 2.13 torch's e4m3fn cast gives NaN past 464, from 2.13 on it saturates: the
    check passes a cast that follows its release's policy, and fails the other policy's, on
    e4m3fn's torch comparisons only."""
    right = _run_formats(cast=cast, torch_version=release)
    assert right.error is None, right.error
    assert right.passed, right.failed_labels()
    wrong = _run_formats(cast=cast, torch_version=other_release)
    assert not wrong.passed
    assert wrong.failed_labels() == _e4m3fn_labels(wrong)
    assert any("float32->float8_e4m3fn: torch vs rounding rule" in x for x in wrong.failed_labels())
    if cast is saturating_e4m3fn_cast:  # NaN expected, 448 given: the NaN expectation fails
        nan_labels = [x for x in wrong.failed_labels() if "NaN where the rule gives NaN" in x]
        assert nan_labels
        details = [e.detail for e in wrong.expectations if e.label in nan_labels]
        assert all("not NaN, e.g. " in d and "0x7e" in d for d in details), details
    pre_2_13 = cast is non_saturating_e4m3fn_cast
    notes = [n for n in right.notes if "float8_e4m3fn of inf" in n]
    assert len(notes) == 1 and (("0x7f" in notes[0] and "absent: this torch's float8_e4m3fn "
                                 "overflow is 'nan'" in notes[0]) if pre_2_13
                                else ("0x7e" in notes[0] and "absent" not in notes[0])), notes


def test_formats_check_on_the_installed_torch_fails_when_told_another_release():
    saturates = torch.tensor([1000.0]).to(torch.float8_e4m3fn).view(torch.uint8) == 0x7E
    claimed = _run_formats(torch_version="2.12.1" if bool(saturates) else "2.13.0")
    assert not claimed.passed
    assert claimed.failed_labels() == _e4m3fn_labels(claimed)


@pytest.mark.parametrize("cast, shown", [(non_saturating_e4m3fn_cast, "nan"),
                                         (saturating_e4m3fn_cast, "saturate")])
def test_a_213_alpha_is_held_to_the_policy_its_cast_shows_and_says_so(cast, shown):
    result = _run_formats(cast=cast, torch_version="2.13.0a0+gitabc")
    assert result.passed, result.failed_labels()
    (note,) = [n for n in result.notes if "2.13.0 pre-release" in n]
    assert f"shows {shown}" in note and "PyTorch PR #178817" in note


def test_formats_candidate_refuses_a_version_torch_could_not_have():
    with pytest.raises(ValueError, match="FormatsCandidate.torch_version must be a torch version"):
        FormatsCandidate(torch_version="nightly")


def _run_metrics(**candidates):
    return check_by_name("metrics").execute(QUICK, MetricsCandidate(**candidates))


def test_metrics_check_fails_for_raw_bit_difference():
    """Broken candidate: |bits(a) - bits(b)|, with no sign-magnitude mapping or NaN rules."""

    def raw_difference(a: torch.Tensor, b: torch.Tensor) -> UlpDistance:
        width = a.element_size() * 8
        view = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[width]
        mask = (1 << width) - 1
        ia = a.view(view).to(torch.int64) & mask
        ib = b.view(view).to(torch.int64) & mask
        return UlpDistance((ia - ib).abs(), torch.zeros_like(ia, dtype=torch.bool))

    result = _run_metrics(ulp_distance=raw_difference)
    failed = result.failed_labels()
    assert not result.passed
    assert any("+0 and -0" in label for label in failed)
    assert any("NaN vs NaN" in label for label in failed)


def test_metrics_check_fails_for_wrong_compare_fields():
    def forgets_inf(reference, candidate):
        return dataclasses.replace(compare(reference, candidate), inf_mismatch=0)

    result = _run_metrics(compare=forgets_inf)
    assert result.failed_labels() == ["compare(): inf_mismatch == 1"]


def test_metrics_check_fails_when_zero_signs_are_not_merged():
    def signed_zero_distance(a, b):
        d = ulp_distance(a, b)
        a32, b32 = a.to(torch.float32), b.to(torch.float32)
        zero_pair = (a32 == 0) & (b32 == 0) & (torch.signbit(a32) != torch.signbit(b32))
        return UlpDistance(d.ulps + zero_pair.to(torch.int64), d.nan_mismatch)

    result = _run_metrics(ulp_distance=signed_zero_distance)
    assert not result.passed
    assert any("+0 and -0" in label for label in result.failed_labels())

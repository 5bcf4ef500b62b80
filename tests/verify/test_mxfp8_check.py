"""The ``mxfp8`` check passes on the real code and fails on broken candidates."""

from __future__ import annotations

import pytest
import torch

from fastgrad import mxfp8 as fast
from verify.check import CheckContext, CheckRecorder
from verify.checks import CHECK_MODULES, check_by_name
from verify.checks import mxfp8 as check_module


def test_mxfp8_check_is_registered():
    assert "mxfp8" in CHECK_MODULES
    assert check_by_name("mxfp8") is check_module.CHECK


@pytest.mark.dist
def test_mxfp8_check_passes_quick():
    result = check_module.CHECK.execute(CheckContext(quick=True))
    assert result.error is None, result.error
    assert result.passed, [c.label for c in result.comparisons if not c.passed] + [
        e.label for e in result.expectations if not e.passed
    ]
    titles = [t.title for t in result.tables]
    assert any("conformance" in t for t in titles)
    assert any("drift" in t for t in titles)
    assert any("7B" in str(t.rows) for t in result.tables)
    # the sharing comparison ran: bits, grads and masters at 3 iterations on both ranks
    labels = [c.label for c in result.comparisons]
    assert sum("iteration 2" in label and "grad buffer" in label for label in labels) == 2
    # torch's naive casts disagree with the spec somewhere: reported, not failed
    assert any(f.startswith("torch casts (naive)") for f in result.findings)
    # internal note and description names never reach the report
    text = " ".join(titles + result.findings).lower()
    assert "reference_notes" not in text and "seed" not in text


def _ties_away_from_zero(x, *, scale_mode="floor", block_size=32):
    """A plausible bug: element rounding ties away from zero instead of to even."""
    scales, _ = fast.quantize(x, scale_mode=scale_mode, block_size=block_size)
    exponent = scales.to(torch.float64).sub(127).repeat_interleave(block_size, dim=-1)
    scaled = x.double() * torch.exp2(-exponent)
    nudged = scaled + torch.sign(scaled) * scaled.abs() * 2.0**-30  # break ties upward
    return scales, nudged.to(torch.float8_e4m3fn).view(torch.uint8)


def _floor_for_every_mode(x, *, scale_mode="floor", block_size=32):
    """A plausible bug: the scale mode is ignored."""
    return fast.quantize(x, scale_mode="floor", block_size=block_size)


@pytest.mark.dist
@pytest.mark.parametrize("broken", [_ties_away_from_zero, _floor_for_every_mode])
def test_check_fails_on_a_broken_quantizer(broken):
    result = check_module.CHECK.execute(CheckContext(quick=True),
                                        check_module.MXFP8Candidate(quantize=broken))
    assert result.error is None, result.error
    assert not result.passed
    assert any(not c.passed for c in result.comparisons)


def test_quantizer_part_passes_on_the_real_candidate():
    rec = CheckRecorder("mxfp8")
    check_module.check_quantizer(CheckContext(quick=True), rec)
    result = rec.finish(0.0)
    assert result.passed and len(result.comparisons) == 3 * 4 * 2 + 2 * 3


def test_memory_part_fails_when_the_allocation_is_not_shared():
    # Toy model at dp=2: numel 7424 (hand-derived in tests/fastgrad/test_mxfp8_sharing.py);
    # fp32 grads + bf16 params = 6 bytes per element without sharing, 4 with.
    honest_off = {"allocated_bytes": 7424 * 6, "numel": 7424, "sharing": False}
    honest_on = {"allocated_bytes": 7424 * 4, "numel": 7424, "sharing": True}
    rec = CheckRecorder("mxfp8")
    check_module.check_memory(rec, {(False, True): honest_off, (True, True): honest_on})
    assert rec.finish(0.0).passed
    # a "sharing" buffer that silently allocated param_data anyway
    rank0 = {(False, True): honest_off, (True, True): {**honest_on, "allocated_bytes": 7424 * 6}}
    rec = CheckRecorder("mxfp8")
    check_module.check_memory(rec, rank0)
    failed = [e.label for e in rec.finish(0.0).expectations if not e.passed]
    assert any("measured bytes equal the expected allocation (fp32 grads, sharing=True)" in label for label in failed)
    assert any("saving equals" in label for label in failed)
    assert not any("sharing=False" in label for label in failed)

"""The ``mxfp8`` check passes on the real code and fails on broken candidates."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fastgrad import mxfp8 as fast
from refgrad.formats import FLOAT8_E4M3FN
from verify.candidates import FastgradCandidate, Unsupported
from verify.candidates.fastgrad.mxfp8 import FastgradMXFP8
from verify.candidates.interfaces import MXFP8, ParamGatherResult, ParamGatherRun
from verify.check import CheckContext, CheckRecorder
from verify.checks import CHECK_MODULES, check_by_name
from verify.checks import mxfp8 as check_module
from verify.torch_casts import overflow_policy


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
    assert any(f.startswith("torch casts (naive)") for f in result.notes)
    # internal note and description names never reach the report
    text = " ".join(titles + result.notes).lower()
    assert "reference_notes" not in text and "seed" not in text
    # torch's own e4m3fn cast of exactly scaled values: the spec's bits where this release
    # saturates (2.13 on), else NaN exactly where the spec saturates to ±448 (verify.torch_casts)
    (cast_note,) = [n for n in result.notes if "of exactly scaled values" in n]
    if overflow_policy(FLOAT8_E4M3FN, str(torch.__version__)) == "saturate":
        assert " 0 element(s) differ" in cast_note and "saturates, as the spec" in cast_note
    else:
        assert "where the spec saturates to ±448" in cast_note and "and 0 other(s)" in cast_note
        assert " 0 element(s) differ" not in cast_note


class TiesAwayFromZero(FastgradMXFP8):
    """A plausible bug: element rounding ties away from zero instead of to even."""

    def quantize(self, x, *, scale_mode):
        scales, _ = fast.quantize(x, scale_mode=scale_mode)
        exponent = scales.to(torch.float64).sub(127).repeat_interleave(32, dim=-1)
        scaled = x.double() * torch.exp2(-exponent)
        nudged = scaled + torch.sign(scaled) * scaled.abs() * 2.0**-30  # break ties upward
        return scales, nudged.to(torch.float8_e4m3fn).view(torch.uint8)


class FloorForEveryMode(FastgradMXFP8):
    """A plausible bug: the scale mode is ignored."""

    def quantize(self, x, *, scale_mode):
        return fast.quantize(x, scale_mode="floor")


@dataclass(frozen=True)
class BrokenMXFP8Candidate(FastgradCandidate):
    """fastgrad with the MXFP8 adapter ``mxfp8_cls`` (a broken subclass; pickles into ranks)."""

    mxfp8_cls: type[FastgradMXFP8] = FastgradMXFP8

    def mxfp8(self) -> MXFP8:
        return self.mxfp8_cls()


def test_fastgrad_satisfies_the_interface():
    assert isinstance(FastgradCandidate().mxfp8(), MXFP8)


@pytest.mark.dist
@pytest.mark.parametrize("broken", [TiesAwayFromZero, FloorForEveryMode])
def test_check_fails_on_a_broken_quantizer(broken):
    result = check_module.CHECK.execute(CheckContext(quick=True),
                                        BrokenMXFP8Candidate(mxfp8_cls=broken))
    assert result.error is None, result.error
    assert not result.passed
    failed = [c.label for c in result.comparisons if not c.passed]
    assert failed and all(label.startswith("quantize ") for label in failed), failed


def test_quantizer_part_passes_on_the_real_candidate():
    rec = CheckRecorder("mxfp8")
    check_module.check_quantizer(CheckContext(quick=True), rec, FastgradCandidate().mxfp8())
    result = rec.finish(0.0)
    assert result.passed and len(result.comparisons) == 3 * 4 * 2 + 2 * 3


def test_gpu_kernel_is_a_skip_on_the_cpu():
    rec = CheckRecorder("mxfp8")
    check_module.check_gpu_kernel(CheckContext(quick=True), rec, FastgradCandidate().mxfp8())
    assert rec.finish(0.0).skipped == [
        "GPU quantization kernel: needs ctx.device='cuda' (the quantizer ran on the CPU instead)"]
    if not torch.cuda.is_available():
        with pytest.raises(Unsupported, match="Triton kernel needs CUDA"):
            FastgradCandidate().mxfp8().gpu_kernel()


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"shapes": ()}, ValueError, "must name at least one weight"),
        ({"shapes": ((8, 30),)}, ValueError, "a multiple of 32"),
        ({"shapes": ((8, 32), (4, 16))}, ValueError, "a multiple of 32"),
        ({"shapes": ((8, 32), (4, 64))}, ValueError, "takes 64 inputs but layer 0 has 8 outputs"),
        ({"iterations": 0}, ValueError, "iterations must be an int >= 1"),
        ({"grad_reduce_in_fp32": 1}, TypeError, "grad_reduce_in_fp32 must be a bool"),
        ({"scale_mode": "nearest"}, ValueError, "scale_mode must be one of"),
    ],
)
def test_param_gather_run_validates_itself(fields, error, match):
    good = {"shapes": ((64, 32), (32, 64)), "bucket_size": 1000,
            "reuse_grad_buf_for_mxfp8_param_ag": True, "grad_reduce_in_fp32": True, "iterations": 2}
    ParamGatherRun(**good)
    with pytest.raises(error, match=match):
        ParamGatherRun(**{**good, **fields})


def _measured(allocated_bytes: int, sharing: bool) -> ParamGatherResult:
    """A run's result with only what the memory part reads: numel, bytes, sharing."""
    return ParamGatherResult(steps=(), numel=7424, allocated_bytes=allocated_bytes, sharing=sharing,
                             shard_ranges=(), param_ranges=())


def test_memory_part_fails_when_the_allocation_is_not_shared():
    # Toy model at dp=2: numel 7424 (hand-derived in tests/fastgrad/test_mxfp8_sharing.py);
    # fp32 grads + bf16 params = 6 bytes per element without sharing, 4 with.
    honest_off = _measured(7424 * 6, sharing=False)
    honest_on = _measured(7424 * 4, sharing=True)
    rec = CheckRecorder("mxfp8")
    check_module.check_memory(rec, {(False, True): honest_off, (True, True): honest_on})
    assert rec.finish(0.0).passed
    # a "sharing" buffer that silently allocated param_data anyway
    rank0 = {(False, True): honest_off, (True, True): _measured(7424 * 6, sharing=True)}
    rec = CheckRecorder("mxfp8")
    check_module.check_memory(rec, rank0)
    failed = [e.label for e in rec.finish(0.0).expectations if not e.passed]
    assert any("measured bytes equal the expected allocation (fp32 grads, sharing=True)" in label for label in failed)
    assert any("saving equals" in label for label in failed)
    assert not any("sharing=False" in label for label in failed)

"""torch's DDP and FSDP2 as candidates: registered, their layouts torch's own, their checks'
verdicts (the documented behaviours held to refgrad's models, the known findings and only
those), and two bugs planted in torch's code paths that their checks must catch."""

from __future__ import annotations

import random

import pytest
import torch

from refgrad.layout import Layout
from tests.candidates.torch_faults import DDPHookWithoutDivision, FSDP2DividingTwice
from verify.candidates import CANDIDATES, Technique, Unsupported, candidate_named
from verify.candidates.interfaces import ReductionConfig
from verify.candidates.torch_ddp.candidate import TorchDDPCandidate
from verify.candidates.torch_ddp.findings import FINDINGS as DDP_FINDINGS
from verify.candidates.torch_fsdp2.candidate import TorchFSDP2Candidate
from verify.candidates.torch_fsdp2.findings import FINDINGS as FSDP2_FINDINGS
from verify.check import CheckContext
from verify.checks.layout import CHECK as LAYOUT
from verify.checks.layout.cases import ddp_layout_of, random_case
from verify.checks.optim import CHECK as OPTIM
from verify.checks.reduce_scatter import CHECK as REDUCE_SCATTER


@pytest.mark.parametrize("bucket_cap_mb", [None, 25, 1, 0.001, 0.5])
def test_bucket_caps_are_refgrads_and_torch_213s_config(monkeypatch, bucket_cap_mb):
    """The caps torch-ddp lays DDP's buckets out with are refgrad's hand-derived ones on every
    torch; where torch has 2.13's _BucketCapacityConfig they are its, also when it is taken
    away (the path earlier releases take)."""
    import torch.nn.parallel.distributed as ddp_module

    from refgrad.layout_torch import DDPBucketCaps
    from verify.candidates.torch_ddp.layout import bucket_caps

    hand = DDPBucketCaps.from_bucket_cap_mb(bucket_cap_mb).rebuild_limits()
    assert bucket_caps(bucket_cap_mb) == hand
    if not hasattr(ddp_module, "_BucketCapacityConfig"):
        return  # torch before 2.13: the fallback is what just ran
    own = ddp_module._BucketCapacityConfig.create(bucket_cap_mb, None, False)
    assert hand == (own.first_bucket_bytes_cap, own.bucket_bytes_cap)
    monkeypatch.delattr(ddp_module, "_BucketCapacityConfig")
    assert bucket_caps(bucket_cap_mb) == hand


def test_registered_with_the_techniques_they_lack():
    assert CANDIDATES["torch-ddp"] is TorchDDPCandidate
    assert CANDIDATES["torch-fsdp2"] is TorchFSDP2Candidate
    ddp, fsdp2 = candidate_named("torch-ddp"), candidate_named("torch-fsdp2")
    assert ddp.info().version == fsdp2.info().version == f"torch {torch.__version__}"
    for candidate, missing in ((ddp, {"deferred_wgrad", "pipeline", "optim", "mxfp8"}),
                               (fsdp2, {"deferred_wgrad", "pipeline", "mxfp8"})):
        assert {t for t, _ in candidate.info().unsupported} == missing
        for technique in missing:
            accessor = {"reduce_scatter": "grad_reduction", "optim": "optimizer"}.get(technique, technique)
            with pytest.raises(Unsupported, match=candidate.name):
                getattr(candidate, accessor)()
        assert Technique.LAYOUT.value not in missing


def test_ddp_layouts_are_torchs_bucket_assignment_as_refgrad_models_it():
    """``layouts`` (torch's ``_compute_bucket_assignment_by_size`` as the Reducer's rebuild
    calls it) equals refgrad's model on the layout check's random cases."""
    rng = random.Random(5)
    cases = [random_case(rng) for _ in range(200)]
    with TorchDDPCandidate().layout() as layout:
        got = layout.layouts(cases)
    for case, layout_got in zip(cases, got, strict=True):
        assert isinstance(layout_got, Layout)
        assert layout_got == ddp_layout_of(case), case


def test_refusals_name_the_configuration():
    with TorchDDPCandidate().grad_reduction() as ddp, TorchFSDP2Candidate().grad_reduction() as fsdp2:
        with pytest.raises(Unsupported, match="all-reduces every bucket"):
            ddp.bucket_reduction(ReductionConfig())
        with pytest.raises(Unsupported, match="fp16 or bf16"):
            ddp.reduce_in(ReductionConfig(use_distributed_optimizer=False), torch.float32)
        with pytest.raises(Unsupported, match="never pre-scales"):
            fsdp2.bucket_reduction(ReductionConfig())
        with pytest.raises(Unsupported, match="no fp32-accumulating reduce-scatter"):
            fsdp2.bucket_reduction(ReductionConfig(reduce_scatter_with_fp32_accumulation=True))


def _failed_cases(result):
    return {case.label: case for case in result.cases if not case.passed}


@pytest.mark.dist
def test_ddp_layout_check_fails_only_on_its_finding():
    """The watched DDP at W = 3 with gradient_as_bucket_view and grads zeroed in place divides
    instead of multiplying from the second iteration: torch-ddp-1, and nothing else fails."""
    result = LAYOUT.execute(CheckContext(quick=True), TorchDDPCandidate())
    assert result.error is None, result.error
    failed = _failed_cases(result)
    assert list(failed) and all(case.finding == DDP_FINDINGS[0].key for case in failed.values())
    labels = result.failed_labels()
    assert labels and all("iteration 1" not in label and "reduced on rank" in label for label in labels)
    assert any(d.behaviour.startswith("buckets sized in bytes") for d in result.differences)


@pytest.mark.dist
def test_ddp_reduce_scatter_check_passes_with_its_hooks_documented():
    result = REDUCE_SCATTER.execute(CheckContext(quick=True), TorchDDPCandidate())
    assert result.error is None, result.error
    assert result.passed, result.failed_labels()
    hooks = [c for c in result.comparisons if "reduced in" in c.label and c.label.startswith("DDP bucket")]
    assert {c.label.split("reduced in ")[1].split(" ")[0] for c in hooks} == {"float16", "bfloat16"}
    assert all("documented: fp16/bf16_compress_hook" in c.label for c in hooks)
    assert any("_compress_hook" in d.where for d in result.differences)


@pytest.mark.dist
def test_ddp_compress_hook_without_its_division_fails():
    """The planted bug: torch's compress hook with the division by the world size skipped."""
    result = REDUCE_SCATTER.execute(CheckContext(quick=True), DDPHookWithoutDivision())
    assert result.error is None, result.error
    failed = result.failed_labels()
    assert failed and all("reduced in" in label for label in failed), failed
    for wire in ("float16", "bfloat16"):
        assert any(f"reduced in {wire}" in label for label in failed), (wire, failed)
    assert not _failed_cases(result) or all(c.finding is None for c in _failed_cases(result).values())


@pytest.mark.dist
def test_fsdp2_layout_and_reduce_scatter_checks_pass_documented():
    layout = LAYOUT.execute(CheckContext(quick=True), TorchFSDP2Candidate())
    assert layout.error is None and layout.passed, (layout.error, layout.failed_labels())
    assert any("sharded one by one" in d.label for d in layout.differences)
    result = REDUCE_SCATTER.execute(CheckContext(quick=True), TorchFSDP2Candidate())
    assert result.error is None, result.error
    assert result.passed, result.failed_labels()
    sharded = [c for c in result.comparisons if "sharded parameters" in c.label]
    for reduce in ("reduce_dtype float32", "reduce_dtype bfloat16", "reduce_dtype float16",
                   "reduce_dtype none"):
        assert any(reduce in c.label for c in sharded), reduce


@pytest.mark.dist
def test_fsdp2_reduce_scatter_dividing_twice_fails():
    """The planted bug: FSDP2's reduce-scatter output divided by the world size once more."""
    result = REDUCE_SCATTER.execute(CheckContext(quick=True), FSDP2DividingTwice())
    assert result.error is None, result.error
    failed = result.failed_labels()
    assert any("sharded parameters" in label for label in failed), failed
    assert any(label.startswith("DDP bucket reduction W=3 reduce-scatter, AVG in the collective")
               for label in failed), failed


@pytest.mark.dist
def test_fsdp2_optim_check_fails_only_on_its_finding():
    """torch.optim.AdamW / SGD and clip_grad_norm_'s parts on FSDP2's shards match refgrad's
    models bitwise (the norm within its bound); the DP sum at DP 3 crashes on gloo:
    torch-fsdp2-1, the only failure."""
    result = OPTIM.execute(CheckContext(quick=True), TorchFSDP2Candidate())
    assert result.error is None, result.error
    failed = _failed_cases(result)
    assert list(failed) and all(case.finding == FSDP2_FINDINGS[0].key for case in failed.values())
    assert all(crash.exception == "RuntimeError" and "PREMUL_SUM" in crash.message
               for crash in result.crashes)
    assert not [c.label for c in result.comparisons if not c.passed]
    behaviours = {d.behaviour for d in result.differences}
    assert any("torch.optim.AdamW's order" in b for b in behaviours)
    assert any("clip coefficient" in b for b in behaviours)

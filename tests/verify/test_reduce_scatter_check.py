"""The reduce_scatter check passes on fastgrad and fails on broken candidates, each reached
through the seam (``candidate.grad_reduction()``): a wire-accumulating local sum, local sums
that take the ranks rotated or reversed, an AVG pre-scaled in the grad dtype, and a DDP bucket
that averages otherwise than the pre-scale it documents."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from fastgrad.reduce_scatter import reduce_scatter_with_fp32_accumulation, reduce_shards_fp32
from gradvocab import Averaging
from verify.candidates import FastgradCandidate
from verify.candidates.fastgrad.grad_reduction import (
    FastgradBucketReduction,
    FastgradGradReduction,
    FastgradLocalReduction,
)
from verify.candidates.interfaces import (
    AVG,
    SUM,
    BucketReduction,
    LocalReduction,
    ReduceScatter,
    ReductionConfig,
    ScratchReduceScatter,
)
from verify.check import CheckContext, CheckRecorder
from verify.checks import CHECK_MODULES, check_by_name
from verify.checks.reduce_scatter import CHECK, compare_local_reduction_on
from verify.checks.reduce_scatter.cases import spec_averaging


class _Done:
    def wait(self) -> bool:
        return True


@dataclass(frozen=True)
class WireSum(LocalReduction):
    """A plausible bug: the local sum stays in the 16-bit dtype."""

    def __call__(self, shards, output, *, op):
        acc = shards[0].clone()
        for row in shards[1:]:
            acc += row
        output.copy_(acc / shards.shape[0] if op == AVG else acc)


@dataclass(frozen=True)
class RotatedSum(LocalReduction):
    """A plausible bug: fp32 accumulation starting at rank 1 (rank 0 added last)."""

    def __call__(self, shards, output, *, op):
        FastgradLocalReduction()(torch.roll(shards, -1, dims=0), output, op=op)


@dataclass(frozen=True)
class ReversedSum(LocalReduction):
    """A plausible bug: fp32 accumulation from rank W-1 down to rank 0."""

    def __call__(self, shards, output, *, op):
        FastgradLocalReduction()(torch.flip(shards, dims=(0,)), output, op=op)


@dataclass(frozen=True)
class PrescaledLocalAverage(LocalReduction):
    """Production's AVG in the local reduction: every row * 1/W in the 16-bit dtype, then the sum."""

    def __call__(self, shards, output, *, op):
        reduce_shards_fp32(shards, output, op=Averaging.SUM,
                           prescale=1.0 / shards.shape[0] if op == AVG else None)


@dataclass(frozen=True)
class AllToAllThen(ReduceScatter):
    """fastgrad's all-to-all followed by ``local``."""

    local: LocalReduction

    def __call__(self, output, input, *, group, op, async_op=False):  # noqa: A002
        gathered = torch.empty_like(input)
        dist.all_to_all_single(gathered, input, group=group)
        self.local(gathered.view(dist.get_world_size(group), -1), output, op=op)
        return _Done() if async_op else None


@dataclass(frozen=True)
class AllToAllThenScratch(ScratchReduceScatter):
    """:class:`AllToAllThen` through the caller's scratch."""

    local: LocalReduction

    def __call__(self, output, input, scratch, *, group, op, async_op=False):  # noqa: A002
        dist.all_to_all_single(scratch, input, group=group)
        self.local(scratch.view(dist.get_world_size(group), -1), output, op=op)
        return _Done() if async_op else None


@dataclass(frozen=True)
class PrescaledAverage(ReduceScatter):
    """Production's AVG: every grad *= 1/W in its 16-bit dtype, then the fp32-accumulating sum."""

    def __call__(self, output, input, *, group, op, async_op=False):  # noqa: A002
        prescale = 1.0 / dist.get_world_size(group) if op == AVG else None
        return reduce_scatter_with_fp32_accumulation(output, input, group=group, async_op=async_op,
                                                     op=SUM, prescale=prescale)


@dataclass(frozen=True)
class PrescaledAverageScratch(ScratchReduceScatter):
    def __call__(self, output, input, scratch, *, group, op, async_op=False):  # noqa: A002
        prescale = 1.0 / dist.get_world_size(group) if op == AVG else None
        return reduce_scatter_with_fp32_accumulation(output, input, group=group, async_op=async_op,
                                                     scratch=scratch, op=SUM, prescale=prescale)


@dataclass(frozen=True)
class AveragesInFp32InsteadOfPrescale(FastgradBucketReduction):
    """A bucket with fp32 accumulation that claims production's pre-scale (fastgrad documents
    it) but divides the fp32 sum by W instead: the spec's numbers, not the documented
    behaviour's."""

    def __call__(self, grads, *, group):
        config = self.config
        if (config.reduce_scatter_with_fp32_accumulation
                and config.averaging is Averaging.PRESCALE):
            config = ReductionConfig(averaging=Averaging.AVG,
                                     reduce_scatter_with_fp32_accumulation=True)
        return FastgradBucketReduction(config)(grads, group=group)


@dataclass(frozen=True)
class BrokenReduction(FastgradGradReduction):
    """fastgrad's reduction with some of its collectives replaced (None: fastgrad's own)."""

    collective: ReduceScatter | None = None
    scratch: ScratchReduceScatter | None = None
    local: LocalReduction | None = None
    bucket_cls: type[BucketReduction] | None = None

    def reduce_scatter(self, op=SUM):
        return self.collective or super().reduce_scatter(op)

    def scratch_reduce_scatter(self, op=SUM):
        return self.scratch or super().scratch_reduce_scatter(op)

    def local_reduction(self, op=SUM):
        return self.local or super().local_reduction(op)

    def bucket_reduction(self, config):
        return (self.bucket_cls or FastgradBucketReduction)(config)


@dataclass(frozen=True)
class BrokenCandidate(FastgradCandidate):
    """fastgrad whose grad reduction is ``reduction``."""

    reduction: BrokenReduction = BrokenReduction()

    def grad_reduction(self) -> BrokenReduction:
        return self.reduction


def broken_candidate(local: LocalReduction) -> BrokenCandidate:
    return BrokenCandidate(reduction=BrokenReduction(
        collective=AllToAllThen(local), scratch=AllToAllThenScratch(local), local=local))


def test_a_configs_spec_averaging_is_the_exact_mean_however_the_candidate_averages():
    # By hand: any averaging is held to the spec's fp32 sum / W (AVG); no averaging to the sum.
    assert spec_averaging(ReductionConfig(averaging=Averaging.SUM)) is Averaging.SUM
    assert ReductionConfig().averaging is Averaging.PRESCALE
    assert spec_averaging(ReductionConfig()) is Averaging.AVG
    assert spec_averaging(ReductionConfig(averaging=Averaging.AVG)) is Averaging.AVG


@pytest.mark.dist
def test_check_passes_on_fastgrad():
    assert "reduce_scatter" in CHECK_MODULES
    assert check_by_name("reduce_scatter") is CHECK
    result = CHECK.execute(CheckContext(quick=True))
    assert result.error is None, result.error
    assert result.passed, result.failed_labels()
    assert result.candidate == "fastgrad"
    assert len(result.comparisons) > 50
    assert result.tables and result.notes
    labels = [c.label for c in result.comparisons]
    for size in (3, 4, 5, 8):
        assert any(label.startswith("order-sensitive local reduction") and f"W={size} " in label
                   for label in labels)
    assert any(label.startswith("order-sensitive reduce-scatter") and "W=3 " in label
               for label in labels)
    averaged = {label.split(": ")[1].split(" ")[0] for label in labels
                if label.startswith("average-sensitive AVG")}
    assert averaged == {"W=3", "W=5"}  # quick mode; W=6 too in the full check
    for mode in ("sync", "async", "scratch", "in_place"):
        assert any(label.endswith(f"op=avg {mode}") for label in labels), mode
    # fastgrad's DDP averages by production's pre-scale (documented); AVG in the
    # collective with fp32 accumulation is the spec itself
    buckets = [c for c in result.comparisons if c.label.startswith("DDP bucket reduction")]
    assert any("W=3 fp32-accumulating reduce-scatter, AVG in the collective vs" in c.label
               and "documented" not in c.label for c in buckets)
    prescaled = {d.label for d in result.differences
                 if d.label.startswith("DDP bucket reduction W=3 fp32-accumulating reduce-scatter, "
                                       "pre-scale 1/W")}
    assert prescaled and all("fastgrad.averaging" in d.where for d in result.differences
                             if d.label in prescaled)


@pytest.mark.dist
def test_check_fails_on_wire_accumulation():
    result = CHECK.execute(CheckContext(quick=True), broken_candidate(WireSum()))
    assert result.error is None, result.error
    assert not result.passed
    failed = [c.label for c in result.comparisons if not c.passed]
    # With 3 ranks the 16-bit partial sum is rounded twice, which the inputs' ties expose.
    assert any("W=3" in label and label.startswith("fastgrad vs refgrad") for label in failed), failed


@pytest.mark.dist
@pytest.mark.parametrize("local", [RotatedSum(), ReversedSum()], ids=["rotated", "reversed"])
def test_check_fails_on_another_summation_order(local):
    # fp32 accumulation, one rounding: only the order of the ranks differs. The check's
    # order-sensitive inputs catch it itself, in the collective and in the local reduction,
    # at every W >= 3 (at W=2 both orders are the same commutative addition).
    result = CHECK.execute(CheckContext(quick=True), broken_candidate(local))
    assert result.error is None, result.error
    assert not result.passed
    failed = result.failed_labels()
    assert not any(label.startswith("order-sensitive inputs") for label in failed), failed
    assert any(label.startswith("order-sensitive reduce-scatter") and "W=3 " in label
               for label in failed), failed
    for size in (3, 4, 5, 8):
        assert any(label.startswith("order-sensitive local reduction") and f"W={size} " in label
                   for label in failed), (size, failed)


def test_local_reduction_comparison_logic_on_cpu():
    # The CUDA section's comparison, run on the CPU path: passes for fastgrad...
    rec = CheckRecorder("local")
    compare_local_reduction_on("cpu", rec, torch.Generator().manual_seed(1), ((3, 67),),
                               FastgradGradReduction())
    result = rec.finish(0.0)
    assert result.passed and len(result.comparisons) == 4


def test_local_reduction_comparison_catches_wire_accumulation():
    # ...and fails for a reduction that accumulates in the 16-bit dtype.
    rec = CheckRecorder("local")
    compare_local_reduction_on("cpu", rec, torch.Generator().manual_seed(1), ((8, 257),),
                               BrokenReduction(local=WireSum()))
    assert not rec.finish(0.0).passed


@pytest.mark.dist
def test_check_fails_on_an_average_prescaled_in_the_grad_dtype():
    """Production's way of averaging (grad *= 1/W in bf16/fp16 before an fp32 sum) differs
    from one rounding of the fp32 sum / W: the average-sensitive inputs at W = 3 and 5
    (1/W inexact) make it differ on most elements, not on one in a few hundred."""
    candidate = BrokenCandidate(reduction=BrokenReduction(
        collective=PrescaledAverage(), scratch=PrescaledAverageScratch(),
        local=PrescaledLocalAverage()))
    result = CHECK.execute(CheckContext(quick=True), candidate)
    assert result.error is None, result.error
    assert not result.passed
    failed = {c.label: c for c in result.comparisons if not c.passed}
    assert not any(e.label.startswith("average-sensitive inputs") and not e.passed
                   for e in result.expectations)
    for size in (3, 5):
        for dtype in ("float16", "bfloat16"):
            hits = [c for label, c in failed.items()
                    if label.startswith(f"average-sensitive AVG vs refgrad fp32 sum / W: W={size} "
                                        f"{dtype}")]
            assert len(hits) == 4, (size, dtype, sorted(failed))  # 2 iterations x sync/async
            for comparison in hits:  # most elements, not one
                assert 2 * comparison.metrics["n_mismatch"] > comparison.metrics["n"], comparison


@pytest.mark.dist
def test_a_bucket_that_does_not_average_as_it_documents_fails():
    """The bucket cases hold a candidate to refgrad's model of the behaviour it documents: a
    DDP that says it pre-scales (as fastgrad does) but divides the fp32 sum fails there, in
    the fp32-accumulating pre-scaled cases only (at W = 2 too: fp16's 1/2 pre-scale rounds
    subnormals)."""
    candidate = BrokenCandidate(reduction=BrokenReduction(
        bucket_cls=AveragesInFp32InsteadOfPrescale))
    result = CHECK.execute(CheckContext(quick=True), candidate)
    assert result.error is None, result.error
    failed = result.failed_labels()
    assert failed and all(label.startswith("DDP bucket reduction W=")
                          and "fp32-accumulating reduce-scatter, pre-scale 1/W" in label
                          and "(documented: the DP mean is every rank's grads multiplied by 1/W"
                          in label for label in failed), failed
    for size in (3, 5):
        assert any(f"W={size} fp32-accumulating reduce-scatter, pre-scale 1/W average-sensitive"
                   in label for label in failed), (size, failed)

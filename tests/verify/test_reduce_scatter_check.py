"""The reduce_scatter check passes on fastgrad and fails on broken candidates: a
wire-accumulating one, and local reductions that sum the ranks rotated or reversed."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from fastgrad.reduce_scatter import (
    AVG,
    SUM,
    reduce_scatter_with_fp32_accumulation,
    reduce_shards_fp32,
)
from verify.check import CheckContext, CheckRecorder
from verify.checks import CHECK_MODULES, check_by_name
from verify.checks.reduce_scatter import CHECK, ReduceScatterCandidate, compare_local_reduction_on


class _Done:
    def wait(self) -> bool:
        return True


def wire_sum(shards, out, *, average):
    """A plausible bug: the local sum stays in the 16-bit dtype."""
    acc = shards[0].clone()
    for row in shards[1:]:
        acc += row
    out.copy_(acc / shards.shape[0] if average else acc)


def rotated_sum(shards, out, *, average):
    """A plausible bug: fp32 accumulation starting at rank 1 (rank 0 added last)."""
    reduce_shards_fp32(torch.roll(shards, -1, dims=0), out, average=average)


def reversed_sum(shards, out, *, average):
    """A plausible bug: fp32 accumulation from rank W-1 down to rank 0."""
    reduce_shards_fp32(torch.flip(shards, dims=(0,)), out, average=average)


def all_to_all_then(local_reduction, output, input, *, group=None, async_op=False,  # noqa: A002
                    scratch=None, op=SUM):
    """fastgrad's all-to-all followed by ``local_reduction`` (picklable via functools.partial)."""
    world_size = dist.get_world_size(group)
    gathered = torch.empty_like(input)
    dist.all_to_all_single(gathered, input, group=group)
    local_reduction(gathered.view(world_size, -1), output, average=op == AVG)
    return _Done() if async_op else None


def prescaled_average(output, input, *, group=None, async_op=False, scratch=None,  # noqa: A002
                      op=SUM):
    """Production's AVG: every grad *= 1/W in its 16-bit dtype, then the fp32-accumulating sum."""
    prescale = 1.0 / dist.get_world_size(group) if op == AVG else None
    return reduce_scatter_with_fp32_accumulation(output, input, group=group, async_op=async_op,
                                                 scratch=scratch, op=SUM, prescale=prescale)


def prescaled_local_average(shards, out, *, average):
    """The same pre-scale in the local reduction."""
    reduce_shards_fp32(shards, out, average=False,
                       prescale=1.0 / shards.shape[0] if average else None)


def broken_candidate(local_reduction) -> ReduceScatterCandidate:
    return ReduceScatterCandidate(reduce_scatter=functools.partial(all_to_all_then, local_reduction),
                                  local_reduction=local_reduction)



@pytest.mark.dist
def test_check_passes_on_fastgrad():
    assert "reduce_scatter" in CHECK_MODULES
    assert check_by_name("reduce_scatter") is CHECK
    result = CHECK.execute(CheckContext(quick=True))
    assert result.error is None, result.error
    assert result.passed, result.failed_labels()
    assert len(result.comparisons) > 50
    assert result.tables and result.findings
    labels = [c.label for c in result.comparisons]
    for size in (3, 4, 5, 8):
        assert any(label.startswith("order-sensitive local reduction") and f"W={size} " in label
                   for label in labels)
    assert any(label.startswith("order-sensitive reduce-scatter") and "W=3 " in label
               for label in labels)
    averaged = {label.split(": ")[1].split(" ")[0] for label in labels
                if label.startswith("average-sensitive AVG")}
    assert averaged == {"W=3", "W=5"}  # quick mode; W=6 too in the full check


@pytest.mark.dist
def test_check_fails_on_wire_accumulation():
    result = CHECK.execute(CheckContext(quick=True), broken_candidate(wire_sum))
    assert result.error is None, result.error
    assert not result.passed
    failed = [c.label for c in result.comparisons if not c.passed]
    # With 3 ranks the 16-bit partial sum is rounded twice, which the inputs' ties expose.
    assert any("W=3" in label and label.startswith("fastgrad vs refgrad") for label in failed), failed


@pytest.mark.dist
@pytest.mark.parametrize("local_reduction", [rotated_sum, reversed_sum])
def test_check_fails_on_another_summation_order(local_reduction):
    # fp32 accumulation, one rounding: only the order of the ranks differs. The check's
    # order-sensitive inputs catch it itself, in the collective and in the local reduction,
    # at every W >= 3 (at W=2 both orders are the same commutative addition).
    result = CHECK.execute(CheckContext(quick=True), broken_candidate(local_reduction))
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
    compare_local_reduction_on("cpu", rec, torch.Generator().manual_seed(1), ((3, 67),))
    result = rec.finish(0.0)
    assert result.passed and len(result.comparisons) == 4


def test_local_reduction_comparison_catches_wire_accumulation():
    # ...and fails for a reduction that accumulates in the 16-bit dtype.
    rec = CheckRecorder("local")
    compare_local_reduction_on("cpu", rec, torch.Generator().manual_seed(1), ((8, 257),),
                               ReduceScatterCandidate(local_reduction=wire_sum))
    assert not rec.finish(0.0).passed


@pytest.mark.dist
def test_check_fails_on_an_average_prescaled_in_the_grad_dtype():
    """Production's way of averaging (grad *= 1/W in bf16/fp16 before an fp32 sum) differs
    from one rounding of the fp32 sum / W: the average-sensitive inputs at W = 3 and 5
    (1/W inexact) make it differ on most elements, not on one in a few hundred."""
    candidate = ReduceScatterCandidate(reduce_scatter=prescaled_average,
                                       local_reduction=prescaled_local_average)
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

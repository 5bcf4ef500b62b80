"""The reduce_scatter check passes on fastgrad and fails on broken candidates: a
wire-accumulating one, and local reductions that sum the ranks rotated or reversed."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from fastgrad.reduce_scatter import AVG, SUM, reduce_shards_fp32
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

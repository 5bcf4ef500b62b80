"""The reduce_scatter check passes on fastgrad and fails on a wire-accumulating candidate."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fastgrad.reduce_scatter import AVG, SUM
from verify.check import Check, CheckContext, CheckRecorder
from verify.checks import CHECK_MODULES, check_by_name
from verify.checks.reduce_scatter import CHECK, check_multi_rank


class _Done:
    def wait(self) -> bool:
        return True


def wire_accumulating_candidate(output, input, *, group=None, async_op=False, scratch=None,  # noqa: A002
                                op=SUM):
    """A plausible bug: the same all-to-all, but the local sum stays in the 16-bit dtype."""
    world_size = dist.get_world_size(group)
    gathered = torch.empty_like(input)
    dist.all_to_all_single(gathered, input, group=group)
    shards = gathered.view(world_size, -1)
    total = shards[0].clone()
    for rank in range(1, world_size):
        total += shards[rank]
    if op == AVG:
        total /= world_size
    output.copy_(total)
    return _Done() if async_op else None


@pytest.mark.dist
def test_check_passes_on_fastgrad():
    assert "reduce_scatter" in CHECK_MODULES
    assert check_by_name("reduce_scatter") is CHECK
    result = CHECK.execute(CheckContext(quick=True))
    assert result.error is None, result.error
    failed = [c.label for c in result.comparisons if not c.passed]
    failed += [e.label for e in result.expectations if not e.passed]
    assert result.passed, failed
    assert len(result.comparisons) > 50
    assert result.tables and result.findings


@pytest.mark.dist
def test_check_fails_on_wire_accumulation():
    broken = Check("reduce_scatter", "broken candidate",
                   lambda ctx, rec: check_multi_rank(ctx, rec, wire_accumulating_candidate))
    result = broken.execute(CheckContext(quick=True))
    assert result.error is None, result.error
    assert not result.passed
    failed = [c.label for c in result.comparisons if not c.passed]
    # With 3 ranks the 16-bit partial sum is rounded twice, which the inputs' ties expose.
    assert any("W=3" in label for label in failed), failed


def test_local_reduction_comparison_logic_on_cpu():
    # The CUDA section's comparison, run on the CPU path: passes for fastgrad...
    from verify.checks.reduce_scatter import compare_local_reduction_on

    rec = CheckRecorder("local")
    compare_local_reduction_on("cpu", rec, torch.Generator().manual_seed(1), ((3, 67),))
    result = rec.finish(0.0)
    assert result.passed and len(result.comparisons) == 4


def test_local_reduction_comparison_catches_wire_accumulation():
    # ...and fails for a reduction that accumulates in the 16-bit dtype.
    from verify.checks.reduce_scatter import compare_local_reduction_on

    def wire_sum(shards, out, *, average):
        acc = shards[0].clone()
        for row in shards[1:]:
            acc += row
        out.copy_(acc / shards.shape[0] if average else acc)

    rec = CheckRecorder("local")
    compare_local_reduction_on("cpu", rec, torch.Generator().manual_seed(1), ((8, 257),), wire_sum)
    assert not rec.finish(0.0).passed

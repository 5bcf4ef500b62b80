"""fastgrad.comm: the reduce-scatter through a caller-kept scratch on gloo.

gloo's reduce-scatter clones its input, all-reduces the clone and copies this rank's chunk
(torch 2.13, ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``); ``scratch=`` does the
same in a buffer the caller keeps. Both are held bitwise to refgrad's model of gloo's
collective (``accumulate="wire"``, ``order="ring_reverse"``: the order the reduce_scatter
check's bucket cases model), at W=3 where the order shows, on rank-specific inputs, two
iterations through the same scratch.
"""

from __future__ import annotations

import pytest
import torch
from distributed_utils import run_distributed

from fastgrad.buffer import ParamAndGradBuffer
from fastgrad.comm import ChunkCopyWork, reduce_scatter_into
from gradvocab import Averaging, DDPConfig
from refgrad import reduce_scatter as refc
from verify.metrics import assert_bitwise_equal, bitwise_equal

SHARD = 32
OPS = {averaging: averaging.reduce_op for averaging in (Averaging.SUM, Averaging.AVG)}
DTYPES = (torch.float32, torch.bfloat16)


def _input(rank: int, world: int, it: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank-specific values over a wide exponent range (the summation order shows)."""
    g = torch.Generator().manual_seed(1000 * it + 10 * rank + DTYPES.index(dtype))
    n = world * SHARD
    return (torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g))).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _worker(rank: int, world: int) -> dict:
    out = {}
    for dtype in DTYPES:
        scratch = torch.empty(world * SHARD, dtype=dtype)
        for it in range(2):
            full = _input(rank, world, it, dtype)
            before = full.clone()
            for name, op in OPS.items():
                plain = torch.full((SHARD,), 7.0, dtype=dtype)
                reduce_scatter_into(plain, full, op=op)
                kept = torch.full((SHARD,), 7.0, dtype=dtype)
                work = reduce_scatter_into(kept, full, op=op, async_op=True, scratch=scratch)
                untouched = bool((kept == 7.0).all())  # written by wait(), not before
                work.wait()
                out[(str(dtype), it, name)] = {
                    "input": full.clone(), "plain": plain, "scratch": kept,
                    "async_handle": isinstance(work, ChunkCopyWork), "untouched": untouched,
                }
            out[(str(dtype), it, "input kept")] = bitwise_equal(full, before)
    errors = {}
    full, shard = torch.zeros(world * SHARD), torch.zeros(SHARD)
    for label, bad in {"numel": torch.empty(SHARD), "dtype": torch.empty(world * SHARD, dtype=torch.bfloat16),
                       "overlap": full}.items():
        try:
            reduce_scatter_into(shard, full, scratch=bad)
            errors[label] = "accepted"
        except ValueError as exc:
            errors[label] = str(exc)
    out["errors"] = errors
    return out


def _bucket_worker(rank: int, world: int) -> list[dict]:
    """A distributed-optimizer bucket averaged by a 1/W pre-scale, reduced twice."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (37, 50)]
    buffer = ParamAndGradBuffer(params, config=DDPConfig(use_distributed_optimizer=True),
                                averaging=Averaging.PRESCALE)
    (bucket,) = buffer.buckets
    steps = []
    for it in range(2):
        g = torch.Generator().manual_seed(77 + 10 * it + rank)
        bucket.grad_data.copy_(torch.randn(bucket.numel, generator=g)
                               * torch.exp2(torch.randint(-20, 20, (bucket.numel,), generator=g)))
        local = bucket.grad_data.clone()
        bucket.start_grad_sync()
        bucket.finish_grad_sync()
        steps.append({"local": local, "after": bucket.grad_data.clone(),
                      "range": bucket.local_shard_range, "scratch": bucket.collective_scratch()})
    steps[1]["same scratch"] = steps[1].pop("scratch") is steps[0]["scratch"]
    steps[0]["scratch"] = steps[0]["scratch"] is not None
    return steps


@pytest.mark.dist
def test_reduce_scatter_through_a_kept_scratch_is_gloos_collective_bit_for_bit():
    world = 3
    ranks = run_distributed(_worker, world)
    for dtype in DTYPES:
        for it in range(2):
            for name in OPS:
                records = [ranks[r][(str(dtype), it, name)] for r in range(world)]
                want = refc.reduce_scatter([rec["input"] for rec in records], accumulate="wire",
                                           order="ring_reverse", op=name)
                for rank, rec in enumerate(records):
                    label = (dtype, it, name, rank)
                    assert_bitwise_equal(_bits(rec["plain"]), _bits(want[rank]), msg=str(label))
                    assert_bitwise_equal(_bits(rec["scratch"]), _bits(want[rank]), msg=str(label))
                    assert rec["async_handle"] and rec["untouched"], label
            assert all(ranks[r][(str(dtype), it, "input kept")] for r in range(world))
    errors = ranks[0]["errors"]
    assert "scratch must match full" in errors["numel"] and "elements" in errors["numel"]
    assert "scratch must match full" in errors["dtype"]
    assert "scratch must not overlap full" in errors["overlap"]


@pytest.mark.dist
def test_a_gloo_bucket_keeps_its_scratch_and_the_collectives_bits():
    """The bucket's shard is refgrad's gloo model of the pre-scaled sum; the rest of the
    bucket keeps this rank's pre-scaled grads (production's reduce-scatter leaves them)."""
    world = 3
    ranks = run_distributed(_bucket_worker, world)
    for it in range(2):
        steps = [ranks[r][it] for r in range(world)]
        prescaled = refc.prescale_like_torch([s["local"] for s in steps], 1.0 / world)
        reduced = torch.cat(refc.reduce_scatter(prescaled, accumulate="wire",
                                                order="ring_reverse", op=Averaging.SUM))
        for rank, step in enumerate(steps):
            lo, hi = step["range"]
            want = prescaled[rank].clone()
            want[lo:hi] = reduced[lo:hi]
            assert_bitwise_equal(_bits(step["after"]), _bits(want), msg=str((it, rank)))
    assert all(ranks[r][0]["scratch"] and ranks[r][1]["same scratch"] for r in range(world))

"""DistributedOptimizer driving MXFP8 params on dp=2 gloo ranks: bitwise equal to refgrad.

Each rank feeds rank-specific grads through ``MXFP8ParamGradBuffer.accumulate_grad``
(MXFP8 params are not autograd leaves), reduces, and steps; the optimizer
stages the masters as bf16, all-gathers and quantizes into the MXFP8 params.
Expected values: ``refgrad.optim.optimizer_step`` on the reduced grads (both
ranks' shards, joined), then ``refgrad.mxfp8.quantize`` of the masters rounded
to bf16 by ``refgrad.formats``. Sharing on and off must give the same bits.
The training and refgrad helpers live in ``verify.checks.optim.mxfp8`` (the
``optim`` check runs them too).
"""

from __future__ import annotations

import pytest
import torch

from fastgrad.mxfp8_sharing import MXFP8Parameter, MXFP8ParamGradBuffer
from fastgrad.optim import AdamWConfig, DistributedOptimizer
from gradvocab import LifecycleError
from tests.distributed_utils import run_distributed
from verify.candidates.fastgrad.optimizer import FastgradOptimizer
from verify.checks.optim.mxfp8 import CONFIGS, SHAPES, STEPS, joined_masters, refgrad_trajectory
from verify.checks.optim.mxfp8 import train_mxfp8 as _train
from verify.fixtures.mxfp8 import toy_config
from verify.metrics import assert_bitwise_equal, bitwise_equal


def worker(rank: int, world: int) -> dict:
    mxfp8 = FastgradOptimizer().mxfp8()
    return {(kind, sharing, grad_fp32): _train(mxfp8, rank, kind, sharing, grad_fp32)
            for kind in CONFIGS for sharing in (False, True) for grad_fp32 in (True, False)}


def _check_against_refgrad(runs: list[dict], kind: str) -> None:
    want = refgrad_trajectory(runs, kind)
    for k in range(len(SHAPES)):
        for run in runs:
            assert_bitwise_equal(want["bits0"][k][1], run["bits0"][k][1])
    for step in range(STEPS):
        assert want["steps"][step]["stepped"]
        masters = joined_masters(runs, step)
        for k, (a, b) in enumerate(runs[0]["param_ranges"]):
            assert_bitwise_equal(masters[a:b], want["steps"][step]["masters"][k], msg=str((kind, step, k)))
            scales, elements = want["steps"][step]["bits"][k]
            for rank, run in enumerate(runs):
                got_scales, got_elements = run["steps"][step]["bits"][k]
                assert_bitwise_equal(scales, got_scales, msg=str((kind, step, k, rank)))
                assert_bitwise_equal(elements, got_elements, msg=str((kind, step, k, rank)))


@pytest.mark.dist
def test_dp2_mxfp8_params_bitwise_vs_refgrad_and_sharing_parity():
    results = run_distributed(worker, 2)
    for key in results[0]:
        kind, sharing, grad_fp32 = key
        runs = [r[key] for r in results]
        assert all(run["sharing"] == sharing for run in runs)
        assert all(s["stepped"] for run in runs for s in run["steps"])
        # rank-specific data: the ranks' local grads differ
        assert not bitwise_equal(runs[0]["steps"][0]["grads"][0], runs[1]["steps"][0]["grads"][0])
        if sharing:
            for rank in range(2):
                off = results[rank][(kind, False, grad_fp32)]["steps"]
                for a, b in zip(off, runs[rank]["steps"]):
                    assert all(bitwise_equal(x, y) for x, y in zip(a["grads"] + a["masters"], b["grads"] + b["masters"]))
                    assert all(bitwise_equal(x, y) for p, q in zip(a["bits"], b["bits"]) for x, y in zip(p, q))
        _check_against_refgrad(runs, kind)
        # training moved the params
        assert not bitwise_equal(runs[0]["bits0"][0][1], runs[0]["steps"][-1]["bits"][0][1])


def _one_rank(sharing: bool):
    init = torch.Generator().manual_seed(3)
    weights = [MXFP8Parameter(torch.randn(s, generator=init)) for s in SHAPES]
    buffer = MXFP8ParamGradBuffer(weights, config=toy_config(sharing=sharing, grad_fp32=True))
    return weights, buffer, DistributedOptimizer(buffer, AdamWConfig(lr=1e-2))


def test_capability_flag_and_lifecycle_guard_through_the_optimizer():
    assert DistributedOptimizer.supports_mxfp8 is True
    weights, buffer, opt = _one_rank(sharing=True)
    with pytest.raises(LifecycleError, match="grad sync of bucket"):
        opt.step()  # no reduce_grads yet
    buffer.zero_grad()
    for w in weights:
        buffer.accumulate_grad(w, torch.ones(w.shape))
    with pytest.raises(LifecycleError, match="overwrite grads"):
        opt.publish_params()  # staging would wipe the unconsumed grads (shared bytes)
    buffer.reduce_grads()
    assert opt.step().stepped
    # step() quantized the params, then zeroed every bucket's param bytes (the first half
    # of the fp32 grad bytes); zero_grad clears the rest before the next accumulation
    assert bool(buffer.param_data.eq(0).all())
    with pytest.raises(LifecycleError, match="zeroed"):
        buffer.gathered_param(weights[0])
    with pytest.raises(LifecycleError, match="forced param sync"):
        buffer.gather_all_params(force_sync=True)
    with pytest.raises(LifecycleError, match="accumulate_grad after reduce_grads"):
        buffer.reduce_grads()
        buffer.accumulate_grad(weights[0], torch.ones(weights[0].shape))


def test_checkpoint_round_trip_republishes_the_mxfp8_params():
    weights, buffer, opt = _one_rank(sharing=True)
    buffer.zero_grad()
    for k, w in enumerate(weights):
        buffer.accumulate_grad(w, torch.full(w.shape, 0.25 * (k + 1)))
    buffer.reduce_grads()
    opt.step()
    state = opt.named_state_dict()
    assert sorted(state["params"]) == [f"params[{i}]" for i in range(len(SHAPES))]
    fresh_weights, _, fresh = _one_rank(sharing=False)  # other init, separate buffers
    fresh.load_state_dict(state)
    for a, b in zip(weights, fresh_weights):
        assert_bitwise_equal(a.scale_bits, b.scale_bits)
        assert_bitwise_equal(a.element_bits, b.element_bits)
    assert all(bitwise_equal(x, y) for x, y in zip(opt.master_shards(), fresh.master_shards()))

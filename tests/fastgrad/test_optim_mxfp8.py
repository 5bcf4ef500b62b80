"""DistributedOptimizer driving MXFP8 params on dp=2 gloo ranks: bitwise equal to refgrad.

Each rank feeds rank-specific grads through ``MXFP8ParamGradBuffer.accumulate_grad``
(MXFP8 params are not autograd leaves), reduces, and steps; the optimizer
stages the masters as bf16, all-gathers and quantizes into the MXFP8 params.
Expected values: ``refgrad.optim.optimizer_step`` on the reduced grads (both
ranks' shards, joined), then ``refgrad.mxfp8.quantize`` of the masters rounded
to bf16 by ``refgrad.formats``. Sharing on and off must give the same bits.
"""

from __future__ import annotations

import pytest
import torch

from fastgrad.mxfp8_sharing import MXFP8Parameter, MXFP8ParamGradBuffer
from fastgrad.optim import AdamWConfig, DistributedOptimizer, SGDConfig
from refgrad import mxfp8 as RQ
from refgrad import optim as R
from refgrad.formats import tensor_bit_patterns
from tests.distributed_utils import run_distributed
from verify.fixtures.mxfp8 import toy_config

SHAPES = [(8, 64), (4, 32), (16, 32)]  # 1152 elements: two buckets of bucket_size 1000
STEPS = 3
CONFIGS = {
    "adamw": (AdamWConfig(lr=1e-2, weight_decay=0.1), 0.5),  # (config, max_grad_norm)
    "sgd": (SGDConfig(lr=0.5, momentum=0.9, weight_decay=0.01), None),
}


def _train(rank: int, kind: str, sharing: bool, grad_fp32: bool) -> dict:
    init = torch.Generator().manual_seed(11)
    weights = [MXFP8Parameter(torch.randn(s, generator=init) * 0.5) for s in SHAPES]
    initial = [w.dequantize(torch.float32) for w in weights]
    buffer = MXFP8ParamGradBuffer(weights, config=toy_config(sharing=sharing, grad_fp32=grad_fp32))
    config, clip = CONFIGS[kind]
    opt = DistributedOptimizer(buffer, config, max_grad_norm=clip)
    opt.publish_params()
    out = {"initial": initial, "sharing": buffer.sharing, "steps": [],
           "param_ranges": [buffer.param_range(w) for w in weights],
           "buckets": [(b.start, b.end) for b in buffer.buckets],
           "bits0": [(w.scale_bits.clone(), w.element_bits.clone()) for w in weights]}
    for step in range(STEPS):
        buffer.zero_grad()
        for k, w in enumerate(weights):
            data = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
            buffer.accumulate_grad(w, torch.randn(w.shape, generator=data) * (k + 1))
        buffer.reduce_grads()
        grads = [b.local_grad_shard.clone() for b in buffer.buckets]
        result = opt.step()
        out["steps"].append({
            "stepped": result.stepped, "grads": grads, "masters": opt.master_shards(),
            "bits": [(w.scale_bits.clone(), w.element_bits.clone()) for w in weights],
        })
    return out


def worker(rank: int, world: int) -> dict:
    return {(kind, sharing, grad_fp32): _train(rank, kind, sharing, grad_fp32)
            for kind in CONFIGS for sharing in (False, True) for grad_fp32 in (True, False)}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(tensor_bit_patterns(a), tensor_bit_patterns(b))


def _expected_bits(masters: list, shape) -> tuple[torch.Tensor, torch.Tensor]:
    bf16 = R.to_tensor(masters, shape, torch.bfloat16)  # refgrad's rounding of the staged cast
    return RQ.quantize(bf16, scale_mode="floor")


def _check_against_refgrad(runs: list[dict], kind: str) -> None:
    run0 = runs[0]
    config, clip = CONFIGS[kind]
    hyper = R.AdamW(**vars(config)) if kind == "adamw" else R.SGD(**vars(config))
    states = [R.ParamState(master=R.values(t)) for t in run0["initial"]]
    for k, shape in enumerate(SHAPES):
        for run in runs:
            assert torch.equal(_expected_bits(states[k].master, shape)[1], run["bits0"][k][1])
    for step in range(STEPS):
        full = []
        for bi in range(len(run0["buckets"])):
            full.append(torch.cat([run["steps"][step]["grads"][bi] for run in runs]))
        full = torch.cat(full)
        grads = [full[a:b].reshape(s) for (a, b), s in zip(run0["param_ranges"], SHAPES)]
        stepped, _ = R.optimizer_step(states, grads, [hyper] * len(SHAPES), [step + 1] * len(SHAPES),
                                      max_norm=clip)
        assert stepped
        masters = torch.cat([torch.cat([run["steps"][step]["masters"][bi] for run in runs])
                             for bi in range(len(run0["buckets"]))])
        for k, ((a, b), shape) in enumerate(zip(run0["param_ranges"], SHAPES)):
            expected_master = R.to_tensor(states[k].master, (b - a,))
            assert _same(masters[a:b], expected_master), (kind, step, k)
            scales, elements = _expected_bits(states[k].master, shape)
            for rank, run in enumerate(runs):
                got_scales, got_elements = run["steps"][step]["bits"][k]
                assert torch.equal(scales, got_scales), (kind, step, k, rank)
                assert torch.equal(elements, got_elements), (kind, step, k, rank)


@pytest.mark.dist
def test_dp2_mxfp8_params_bitwise_vs_refgrad_and_sharing_parity():
    results = run_distributed(worker, 2)
    for key in results[0]:
        kind, sharing, grad_fp32 = key
        runs = [r[key] for r in results]
        assert all(run["sharing"] == sharing for run in runs)
        assert all(s["stepped"] for run in runs for s in run["steps"])
        # rank-specific data: the ranks' local grads differ
        assert not torch.equal(runs[0]["steps"][0]["grads"][0], runs[1]["steps"][0]["grads"][0])
        if sharing:
            for rank in range(2):
                off = results[rank][(kind, False, grad_fp32)]["steps"]
                for a, b in zip(off, runs[rank]["steps"]):
                    assert all(_same(x, y) for x, y in zip(a["grads"] + a["masters"], b["grads"] + b["masters"]))
                    assert all(torch.equal(x, y) for p, q in zip(a["bits"], b["bits"]) for x, y in zip(p, q))
        _check_against_refgrad(runs, kind)
        # training moved the params
        assert not torch.equal(runs[0]["bits0"][0][1], runs[0]["steps"][-1]["bits"][0][1])


def _one_rank(sharing: bool):
    init = torch.Generator().manual_seed(3)
    weights = [MXFP8Parameter(torch.randn(s, generator=init)) for s in SHAPES]
    buffer = MXFP8ParamGradBuffer(weights, config=toy_config(sharing=sharing, grad_fp32=True))
    return weights, buffer, DistributedOptimizer(buffer, AdamWConfig(lr=1e-2))


def test_capability_flag_and_lifecycle_guard_through_the_optimizer():
    from fastgrad.errors import LifecycleError

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
    state = opt.state_dict()
    assert sorted(state["params"]) == [f"params[{i}]" for i in range(len(SHAPES))]
    fresh_weights, _, fresh = _one_rank(sharing=False)  # other init, separate buffers
    fresh.load_state_dict(state)
    for a, b in zip(weights, fresh_weights):
        assert torch.equal(a.scale_bits, b.scale_bits) and torch.equal(a.element_bits, b.element_bits)
    assert all(_same(x, y) for x, y in zip(opt.master_shards(), fresh.master_shards()))

"""MXFP8 param all-gather through the grad buffer: parity with sharing off, memory, lifecycle errors.

Toy model (verify.fixtures.mxfp8.TOY_SHAPES, bucket_size 1000): registration order
W1 (4096), W2 (2048), W3 (1024), W4 (256) is laid out in reverse with 64-aligned
starts and bucket ends padded to lcm(dp, 128) = 128 (dp 1 or 2):
  W4 [0, 256), W3 [256, 1280)  -> bucket 0 [0, 1280)   (1280 >= 1000 closes it)
  W2 [1280, 3328)              -> bucket 1 [1280, 3328)
  W1 [3328, 7424)              -> bucket 2 [3328, 7424)
so numel = 7424. With fp32 grads and sharing, bf16 param index k lives in bytes
[2k, 2k+2): bucket 2's params occupy bytes [6656, 14848), which are the fp32
grads of elements [1664, 3712) -- bucket 1's (and the start of bucket 2's) grads.
"""

from __future__ import annotations

import pytest
import torch
from distributed_utils import run_distributed

from fastgrad.mxfp8_sharing import MXFP8Parameter, MXFP8ParamGradBuffer
from fastgrad.optim import AdamWConfig, DistributedOptimizer, DynamicLossScaler, SGDConfig
from gradvocab import DDPConfig, LifecycleError
from refgrad import mxfp8 as ref
from verify.fixtures.mxfp8 import TOY_SHAPES, toy_config, train_both_modes_rank
from verify.metrics import assert_bitwise_equal, bitwise_equal

TOY_NUMEL = 7424
TOY_BUCKETS = [(0, 1280), (1280, 3328), (3328, 7424)]


def make_buffer(*, sharing: bool, grad_fp32: bool = True, extra: list | None = None):
    g = torch.Generator().manual_seed(0)
    weights = [MXFP8Parameter(torch.randn(s, generator=g)) for s in TOY_SHAPES]
    params = weights + (extra or [])
    config = toy_config(sharing=sharing, grad_fp32=grad_fp32)
    buffer = MXFP8ParamGradBuffer(params, config=config)
    return weights, buffer, DistributedOptimizer(buffer, SGDConfig(lr=0.5))


def stage(buffer, optimizer):
    """The front's staging step, driven by hand (``optimizer.step()`` does it after its update)."""
    buffer.stage_master_params(optimizer.master_shards())


# ------------------------------------------------------------------ layout and memory


@pytest.mark.parametrize("grad_fp32", [True, False])
def test_layout_and_measured_bytes(grad_fp32):
    _, off, _ = make_buffer(sharing=False, grad_fp32=grad_fp32)
    _, on, _ = make_buffer(sharing=True, grad_fp32=grad_fp32)
    grad_size = 4 if grad_fp32 else 2
    for buffer in (off, on):
        assert buffer.numel == TOY_NUMEL
        assert [(b.start, b.end) for b in buffer.buckets] == TOY_BUCKETS
    assert off.allocated_bytes() == TOY_NUMEL * (grad_size + 2)
    assert on.allocated_bytes() == TOY_NUMEL * grad_size
    assert off.allocated_bytes() - on.allocated_bytes() == 2 * TOY_NUMEL
    # One allocation: param_data aliases the grad buffer's storage.
    assert on.param_data.untyped_storage().data_ptr() == on.grad_data.untyped_storage().data_ptr()
    assert on.param_data.data_ptr() == on.grad_data.data_ptr()
    assert on.param_data.dtype == torch.bfloat16 and on.param_data.numel() == TOY_NUMEL


def test_fp32_param_view_is_first_half_of_the_grad_bytes():
    _, buffer, _ = make_buffer(sharing=True, grad_fp32=True)
    buffer.param_data[TOY_NUMEL - 1] = 1.0  # the last bf16 param element...
    nonzero = buffer.grad_data.view(torch.int32).ne(0).nonzero().reshape(-1).tolist()
    assert nonzero == [TOY_NUMEL // 2 - 1]  # ...is in the last fp32 element of the first half


def test_sharing_falls_back_without_mxfp8_params():
    bias = torch.zeros(64, dtype=torch.bfloat16)
    buffer = MXFP8ParamGradBuffer([bias], config=toy_config(sharing=True, grad_fp32=True))
    assert not buffer.sharing
    # 64 elements padded to 128 (lcm(dp=1, 128)); fp32 grads + a separate bf16 param buffer.
    assert buffer.numel == 128
    assert buffer.allocated_bytes() == buffer.expected_bytes() == 128 * (4 + 2)


# ------------------------------------------------------------------ production's NaN configs


@pytest.mark.parametrize(
    "missing",
    ["fp8_param_gather", "overlap_param_gather", "overlap_grad_reduce", "use_distributed_optimizer"],
)
def test_config_combinations_that_give_nan_are_refused(missing):
    fields = dict(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        fp8_param_gather=True,
        reuse_grad_buf_for_mxfp8_param_ag=True,
    )
    fields[missing] = False
    if missing == "use_distributed_optimizer":
        fields["overlap_param_gather"] = False
    with pytest.raises(ValueError, match="reuse_grad_buf_for_mxfp8_param_ag|overlap_param_gather"):
        DDPConfig(**fields)


def test_buffer_needs_the_distributed_optimizer():
    weights = [MXFP8Parameter(torch.ones(8, 32))]
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        MXFP8ParamGradBuffer(weights, config=DDPConfig())


# ------------------------------------------------------------------ lifecycle (dp=1, no group)


def one_iteration_until_gathered(buffer, optimizer):
    buffer.zero_grad()
    stage(buffer, optimizer)
    buffer.gather_all_params()


def test_copy_quantizes_gathered_params_and_zeroes_each_bucket():
    weights, buffer, optimizer = make_buffer(sharing=True)
    one_iteration_until_gathered(buffer, optimizer)
    assert bool(buffer.grad_data.eq(0).all())  # every bucket zeroed after its copy
    for weight, master_values in zip(weights, _masters_per_param(buffer, optimizer)):
        expected = ref.quantize(master_values.to(torch.bfloat16).reshape(weight.shape))
        assert_bitwise_equal(expected[0], weight.scale_bits)
        assert_bitwise_equal(expected[1], weight.element_bits)


def _masters_per_param(buffer, optimizer):
    full = torch.cat(optimizer.master_shards())  # dp=1: shard = bucket, in buffer order
    return [full[slice(*buffer.param_range(p))] for p in buffer.params]


def test_reading_gathered_params_after_zeroing_is_refused():
    weights, buffer, optimizer = make_buffer(sharing=True)
    one_iteration_until_gathered(buffer, optimizer)
    with pytest.raises(LifecycleError, match="zeroed"):
        buffer.gathered_param(weights[0])
    with pytest.raises(LifecycleError, match="gathered params are gone"):
        buffer.copy_params_from_buffer(buffer.buckets[0])  # a second copy would write zeros
    # With separate buffers the gathered params stay readable.
    weights_off, off, opt_off = make_buffer(sharing=False)
    one_iteration_until_gathered(off, opt_off)
    assert off.gathered_param(weights_off[0]).abs().sum() > 0


def test_forced_param_sync_needs_restaged_master_shards():
    weights, buffer, optimizer = make_buffer(sharing=True)
    one_iteration_until_gathered(buffer, optimizer)
    # What an unguarded forced sync would all-gather: the zeroed shards.
    assert all(bool(b.local_param_shard.eq(0).all()) for b in buffer.buckets)
    with pytest.raises(LifecycleError, match="forced param sync.*zeroed"):
        buffer.gather_all_params(force_sync=True)
    before = [w.element_bits.clone() for w in weights]
    stage(buffer, optimizer)
    buffer.gather_all_params(force_sync=True)  # re-staged: gathers the real params again
    assert all(bitwise_equal(a, w.element_bits) for a, w in zip(before, weights))


def test_stale_shard_after_step_is_refused_with_sharing_off_too():
    weights, buffer, optimizer = make_buffer(sharing=False)
    one_iteration_until_gathered(buffer, optimizer)
    buffer.gather_all_params(force_sync=True)  # separate buffers: still the staged params
    for w in weights:
        buffer.accumulate_grad(w, torch.ones(w.shape))
    buffer.reduce_grads()
    buffer.consume_grads()  # what an optimizer step does first; the shards are stale until re-staged
    with pytest.raises(LifecycleError, match="stale since the last optimizer step"):
        buffer.gather_all_params(force_sync=True)


def test_grads_into_bytes_holding_another_buckets_params_are_refused():
    weights, buffer, optimizer = make_buffer(sharing=True, grad_fp32=True)
    buffer.zero_grad()
    stage(buffer, optimizer)
    for bucket in buffer.buckets[:2]:  # bucket 2 stays staged: its params are live
        buffer.start_param_gather(bucket)
        buffer.finish_param_gather(bucket)
    # W2 (bucket 1) has fp32 grad bytes [5120, 13312); bucket 2's bf16 params sit in [6656, 14848).
    with pytest.raises(LifecycleError, match="bucket 2"):
        buffer.accumulate_grad(weights[1], torch.ones(weights[1].shape))
    buffer.accumulate_grad(weights[3], torch.ones(weights[3].shape))  # bytes [0, 1024): free
    with pytest.raises(LifecycleError, match="zero_grad would overwrite live params"):
        buffer.zero_grad()
    # The same order with separate buffers is harmless.
    weights_off, off, opt_off = make_buffer(sharing=False, grad_fp32=True)
    off.zero_grad()
    stage(off, opt_off)
    for bucket in off.buckets[:2]:
        off.start_param_gather(bucket)
        off.finish_param_gather(bucket)
    off.accumulate_grad(weights_off[1], torch.ones(weights_off[1].shape))


def test_staging_over_unconsumed_grads_is_refused():
    weights, buffer, optimizer = make_buffer(sharing=True)
    one_iteration_until_gathered(buffer, optimizer)
    buffer.accumulate_grad(weights[0], torch.ones(weights[0].shape))
    with pytest.raises(LifecycleError, match="overwrite grads"):
        stage(buffer, optimizer)
    with pytest.raises(LifecycleError, match="grad sync of bucket"):
        optimizer.step()  # DistributedOptimizer: the buckets' grads were not reduced
    with pytest.raises(LifecycleError, match="before reduce_grads"):
        buffer.consume_grads()


def test_bucket_holding_a_non_quantized_param_is_not_zeroed():
    bias = torch.full((64,), 0.75, dtype=torch.bfloat16)  # registered last: bucket 0
    weights, buffer, optimizer = make_buffer(sharing=True, grad_fp32=False, extra=[bias])
    assert buffer.bucket_of(bias).bucket_id == 0 and buffer.region_of(bias).holds_non_quantized
    with pytest.raises(LifecycleError, match="non-quantized param"):
        buffer.zero_grad()  # production's zero_grad would wipe the bias here
    stage(buffer, optimizer)
    buffer.gather_all_params()
    assert bool(bias.eq(0.75).all())  # still there: bucket 0 was not zeroed
    assert bias.data_ptr() == buffer.gathered_param(bias).data_ptr()
    assert bool(buffer.buckets[1].grad_data.eq(0).all()) and bool(buffer.buckets[2].grad_data.eq(0).all())
    with pytest.raises(LifecycleError, match="non-quantized param"):
        buffer.accumulate_grad(weights[3], torch.ones(weights[3].shape))  # W4 is in bucket 0
    buffer.accumulate_grad(weights[0], torch.ones(weights[0].shape))  # bucket 2 is free
    with pytest.raises(LifecycleError, match="reduce-scatter of bucket 0"):
        buffer.reduce_grads()


def test_bad_arguments():
    weights, buffer, optimizer = make_buffer(sharing=True)
    with pytest.raises(ValueError, match="one per bucket"):
        buffer.stage_master_params(optimizer.master_shards()[:1])
    with pytest.raises(ValueError, match="shape"):
        buffer.accumulate_grad(weights[0], torch.ones(3))
    with pytest.raises(ValueError, match="not in this buffer"):
        buffer.bucket_of(MXFP8Parameter(torch.ones(1, 32)))
    with pytest.raises(TypeError, match="bfloat16"):
        MXFP8ParamGradBuffer([torch.ones(4)], config=toy_config(sharing=True, grad_fp32=True))
    with pytest.raises(TypeError, match="config must be an AdamWConfig or SGDConfig"):
        DistributedOptimizer(buffer, "lamb")
    with pytest.raises(TypeError, match="MXFP8ParamGradBuffer"):
        DistributedOptimizer(buffer.buffer, SGDConfig(lr=0.5))
    with pytest.raises(ValueError, match="loss_scaler is only for fp16"):
        DistributedOptimizer(buffer, AdamWConfig(lr=1e-2), loss_scaler=DynamicLossScaler())


# ------------------------------------------------------------------ dp=2 gloo: parity and errors


def _lifecycle_errors_rank(rank: int, world_size: int) -> list[str]:
    """Misuse on a real dp=2 group; returns the error messages (all must be LifecycleErrors)."""
    messages = []
    weights, buffer, optimizer = make_buffer(sharing=True)
    buffer.zero_grad()
    stage(buffer, optimizer)
    buffer.gather_all_params()
    for attempt in (
        lambda: buffer.gathered_param(weights[0]),
        lambda: buffer.gather_all_params(force_sync=True),
    ):
        try:
            attempt()
        except LifecycleError as exc:
            messages.append(str(exc))
    return messages


def _parity_and_errors_rank(rank: int, world_size: int) -> dict:
    parity = train_both_modes_rank(rank, world_size, 3, "adam", 7, (True, False))
    return {"parity": parity, "errors": _lifecycle_errors_rank(rank, world_size)}


@pytest.mark.dist
def test_dp2_training_bitwise_parity_with_sharing_off_and_lifecycle_errors():
    results = run_distributed(_parity_and_errors_rank, 2)
    per_rank_bits = []
    for rank, result in enumerate(results):
        assert len(result["errors"]) == 2, result["errors"]
        for grad_fp32 in (True, False):
            off = result["parity"][(False, grad_fp32)]
            on = result["parity"][(True, grad_fp32)]
            assert on["sharing"] and not off["sharing"]
            assert len(on["snapshots"]) == 3
            for it, (a, b) in enumerate(zip(off["snapshots"], on["snapshots"])):
                for key in ("scale_bits", "element_bits", "masters_before", "masters_after", "local_grad_shards"):
                    for x, y in zip(a[key], b[key]):
                        assert bitwise_equal(x, y), (rank, grad_fp32, it, key)
                assert bitwise_equal(a["grads"], b["grads"]), (rank, grad_fp32, it)
            # training moved the params: the iterations are not all the same bits
            assert not bitwise_equal(on["snapshots"][0]["element_bits"][0], on["snapshots"][2]["element_bits"][0])
        per_rank_bits.append(result["parity"][(True, True)]["snapshots"][-1]["element_bits"])
    # the all-gather gave both ranks the same params, though their data (and grads) differ
    assert all(bitwise_equal(x, y) for x, y in zip(*per_rank_bits))
    grads = [r["parity"][(True, True)]["snapshots"][0]["local_grad_shards"] for r in results]
    assert not bitwise_equal(grads[0][0], grads[1][0])

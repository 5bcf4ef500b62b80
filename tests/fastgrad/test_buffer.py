"""ParamAndGradBuffer: views, alignment, padding, lifecycle, and real multi-rank reductions."""

import pytest
import torch

from fastgrad.buffer import (
    AllReduceStrategy,
    LocalOnlyStrategy,
    ParamAndGradBuffer,
    ReduceScatterStrategy,
    aligned_zeros,
    select_reduce_strategy,
)
from fastgrad.comm import reduce_scatter_into
from fastgrad.reduce_scatter import reduce_scatter_with_fp32_accumulation
from gradvocab import Averaging, DDPConfig, LifecycleError, ParallelDims
from refgrad.layout import compute_layout as reference_layout
from verify.candidates import FastgradCandidate
from verify.checks.layout import buffer_violations, default_scenarios, run_reduce_scenarios
from verify.metrics import assert_bitwise_equal, bitwise_equal

DIST_OPT = DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=100)


def make_params(shapes, dtypes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))
        for shape, dtype in zip(shapes, dtypes)
    ]


def test_groups_by_param_and_grad_dtype():
    params = make_params([(4,), (5,), (6,), (7,)], [torch.bfloat16, torch.float32] * 2)
    buf = ParamAndGradBuffer(params, config=DIST_OPT)
    assert [g.key for g in buf.groups] == [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    ]
    assert buf.groups[0].params == [params[0], params[2]]
    fp32_grads = ParamAndGradBuffer(
        make_params([(4,), (5,)], [torch.bfloat16] * 2),
        config=DDPConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
    )
    (group,) = fp32_grads.groups
    assert (group.grad_data.dtype, group.param_data.dtype) == (torch.float32, torch.bfloat16)


def test_views_follow_refgrad_layout_and_keep_values():
    # numels (50, 60, 70, 80), dp 3, bucket 100: hand-derived in tests/refgrad/test_layout.py.
    params = make_params([(5, 10), (60,), (7, 10), (80,)], [torch.float32] * 4)
    before = [p.detach().clone() for p in params]
    params[1].main_grad = torch.full((60,), 2.5)  # an existing main_grad is copied in
    buf = ParamAndGradBuffer(params, config=DIST_OPT, dp_size=3)
    (group,) = buf.groups
    assert [group.param_range(p) for p in params] == [(448, 498), (384, 444), (128, 198), (0, 80)]
    assert group.numel == 768 and group.numel_unpadded == 312
    for p, old in zip(params, before):
        start, _ = group.param_range(p)
        assert_bitwise_equal(p.detach(), old)
        assert p.data_ptr() == group.param_data.data_ptr() + 4 * start
        assert p.main_grad.data_ptr() == group.grad_data.data_ptr() + 4 * start
        assert p.main_grad.shape == p.shape
    assert_bitwise_equal(params[1].main_grad, torch.full((60,), 2.5))
    assert float(params[0].main_grad.abs().sum()) == 0.0
    b0, b1 = group.buckets
    assert b0.params == [params[3], params[2]] and b1.params == [params[1], params[0]]
    assert b1.param_to_index == {params[1]: (0, 60), params[0]: (64, 114)}
    assert (b1.start, b1.end, b1.numel_unpadded) == (384, 768, 114)
    assert buf.bucket_of(params[0]) is b1 and buf.group_of(params[0]) is group
    assert [b1.shard_range(r) for r in range(3)] == [(384, 512), (512, 640), (640, 768)]
    assert b1.grad_shard(2).data_ptr() == group.grad_data.data_ptr() + 4 * 640
    assert b1.param_shard(0).numel() == 128


def test_without_distributed_optimizer_params_keep_their_storage():
    params = make_params([(3,), (9,)], [torch.bfloat16] * 2)
    pointers = [p.data_ptr() for p in params]
    buf = ParamAndGradBuffer(params, config=DDPConfig(), dp_size=5)
    (group,) = buf.groups
    assert group.param_data is None and group.numel == 12
    assert [p.data_ptr() for p in params] == pointers
    assert [group.param_range(p) for p in params] == [(9, 12), (0, 9)]
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        buf.buckets[0].param_shard(0)
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        buf.local_shard_grad_norm_sq()
    with pytest.raises(ValueError, match="not divisible"):
        buf.buckets[0].grad_shard(0)  # 12 elements are not split over 5 ranks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_alignment_recovered_from_a_misaligning_allocator(dtype):
    def misaligned(numel, *, dtype, device):
        return torch.zeros(numel + 1, dtype=dtype, device=device)[1:]

    view = aligned_zeros(1000, dtype, "cpu", allocate=misaligned)
    assert view.numel() == 1000
    assert view.data_ptr() % (64 * view.element_size()) == 0
    assert float(view.abs().sum()) == 0.0


def test_every_param_view_is_64_element_aligned():
    params = make_params([(1,), (65,), (3, 7), (128,), (2,)], [torch.bfloat16] * 5)
    buf = ParamAndGradBuffer(params, config=DIST_OPT, dp_size=6)
    ref = reference_layout([p.numel() for p in params], dp_size=6, bucket_size=100,
                           use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=False)
    (group,) = buf.groups
    assert [group.param_range(p) for p in params] == [(s, e) for s, e, _ in ref.param_index_map]
    for p in params:
        assert p.main_grad.data_ptr() % (64 * 2) == 0
        assert p.data_ptr() % (64 * 2) == 0


def test_local_buffer_properties_on_cpu():
    # Views, alignment, refgrad layout, poisoned padding invisible to helpers, for several dp.
    assert buffer_violations("cpu", FastgradCandidate().layout()) == []


@pytest.mark.gpu
def test_local_buffer_properties_on_cuda():
    assert buffer_violations("cuda", FastgradCandidate().layout()) == []


def test_padding_never_leaks():
    params = make_params([(5,), (70,)], [torch.float32] * 2)
    buf = ParamAndGradBuffer(params, config=DIST_OPT, dp_size=4)
    # Layout (dp 4, divisor lcm(4,128)=128), reverse order: 70 at [0,70) leaves the bucket
    # open (70 < bucket size 100); 5 at pad64(70)=128 in the same bucket: [128,133);
    # unpadded 133 -> end pad(133,128)=256. Shards of 256/4 = 64.
    (group,) = buf.groups
    assert [group.param_range(p) for p in params] == [(128, 133), (0, 70)]
    for p in params:
        p.main_grad.add_(3.0)
        p.main_grad.add_(1.0)
    assert buf.padding_is_zero()
    group.grad_data[group.padding_mask()] = float("nan")
    assert not buf.padding_is_zero()
    # 75 elements of value 4: norm^2 = 75 * 16 = 1200, whatever the padding holds.
    assert float(buf.grad_norm_sq()) == 1200.0
    assert sum(float(buf.local_shard_grad_norm_sq(r)) for r in range(4)) == 1200.0
    # Rank 3's shard [192,256) is all padding: an empty, valid state and a zero norm.
    assert buf.buckets[0].shard_pieces(3) == []
    assert buf.shard_checkpoint_state(3) == {}
    assert float(buf.local_shard_grad_norm_sq(3)) == 0.0
    # Rank 1's shard [64,128) holds the tail of param 1 only: elements 64..69.
    (piece,) = buf.buckets[0].shard_pieces(1)
    assert piece.param is params[1] and piece.param_offset == (64, 70)
    assert piece.buffer_range == (64, 70)
    state = buf.checkpoint_state()
    assert_bitwise_equal(state[0]["main_grad"], torch.full((5,), 4.0))
    buf.zero_grad()
    assert buf.padding_is_zero() and float(buf.grad_norm_sq()) == 0.0


def test_local_only_reduction_of_one_replica_leaves_its_grads():
    params = make_params([(3,), (4,)], [torch.bfloat16] * 2)
    buf = ParamAndGradBuffer(params, config=DIST_OPT, averaging=Averaging.PRESCALE)
    assert isinstance(buf.strategy, LocalOnlyStrategy)
    assert buf.averaging.factors.pre_scale is None  # the average of one replica is that replica
    for p in params:
        p.main_grad.fill_(3.0)
    buf.start_grad_sync()
    assert buf.reduce_in_flight and all(b.reduce_in_flight for b in buf.buckets)
    buf.finish_grad_sync()
    assert not buf.reduce_in_flight
    assert all(bitwise_equal(p.main_grad, torch.full_like(p.main_grad, 3.0)) for p in params)


def test_lifecycle_errors():
    params = make_params([(3,), (200,)], [torch.float32] * 2)
    buf = ParamAndGradBuffer(params, config=DIST_OPT)
    first, second = buf.buckets
    with pytest.raises(LifecycleError, match="no reduction is in flight"):
        first.finish_grad_sync()
    first.start_grad_sync()
    with pytest.raises(LifecycleError, match="already in flight"):
        first.start_grad_sync()
    with pytest.raises(LifecycleError, match="zero_grad while 1 bucket"):
        buf.zero_grad()
    with pytest.raises(LifecycleError, match="already in flight"):
        buf.start_grad_sync()
    with pytest.raises(LifecycleError, match="has no reduction in flight"):
        buf.finish_grad_sync()  # the second bucket was never started
    first.finish_grad_sync()
    buf.zero_grad()
    assert not second.reduce_in_flight


def test_reduce_across_ranks_without_process_group_is_refused():
    buf = ParamAndGradBuffer(make_params([(3,)], [torch.float32]), config=DIST_OPT, dp_size=2)
    with pytest.raises(LifecycleError, match="not initialized"):
        buf.buckets[0].start_grad_sync()
    assert not buf.reduce_in_flight


def test_strategy_selection():
    assert isinstance(select_reduce_strategy(DIST_OPT, distributed=False), LocalOnlyStrategy)
    assert isinstance(select_reduce_strategy(DDPConfig(), distributed=True), AllReduceStrategy)
    plain = select_reduce_strategy(DIST_OPT, distributed=True)
    assert isinstance(plain, ReduceScatterStrategy) and plain.collective is reduce_scatter_into
    fp32 = DDPConfig(use_distributed_optimizer=True, reduce_scatter_with_fp32_accumulation=True)
    fp32_strategy = select_reduce_strategy(fp32, distributed=True)
    # One reduce-scatter class, parameterised by the collective.
    assert isinstance(fp32_strategy, ReduceScatterStrategy)
    assert fp32_strategy.collective is reduce_scatter_with_fp32_accumulation
    with pytest.raises(TypeError, match="DDPConfig"):
        select_reduce_strategy({}, distributed=True)


def test_bad_arguments():
    p = make_params([(3,)], [torch.float32])
    with pytest.raises(TypeError, match="config must be a DDPConfig"):
        ParamAndGradBuffer(p, config=None)
    with pytest.raises(ValueError, match="at least one parameter"):
        ParamAndGradBuffer([], config=DIST_OPT)
    with pytest.raises(ValueError, match="listed twice"):
        ParamAndGradBuffer(p + p, config=DIST_OPT)
    with pytest.raises(TypeError, match="floating point"):
        ParamAndGradBuffer([torch.zeros(3, dtype=torch.int32)], config=DIST_OPT)
    with pytest.raises(ValueError, match="no elements"):
        ParamAndGradBuffer([torch.zeros(0)], config=DIST_OPT)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        ParamAndGradBuffer([[1.0]], config=DIST_OPT)
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        ParamAndGradBuffer(p, config=DIST_OPT, dp_size=0)
    with pytest.raises(ValueError, match="dp_group was given"):
        ParamAndGradBuffer(p, config=DIST_OPT, dp_group=object())
    with pytest.raises(ValueError, match="averaging=sum contradicts DDPConfig.average_in_collective=True"):
        ParamAndGradBuffer(p, config=DDPConfig(average_in_collective=True))  # the default: SUM
    with pytest.raises(ValueError, match="either parallel_dims or dp_group/dp_size"):
        ParamAndGradBuffer(p, config=DIST_OPT, dp_size=1, parallel_dims=ParallelDims.data_parallel())
    with pytest.raises(ValueError, match="sizes only"):
        ParamAndGradBuffer(p, config=DIST_OPT, parallel_dims=ParallelDims(dp_size=2))
    with pytest.raises(ValueError, match="is on cpu"):
        ParamAndGradBuffer(p, config=DIST_OPT, device="meta")
    with pytest.raises(ValueError, match="not in this buffer"):
        ParamAndGradBuffer(p, config=DIST_OPT).bucket_of(torch.zeros(1))


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_through_buffers_matches_exact_sums(world_size):
    # Integer-valued, rank-specific grads over two iterations of two microbatches each:
    # every sum is exact, so each rank's shard must equal the exact sum laid out by refgrad.
    scenarios = default_scenarios(world_size)
    results = run_reduce_scenarios(world_size, scenarios, FastgradCandidate())
    assert [r.label for r in results] == [f"dp={world_size}: {s.name}" for s in scenarios]
    assert all(r.crash is None and r.skipped is None for r in results)
    outcomes = [check for r in results for check in r.checks]
    assert len(outcomes) == 2 * len(scenarios)  # two iterations each
    failures = [(label, detail) for label, passed, detail in outcomes if not passed]
    assert failures == []

"""fastgrad.ddp: hooks into main_grad, no_sync, readiness counting, learned counts, errors.

Single-process tests (dp_size 1, no process group) exercise the state machine;
one gloo test (2 ranks, rank-specific data, 3 steps) checks the reductions
against refgrad.reduce_scatter through refgrad.pipeline.reduce_across_replicas.
"""

import pytest
import torch
from distributed_utils import run_distributed
from torch import nn

from fastgrad.ddp import DistributedDataParallel
from fastgrad.exposed_grads import UnreducedGradPlaceholder
from gradvocab import Averaging, DDPConfig, LifecycleError
from refgrad.pipeline import reduce_across_replicas
from verify.metrics import assert_bitwise_equal, bitwise_equal


class TwoLayer(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.skip_second = False

    def forward(self, x):
        x = torch.tanh(self.first(x))
        return x if self.skip_second else self.second(x)


def _data(seed: int, count: int):
    g = torch.Generator().manual_seed(100 + seed)
    return [torch.randn(3, 4, generator=g) for _ in range(count)]


def _backward(ddp, x):
    ddp(x).square().sum().backward()


def _per_microbatch_grads(seed: int, inputs):
    """Plain autograd grads of an identical module, one microbatch at a time."""
    model = TwoLayer(seed)
    grads = []
    for x in inputs:
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return grads


def _config(overlap=True, bucket_size=16, **kw):
    return DDPConfig(overlap_grad_reduce=overlap, bucket_size=bucket_size, **kw)


def _run_step(ddp, inputs):
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        for x in inputs[:-1]:
            _backward(ddp, x)
    _backward(ddp, inputs[-1])
    ddp.finish_grad_sync()


@pytest.mark.parametrize("overlap", [True, False])
def test_main_grad_is_the_microbatch_ordered_sum(overlap):
    model = TwoLayer()
    ddp = DistributedDataParallel(model, config=_config(overlap), averaging=Averaging.SUM)
    inputs = _data(0, 3)
    expected = _per_microbatch_grads(0, inputs)
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        for x in inputs[:-1]:
            _backward(ddp, x)
    _backward(ddp, inputs[-1])
    for p in model.parameters():
        # moved into main_grad by the hook; unreadable until finish_grad_sync reduces it
        assert isinstance(p.grad, UnreducedGradPlaceholder)
    ddp.finish_grad_sync()
    for name, p in model.named_parameters():
        acc = torch.zeros_like(p)
        for g in expected:
            acc = acc + g[name]
        assert_bitwise_equal(p.main_grad, acc, msg=str(name))
        # All-reduce config: finish_grad_sync exposes the reduced grad (same dtype: a view).
        assert p.grad is p.main_grad
    ddp.zero_grad_buffer()
    assert all(p.grad is None for p in model.parameters())


def test_buckets_launch_in_the_last_backward_after_the_first_batch():
    model = TwoLayer()
    ddp = DistributedDataParallel(model, config=_config(True), averaging=Averaging.SUM)
    assert len(ddp.buffer.buckets) >= 2
    for step in range(3):
        _run_step(ddp, _data(step, 2))
        sites = set(ddp.last_launch_sites)
        assert sites == {"hook"}, (step, ddp.last_launch_sites)
    assert not ddp.learning


def test_without_overlap_everything_reduces_in_finish():
    ddp = DistributedDataParallel(TwoLayer(), config=_config(False), averaging=Averaging.SUM)
    _run_step(ddp, _data(0, 2))
    assert set(ddp.last_launch_sites) == {"finish"}


def test_microbatch_count_change_keeps_learned_counts_valid():
    model = TwoLayer()
    ddp = DistributedDataParallel(model, config=_config(True), averaging=Averaging.SUM)
    for step, m in enumerate((3, 1, 5, 2)):
        inputs = _data(step, m)
        _run_step(ddp, inputs)
        assert set(ddp.last_launch_sites) == {"hook"}
        expected = _per_microbatch_grads(0, inputs)
        acc = torch.zeros_like(model.first.weight)
        for g in expected:
            acc = acc + g["first.weight"]
        assert_bitwise_equal(model.first.weight.main_grad, acc)
    assert ddp.relearn_count == 0


def test_frozen_parameter_change_relearns_instead_of_hanging():
    model = TwoLayer()
    ddp = DistributedDataParallel(model, config=_config(True), averaging=Averaging.SUM)
    _run_step(ddp, _data(0, 2))
    model.second.bias.requires_grad_(False)
    _run_step(ddp, _data(1, 2))
    assert ddp.relearn_count == 1
    assert torch.count_nonzero(model.second.bias.main_grad) == 0
    bucket = next(r for r in ddp.readiness() if r.total and r.learned and r.expected < r.total)
    assert bucket.expected == bucket.total - 1
    model.second.bias.requires_grad_(True)
    _run_step(ddp, _data(2, 2))
    assert ddp.relearn_count == 2
    assert set(ddp.last_launch_sites) == {"hook"}
    assert torch.count_nonzero(model.second.bias.main_grad) > 0


def test_bucket_never_launched_names_bucket_and_counts():
    model = TwoLayer()
    ddp = DistributedDataParallel(model, config=_config(True, bucket_size=10_000), averaging=Averaging.SUM)
    _run_step(ddp, _data(0, 2))  # learns: every param produces a grad
    model.skip_second = True  # graph change: second.* never get a grad
    ddp.zero_grad_buffer()
    _backward(ddp, _data(1, 1)[0])
    with pytest.raises(LifecycleError, match=r"bucket 0 \(2/4 params have grad available") as info:
        ddp.finish_grad_sync()
    assert "second.weight" in str(info.value)
    # The engine is usable again after the error (new step, graph restored).
    model.skip_second = False
    _run_step(ddp, _data(2, 2))


def test_unused_parameter_on_first_batch_is_learned():
    model = TwoLayer()
    model.skip_second = True
    ddp = DistributedDataParallel(model, config=_config(True, bucket_size=10_000), averaging=Averaging.SUM)
    _run_step(ddp, _data(0, 2))
    assert ddp.last_launch_sites == ("finish",)  # incomplete on the first batch: launched at finish
    _run_step(ddp, _data(1, 2))
    assert ddp.last_launch_sites == ("hook",)  # learned 2 of 4


def test_sync_enabled_on_two_microbatches_is_refused():
    ddp = DistributedDataParallel(TwoLayer(), config=_config(True), averaging=Averaging.SUM)
    ddp.zero_grad_buffer()
    inputs = _data(0, 2)
    _backward(ddp, inputs[0])  # sync enabled: this is taken as the last microbatch
    with pytest.raises(LifecycleError, match="only for the last microbatch"):
        _backward(ddp, inputs[1])


def test_no_sync_misuse_is_refused():
    ddp = DistributedDataParallel(TwoLayer(), config=_config(True), averaging=Averaging.SUM)
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        with pytest.raises(LifecycleError, match="not reentrant"):
            with ddp.no_sync():
                pass
        with pytest.raises(LifecycleError, match="inside no_sync"):
            ddp.finish_grad_sync()
        with pytest.raises(LifecycleError, match="inside no_sync"):
            ddp.start_grad_sync()
    _backward(ddp, _data(0, 1)[0])  # launches buckets
    with pytest.raises(LifecycleError, match="launched their reduce"):
        ddp.disable_grad_sync()
    with pytest.raises(LifecycleError, match="finish_grad_sync first"):
        ddp.zero_grad_buffer()
    ddp.finish_grad_sync()


@pytest.mark.parametrize("overlap", [True, False])
def test_finish_without_a_step_is_refused(overlap):
    # Without overlap a second finish would silently reduce the reduced grads again.
    model = TwoLayer()
    ddp = DistributedDataParallel(model, config=_config(overlap), averaging=Averaging.SUM)
    with pytest.raises(LifecycleError, match="without a step in progress"):
        ddp.finish_grad_sync()  # finish before any start
    inputs = _data(0, 2)
    _run_step(ddp, inputs)
    reduced = model.first.weight.main_grad.clone()
    with pytest.raises(LifecycleError, match="without a step in progress"):
        ddp.finish_grad_sync()  # finish twice
    assert_bitwise_equal(model.first.weight.main_grad, reduced)
    _run_step(ddp, _data(1, 2))  # the next step is unaffected


def test_mark_grad_ready_for_grads_written_outside_autograd():
    model = TwoLayer()
    ddp = DistributedDataParallel(
        model, config=_config(True, bucket_size=10_000), averaging=Averaging.SUM,
        external_grad_params=[model.second.weight],
    )
    for step in range(2):
        ddp.zero_grad_buffer()
        x = _data(step, 1)[0]
        model.second.weight.requires_grad_(True)
        _backward(ddp, x)  # second.weight's hook is not registered: its grad stays in .grad
        assert not ddp.reduce_in_flight(model.second.weight)
        model.second.weight.main_grad.add_(model.second.weight.grad)
        model.second.weight.grad = None
        ddp.mark_grad_ready(model.second.weight)
        assert ddp.reduce_in_flight(model.second.weight)
        ddp.finish_grad_sync()
        assert ddp.last_launch_sites == ("hook",)


def test_mark_grad_ready_after_finish_without_zeroing_is_refused():
    # main_grad still holds the reduced grads: a grad written into it now would be added to them
    model = TwoLayer()
    ddp = DistributedDataParallel(model, config=_config(), external_grad_params=[model.second.weight])
    _run_step(ddp, _data(0, 1))
    with pytest.raises(LifecycleError, match=r"mark_grad_ready\('second.weight'\) after finish_grad_sync "
                                             r"without zero_grad_buffer\(\)"):
        ddp.mark_grad_ready(model.second.weight)


@pytest.mark.parametrize("flag", [True, False])
def test_the_averaging_of_every_public_class_refuses_a_bool(flag):
    """``average=True`` was a bool; an ``Averaging`` says how, and a bool passed for it is a
    TypeError naming the parameter and the rule (not a silent SUM or average)."""
    from fastgrad.buffer import ParamAndGradBuffer
    from fastgrad.mxfp8_sharing import MXFP8ParamGradBuffer
    from verify.fixtures.mxfp8 import toy_config

    rule = "averaging must be a gradvocab.Averaging or None, got bool"
    with pytest.raises(TypeError, match=rule):
        DistributedDataParallel(TwoLayer(), config=_config(), averaging=flag)
    with pytest.raises(TypeError, match=rule):
        ParamAndGradBuffer([nn.Parameter(torch.zeros(4))], config=_config(), averaging=flag)
    with pytest.raises(TypeError, match=rule):
        MXFP8ParamGradBuffer([torch.zeros(4, dtype=torch.bfloat16)],
                             config=toy_config(sharing=False, grad_fp32=True), averaging=flag)


def test_constructor_validation():
    with pytest.raises(TypeError, match="module"):
        DistributedDataParallel("x", config=_config())
    with pytest.raises(TypeError, match="config"):
        DistributedDataParallel(TwoLayer(), config={})
    with pytest.raises(ValueError, match="average_in_collective"):
        DistributedDataParallel(TwoLayer(), config=_config(average_in_collective=True), averaging=Averaging.SUM)
    with pytest.raises(ValueError, match="averaging=avg contradicts DDPConfig.average_in_collective=False"):
        DistributedDataParallel(TwoLayer(), config=_config(), averaging=Averaging.AVG)
    frozen = TwoLayer()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        DistributedDataParallel(frozen, config=_config())
    with pytest.raises(ValueError, match="mark_grad_ready|trainable"):
        DistributedDataParallel(TwoLayer(), config=_config()).mark_grad_ready(nn.Parameter(torch.ones(1)))


def test_unfreezing_a_parameter_frozen_at_build_is_refused():
    model = TwoLayer()
    model.first.bias.requires_grad_(False)
    ddp = DistributedDataParallel(model, config=_config())
    _run_step(ddp, _data(0, 1))
    model.first.bias.requires_grad_(True)
    with pytest.raises(LifecycleError, match="frozen when DDP was built"):
        ddp.zero_grad_buffer()


# ---------------------------------------------------------------- gloo, 2 ranks

CONFIGS = {
    "all-reduce sum": (dict(), False, Averaging.SUM),
    "all-reduce prescale": (dict(), True, Averaging.PRESCALE),
    "reduce-scatter avg": (dict(use_distributed_optimizer=True, average_in_collective=True), True, Averaging.AVG),
}


def _dp_worker(rank, world_size):
    from fastgrad.comm import all_gather_into

    out = {}
    for label, (extra, _, averaging) in CONFIGS.items():
        for overlap in (True, False):
            model = TwoLayer()
            ddp = DistributedDataParallel(
                model, config=_config(overlap, **extra), averaging=averaging
            )
            steps = []
            for step in range(2):
                inputs = _data(10 * step + rank, 2 + step)  # rank-specific, M changes
                _run_step(ddp, inputs)
                grads = {}
                for bucket in ddp.buffer.buckets:
                    if extra.get("use_distributed_optimizer"):
                        full = torch.empty_like(bucket.grad_data)
                        all_gather_into(full, bucket.local_grad_shard.clone())
                        bucket.grad_data.copy_(full)
                for name, p in model.named_parameters():
                    grads[name] = p.main_grad.clone()
                steps.append((grads, inputs))
            out[(label, overlap)] = steps
    return out


@pytest.mark.dist
def test_reductions_match_refgrad_on_two_ranks():
    results = run_distributed(_dp_worker, 2)
    for label, (_, _, reduction) in CONFIGS.items():
        for overlap in (True, False):
            for step in range(2):
                per_rank_sums = []
                for rank in range(2):
                    _, inputs = results[rank][(label, overlap)][step]
                    grads = _per_microbatch_grads(0, inputs)
                    sums = {}
                    for name in grads[0]:
                        acc = torch.zeros_like(grads[0][name])
                        for g in grads:
                            acc = acc + g[name]
                        sums[name] = acc
                    per_rank_sums.append(sums)
                for name in per_rank_sums[0]:
                    expected = reduce_across_replicas([s[name] for s in per_rank_sums], reduction)
                    for rank in range(2):
                        got = results[rank][(label, overlap)][step][0][name]
                        assert_bitwise_equal(got, expected, msg=str((label, overlap, step, name, rank)))


# ---------------------------------------------------------------- nn.Module and plain optimizers


def test_ddp_is_a_module_with_the_wrapped_modules_names_and_tensors():
    model = TwoLayer()
    ddp = DistributedDataParallel(model, config=_config(use_distributed_optimizer=True))
    assert isinstance(ddp, nn.Module) and ddp.module is model
    assert [n for n, _ in ddp.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(ddp.parameters(), model.parameters()))
    state = ddp.state_dict()
    assert list(state) == ["first.weight", "first.bias", "second.weight", "second.bias"]
    for name, p in model.named_parameters():
        assert state[name].shape == p.shape and bitwise_equal(state[name], p)  # unpadded
    x = _data(0, 1)[0]
    assert_bitwise_equal(ddp(x), model(x))
    ddp.eval()
    assert not model.training and not model.first.training
    ddp.train()
    assert model.training
    # Loading writes through the parameters, which stay views into the buffer.
    other = TwoLayer(seed=5).state_dict()
    ddp.load_state_dict(other)
    group = ddp.buffer.group_of(model.first.weight)
    start, end = group.param_range(model.first.weight)
    assert_bitwise_equal(group.param_data[start:end].view(4, 4), other["first.weight"])
    assert model.first.weight.data_ptr() == group.param_data[start:end].data_ptr()
    with pytest.raises(ValueError, match="assign"):
        ddp.load_state_dict(other, assign=True)


def test_plain_optimizer_under_the_distributed_optimizer_fails_at_its_first_step():
    model = TwoLayer()
    ddp = DistributedDataParallel(model, config=_config(use_distributed_optimizer=True))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _run_step(ddp, _data(0, 2))
    with pytest.raises(LifecycleError, match="use_distributed_optimizer=True"):
        optimizer.step()
    assert all(bitwise_equal(a, p) for a, p in zip(before, model.parameters()))
    # A backward without zero_grad_buffer is refused too, instead of corrupting main_grad.
    with pytest.raises(LifecycleError, match="zero_grad_buffer"):
        _backward(ddp, _data(1, 1)[0])
    ddp.zero_grad_buffer()  # resets param.grad: the next step works again
    _run_step(ddp, _data(2, 2))


def test_backward_into_an_exposed_cast_copy_is_refused():
    model = TwoLayer().to(torch.bfloat16)
    ddp = DistributedDataParallel(model, config=_config(grad_reduce_in_fp32=True))
    _run_step(ddp, [x.to(torch.bfloat16) for x in _data(0, 1)])
    assert model.first.weight.grad.dtype == torch.bfloat16  # a cast copy of the fp32 main_grad
    with pytest.raises(LifecycleError, match="cast copy"):
        _backward(ddp, _data(1, 1)[0].to(torch.bfloat16))


SGD_LR = 0.125
PLAIN_OPTIMIZER_CASES = {
    "fp32 params (param.grad is main_grad)": (torch.float32, False),
    "bf16 params, fp32 grads (param.grad is a cast copy)": (torch.bfloat16, True),
}


def _plain_sgd_worker(rank, world_size):
    out = {}
    for label, (dtype, grad_fp32) in PLAIN_OPTIMIZER_CASES.items():
        model = TwoLayer().to(dtype)
        ddp = DistributedDataParallel(
            model, config=_config(True, grad_reduce_in_fp32=grad_fp32)
        )
        optimizer = torch.optim.SGD(ddp.parameters(), lr=SGD_LR)
        steps = []
        for step in range(3):
            inputs = [x.to(dtype) for x in _data(10 * step + rank, 2)]  # rank-specific
            _run_step(ddp, inputs)
            optimizer.step()
            steps.append((inputs, {n: p.detach().clone() for n, p in model.named_parameters()}))
        out[label] = steps
    try:
        ddp = DistributedDataParallel(TwoLayer(), config=_config(use_distributed_optimizer=True))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=SGD_LR)
        _run_step(ddp, _data(rank, 2))
        optimizer.step()
        out["distributed optimizer"] = "no error"
    except LifecycleError as exc:
        out["distributed optimizer"] = str(exc)
    return out


@pytest.mark.dist
def test_plain_sgd_on_ddp_parameters_matches_a_hand_computed_reference_on_two_ranks():
    """SGD on ddp.parameters() = p - lr * (mean over ranks of the summed microbatch grads).

    Hand reference: each rank's grads from plain autograd on an identical module,
    summed over microbatches in the grad dtype (main_grad starts at 0), times 1/2
    (prescale: exact), summed over the 2 ranks (one fp32/bf16 addition: order-free),
    cast to the param dtype, then torch.optim.SGD's update ``p.add_(g, alpha=-lr)``.
    """
    results = run_distributed(_plain_sgd_worker, 2)
    for label, (dtype, grad_fp32) in PLAIN_OPTIMIZER_CASES.items():
        grad_dtype = torch.float32 if grad_fp32 else dtype
        reference = TwoLayer().to(dtype)
        for step in range(3):
            per_rank = []
            for rank in range(2):
                inputs, _ = results[rank][label][step]
                acc = {n: torch.zeros_like(p, dtype=grad_dtype) for n, p in reference.named_parameters()}
                for x in inputs:
                    reference.zero_grad(set_to_none=True)
                    reference(x).square().sum().backward()
                    for n, p in reference.named_parameters():
                        acc[n] = acc[n] + p.grad.to(grad_dtype)
                per_rank.append(acc)
            with torch.no_grad():
                for n, p in reference.named_parameters():
                    grad = (per_rank[0][n] * 0.5 + per_rank[1][n] * 0.5).to(dtype)
                    p.add_(grad, alpha=-SGD_LR)
            for rank in range(2):
                got = results[rank][label][step][1]
                for n, p in reference.named_parameters():
                    assert got[n].dtype == dtype
                    assert_bitwise_equal(got[n], p.detach(), msg=str((label, step, rank, n)))
        # training moved the parameters
        assert not bitwise_equal(results[0][label][0][1]["first.weight"], TwoLayer().to(dtype).first.weight)
    for rank in range(2):
        assert "use_distributed_optimizer=True" in results[rank]["distributed optimizer"]

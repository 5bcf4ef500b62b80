"""fastgrad.pipeline (1F1B schedule, groups, deferred-wgrad drain) and fastgrad.timeline.

The bitwise pipeline-vs-refgrad sweep over P, D and M is the ``pipeline``
check (tests/verify/test_pipeline_check.py); here: the schedule's structure,
validation, timelines, and one gloo run of a pipeline whose last stage ends
in ``fastgrad.deferred_wgrad.ColumnParallelOutputLayer`` with deferred wgrad.
"""

import pytest
import torch
from distributed_utils import run_distributed
from torch import nn

from fastgrad.pipeline import (
    forward_backward_1f1b,
    num_warmup_microbatches,
    schedule_1f1b,
)
from fastgrad.timeline import Timeline
from gradvocab import ParallelDims, RankPlace
from refgrad.pipeline import LinearStackSpec, StageModule, microbatch_data, microbatch_loss
from verify.metrics import assert_bitwise_equal


@pytest.mark.parametrize("P,M", [(1, 1), (2, 1), (2, 5), (4, 3), (4, 4), (4, 9), (8, 2)])
def test_schedule_structure(P, M):
    for stage in range(P):
        order = schedule_1f1b(P, stage, M)
        warmup = min(P - stage - 1, M)
        assert num_warmup_microbatches(P, stage, M) == warmup
        assert order[:warmup] == [("F", i) for i in range(warmup)]
        assert sorted(order) == sorted([("F", i) for i in range(M)] + [("B", i) for i in range(M)])
        in_flight = 0
        for kind, i in order:
            in_flight += 1 if kind == "F" else -1
            assert 0 <= in_flight <= P - stage  # 1F1B bounds stored activations by P - stage
            if kind == "B":
                assert order.index(("F", i)) < order.index(("B", i))
        assert order[-1] == ("B", M - 1)  # the last microbatch's backward comes last


def test_schedule_validation():
    with pytest.raises(ValueError, match="stage"):
        num_warmup_microbatches(2, 2, 1)
    with pytest.raises(ValueError, match="num_microbatches"):
        num_warmup_microbatches(2, 0, 0)


def _dims(stage=0, pp=2):
    return ParallelDims(pp_size=pp, place=RankPlace(rank=stage, stage=stage,
                                                    pp_ranks=tuple(range(pp))))


def test_forward_backward_validation():
    spec = LinearStackSpec(num_stages=2)
    module = StageModule(spec, 0)
    common = dict(grad_sync=None, activation_shape=spec.activation_shape, loss_fn=None)
    with pytest.raises(ValueError, match="num_microbatches"):
        forward_backward_1f1b(module, parallel_dims=_dims(), num_microbatches=0, **common)
    with pytest.raises(TypeError, match="num_microbatches"):
        forward_backward_1f1b(module, parallel_dims=_dims(), num_microbatches=1.0, **common)
    with pytest.raises(ValueError, match="inputs"):
        forward_backward_1f1b(module, parallel_dims=_dims(), num_microbatches=2, inputs=[1], **common)
    with pytest.raises(ValueError, match="targets"):
        forward_backward_1f1b(module, parallel_dims=_dims(1), num_microbatches=1, targets=[], **common)
    with pytest.raises(ValueError, match="sizes only"):
        forward_backward_1f1b(module, parallel_dims=ParallelDims(pp_size=2), num_microbatches=1,
                              **common)
    interleaved = ParallelDims(pp_size=2, vpp_size=2, place=_dims().place)
    with pytest.raises(ValueError, match="vpp_size is 2: the non-interleaved 1F1B"):
        forward_backward_1f1b(module, parallel_dims=interleaved, num_microbatches=2, **common)


def test_timeline_records():
    timeline = Timeline(3)
    with timeline.record("forward", 2):
        pass
    (event,) = timeline.events
    assert (event.rank, event.kind, event.microbatch) == (3, "forward", 2)
    assert event.end >= event.start
    disabled = Timeline(0, enabled=False)
    with disabled.record("backward"):
        pass
    assert disabled.events == []
    # TimelineEvent's own validation and summarize_step: tests/gradvocab/test_timeline.py


# ---------------------------------------------------------------- gloo: output layer, drain

SPEC = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=8, microbatch_size=4, seed=3)


class HeadStage(nn.Module):
    """The last stage: the Linear stack, then a column-parallel output layer (tp=1)."""

    def __init__(self, defer: bool) -> None:
        from fastgrad.deferred_wgrad import ColumnParallelOutputLayer, EmbeddingWgradConfig

        super().__init__()
        self.body = StageModule(SPEC, 1)
        weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(9)) * 0.3
        config = EmbeddingWgradConfig(defer_embedding_wgrad_compute=defer)
        self.head = ColumnParallelOutputLayer(weight, config, parallel_dims=ParallelDims(pp_size=2))

    def forward(self, x):
        return self.head(self.body(x))


def _sgd(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.sub(p, torch.mul(p.main_grad, 0.1)))


def _head_worker(rank, world_size):
    from fastgrad.ddp import DistributedDataParallel
    from fastgrad.pipeline import finalize_grads
    from gradvocab import Averaging, DDPConfig

    dims = ParallelDims(pp_size=2).build()
    out = {}
    for defer in (True, False):
        for overlap in (True, False):
            module = StageModule(SPEC, 0) if rank == 0 else HeadStage(defer)
            head = None if rank == 0 else module.head
            ddp = DistributedDataParallel(
                module,
                config=DDPConfig(overlap_grad_reduce=overlap, bucket_size=40),
                parallel_dims=dims,
                averaging=Averaging.SUM,
                external_grad_params=[] if head is None else [head.weight],
            )
            record = []
            for step, m in enumerate((3, 1)):
                inputs, targets = microbatch_data(SPEC, 0, step, m)
                if head is not None:
                    head.start_step()
                ddp.zero_grad_buffer()
                losses = forward_backward_1f1b(
                    module,
                    parallel_dims=dims,
                    grad_sync=ddp,
                    num_microbatches=m,
                    activation_shape=SPEC.activation_shape,
                    loss_fn=lambda y, t, m=m: microbatch_loss(y, t, m),
                    inputs=inputs if rank == 0 else None,
                    targets=targets if rank == 1 else None,
                    deferred_wgrad=head,
                )
                grads = {n: p.main_grad.clone() for n, p in module.named_parameters()}
                record.append(([float(v) for v in losses], grads, ddp.last_launch_sites))
                _sgd(module)
            out[(defer, overlap)] = record
    # Tied-embedding all-reduce: first stage's layer 0 weight with the head weight.
    tied = module.layers[0].weight if rank == 0 else module.head.weight

    class _Done:
        def finish_grad_sync(self):
            pass

    before = tied.main_grad.clone()
    finalize_grads(_Done(), dims, [tied])
    out["tied"] = (before, tied.main_grad.clone())
    return out


def _sequential_reference():
    """All microbatches in one process, plain autograd; the head accumulates itself."""
    stage0, stage1 = StageModule(SPEC, 0), HeadStage(defer=False)
    params = list(stage0.named_parameters()) + list(stage1.named_parameters())
    record = []
    for step, m in enumerate((3, 1)):
        stage1.head.weight.main_grad.zero_()
        for _, p in params:
            p.grad = None
        inputs, targets = microbatch_data(SPEC, 0, step, m)
        losses = []
        for x, t in zip(inputs, targets):
            loss = microbatch_loss(stage1(stage0(x)), t, m)
            loss.backward()
            losses.append(float(loss.detach()))
        for name, p in params:
            if name != "head.weight":
                p.main_grad = p.grad.clone()
        record.append((losses, {n: p.main_grad.clone() for n, p in stage0.named_parameters()},
                       {n: p.main_grad.clone() for n, p in stage1.named_parameters()}))
        _sgd(stage0)
        _sgd(stage1)
    return record


@pytest.mark.dist
def test_pipeline_with_deferred_output_layer_wgrad_matches_sequential():
    results = run_distributed(_head_worker, 2)
    reference = _sequential_reference()
    for key in [(True, True), (True, False), (False, True), (False, False)]:
        for step, (ref_losses, ref0, ref1) in enumerate(reference):
            losses, grads1, sites1 = results[1][key][step]
            _, grads0, _ = results[0][key][step]
            assert losses == ref_losses, (key, step)
            for name, value in ref0.items():
                assert_bitwise_equal(grads0[name], value, msg=str((key, step, name)))
            for name, value in ref1.items():
                assert_bitwise_equal(grads1[name], value, msg=str((key, step, name)))
            if key[1] and step > 0:
                # The head's bucket waits for the drain's mark; nothing launches in finish.
                assert "finish" not in sites1, sites1
    a_before, a_after = results[0]["tied"]
    b_before, b_after = results[1]["tied"]
    expected = a_before + b_before
    assert_bitwise_equal(a_after, expected)
    assert_bitwise_equal(b_after, expected)


def test_receive_buffers_live_on_the_stage_modules_device():
    """NCCL rejects CPU receive buffers: received activations follow the module's device."""
    from fastgrad.pipeline import activation_device

    module = torch.nn.Linear(2, 2)
    assert activation_device([module], None) == torch.device("cpu")
    assert activation_device([torch.nn.ReLU(), module.to("meta")], None) == torch.device("meta")
    assert activation_device([torch.nn.ReLU()], None) == torch.device("cpu")
    assert activation_device([module], "meta") == torch.device("meta")

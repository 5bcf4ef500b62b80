"""fastgrad.pipeline_interleaved: interleaved 1F1B with per-chunk grad sync.

Expected values: hand-derived program orders, the independent discrete-event
simulator (``verify.studies.pipeline``) against the closed-form bubble ``(P-1)/(V*M+P-1)``,
and ``refgrad.pipeline.reference_training`` on the same ``P*V``-stage model
(one process, microbatches in order) for losses, reduced grads and updated
parameters, bitwise, for ``D <= 2`` (a sum of two fp32 values has one rounding).
"""

from fractions import Fraction

import pytest
import torch.distributed as dist
from distributed_utils import run_distributed

from fastgrad.pipeline_interleaved import (
    chunk_and_microbatch,
    forward_backward_interleaved,
    num_warmup_microbatches_interleaved,
    schedule_interleaved,
    validate_interleaving,
)
from gradvocab import Averaging, ParallelDims, RankPlace
from refgrad.pipeline import (
    LinearStackSpec,
    StageModule,
    StepPlan,
    interleaved_program_order,
    reference_training,
    stage_param_name,
)
from verify.candidates.fastgrad.pipeline import run_interleaved_case_on_rank
from verify.candidates.interfaces import PipelineCase
from verify.metrics import assert_bitwise_equal
from verify.studies.pipeline import PipelineCosts, simulate

# ---------------------------------------------------------------- schedule order


def test_hand_derived_order_p2_v2_m4():
    # P=2, V=2, M=4: 8 virtual microbatches per rank, groups of P*V = 4.
    # forward k -> (chunk, mb): 0:(0,0) 1:(0,1) 2:(1,0) 3:(1,1) 4:(0,2) 5:(0,3) 6:(1,2) 7:(1,3)
    # backward k (chunks reversed): 0:(1,0) 1:(1,1) 2:(0,0) 3:(0,1) 4:(1,2) 5:(1,3) 6:(0,2) 7:(0,3)
    # warmup: stage 0: (2-0-1)*2 + (2-1)*2 = 4; stage 1: 0 + 2 = 2.
    # stage 0: F00 F01 F10 F11 | F02 B10 F03 B11 F12 B00 F13 B01 | B12 B13 B02 B03
    # stage 1: F00 F01 | F10 B10 F11 B11 F02 B00 F03 B01 F12 B12 F13 B13 | B02 B03
    def ops(text):
        return [(t[0], int(t[1]), int(t[2])) for t in text.split()]

    assert schedule_interleaved(2, 0, 2, 4) == ops(
        "F00 F01 F10 F11 F02 B10 F03 B11 F12 B00 F13 B01 B12 B13 B02 B03")
    assert schedule_interleaved(2, 1, 2, 4) == ops(
        "F00 F01 F10 B10 F11 B11 F02 B00 F03 B01 F12 B12 F13 B13 B02 B03")


def test_hand_derived_chunk_ids_and_warmup():
    # P=2, V=3: groups of 6 virtual microbatches; forward chunk = (k % 6) // 2.
    assert [chunk_and_microbatch(2, 3, k, forward=True) for k in range(8)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (0, 2), (0, 3)]
    assert [chunk_and_microbatch(2, 3, k, forward=False) for k in range(8)] == [
        (2, 0), (2, 1), (1, 0), (1, 1), (0, 0), (0, 1), (2, 2), (2, 3)]
    # P=4, V=2, M=4: (P-s-1)*2 + (V-1)*P = 10, 8, 6, 4, capped at M*V = 8.
    assert [num_warmup_microbatches_interleaved(4, s, 2, 4) for s in range(4)] == [8, 8, 6, 4]
    # P=4, V=3, M=8: 6+8, 4+8, 2+8, 0+8 (cap 24 not reached).
    assert [num_warmup_microbatches_interleaved(4, s, 3, 8) for s in range(4)] == [14, 12, 10, 8]


@pytest.mark.parametrize("P,V,M", [(2, 1, 2), (2, 2, 2), (2, 3, 6), (3, 2, 3), (4, 2, 4),
                                   (4, 2, 8), (4, 3, 12)])
def test_schedule_structure(P, V, M):
    for stage in range(P):
        order = schedule_interleaved(P, stage, V, M)
        expected = [(k, c, m) for k in "FB" for c in range(V) for m in range(M)]
        assert sorted(order) == sorted(expected)
        for _, c, m in order:
            assert order.index(("F", c, m)) < order.index(("B", c, m))
        # Microbatches pass through each chunk in increasing order, both directions.
        for kind in "FB":
            for c in range(V):
                assert [m for k, cc, m in order if k == kind and cc == c] == list(range(M))
        assert order[-1] == ("B", 0, M - 1)


def test_validation_errors():
    with pytest.raises(ValueError, match=r"num_microbatches \(3\) must be a multiple of pp_size \(2\)"):
        validate_interleaving(2, 2, 3)
    with pytest.raises(ValueError, match="virtual_stages must be >= 1"):
        validate_interleaving(2, 0, 4)
    with pytest.raises(ValueError, match="pp_size must be >= 2"):
        validate_interleaving(1, 2, 4)
    with pytest.raises(TypeError, match="num_microbatches"):
        validate_interleaving(2, 2, 4.0)
    with pytest.raises(ValueError, match="stage"):
        num_warmup_microbatches_interleaved(2, 2, 2, 4)
    with pytest.raises(ValueError, match="multiple of pp_size"):
        schedule_interleaved(4, 0, 2, 6)


def _dims(stage=0, pp=2, vpp=2):
    return ParallelDims(pp_size=pp, vpp_size=vpp,
                        place=RankPlace(rank=stage, stage=stage, pp_ranks=tuple(range(pp))))


def test_forward_backward_validation():
    spec = LinearStackSpec(num_stages=4)
    chunks = [StageModule(spec, 0), StageModule(spec, 2)]
    common = dict(activation_shape=spec.activation_shape, loss_fn=None)
    with pytest.raises(ValueError, match="virtual_stages >= 1"):
        forward_backward_interleaved([], parallel_dims=_dims(), grad_syncs=[], num_microbatches=2,
                                     **common)
    with pytest.raises(ValueError, match="grad_syncs must hold one engine per model chunk"):
        forward_backward_interleaved(chunks, parallel_dims=_dims(), grad_syncs=[None],
                                     num_microbatches=2, **common)
    with pytest.raises(ValueError, match="multiple of pp_size"):
        forward_backward_interleaved(chunks, parallel_dims=_dims(), grad_syncs=[None, None],
                                     num_microbatches=3, **common)
    with pytest.raises(ValueError, match="inputs"):
        forward_backward_interleaved(chunks, parallel_dims=_dims(), grad_syncs=[None, None],
                                     num_microbatches=2, inputs=[1], **common)
    with pytest.raises(ValueError, match="targets"):
        forward_backward_interleaved(chunks, parallel_dims=_dims(1), grad_syncs=[None, None],
                                     num_microbatches=2, targets=[], **common)
    with pytest.raises(ValueError, match="holds 2 model chunks but parallel_dims.vpp_size is 3"):
        forward_backward_interleaved(chunks, parallel_dims=_dims(vpp=3), grad_syncs=[None, None],
                                     num_microbatches=2, **common)


# ---------------------------------------------------------------- bubble vs closed form


@pytest.mark.parametrize("P,V,M", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 4, 16), (8, 2, 16)])
def test_bubble_matches_closed_form_for_equal_costs(P, V, M):
    # The discrete-event simulator derives its interleaved order independently;
    # it must equal fastgrad's, and that order must reach the closed-form bubble.
    # Per-stage costs V give per-chunk costs 1 (every time an exact float).
    for stage in range(P):
        assert interleaved_program_order(P, stage, M, V) == schedule_interleaved(P, stage, V, M)
    r = simulate(P, M, PipelineCosts(forward=V, backward=V), virtual_stages=V)
    assert r.step_time == (V * M + P - 1) * 2
    assert 1 - Fraction(M * V * 2) / Fraction(r.step_time) == Fraction(P - 1, V * M + P - 1)


# ---------------------------------------------------------------- gloo, bitwise vs refgrad

LR = 0.05
# (name, P, D, V, plans); the frozen parameter is named by its virtual stage.
CASES = (
    [
        ("p2d2v2", 2, 2, 2, (StepPlan(4), StepPlan(2), StepPlan(
            6, frozenset({stage_param_name(1, "layers.0.weight")})))),
        ("p2d2v3", 2, 2, 3, (StepPlan(2), StepPlan(4))),
        ("p2d2v1", 2, 2, 1, (StepPlan(2), StepPlan(4))),  # degenerate: 2(P-s-1) warmup
    ],
    [
        ("p4d1v2", 4, 1, 2, (StepPlan(8), StepPlan(4, frozenset({stage_param_name(6,
                                                                   "layers.0.bias")})))),
    ],
)


def _spec(P, V):
    return LinearStackSpec(num_stages=P * V, layers_per_stage=1, hidden=8, microbatch_size=4, seed=5)


def _case(name, P, D, V, plans):
    # Scaffolding shared with the ``pipeline`` check: one DDP per chunk, SGD, recording syncs.
    return PipelineCase(name, ParallelDims(pp_size=P, dp_size=D, vpp_size=V), _spec(P, V), plans,
                        bucket_size=40, lr=LR)


def _interleaved_worker(rank, world_size):
    results = {}
    for phase in CASES:
        for name, P, D, V, plans in phase:
            case = _case(name, P, D, V, plans)
            grid = case.dims.build()
            for overlap in (True, False):
                results[(name, overlap)] = run_interleaved_case_on_rank(case, grid, overlap)
            dist.barrier()
    return results


@pytest.mark.dist
def test_interleaved_matches_refgrad_bitwise():
    per_rank = run_distributed(_interleaved_worker, 4)
    for phase in CASES:
        for name, P, D, V, plans in phase:
            reference = reference_training(_spec(P, V), plans, D, lr=LR, reduction=Averaging.SUM)
            for overlap in (True, False):
                for rank in range(P * D):
                    out = per_rank[rank][(name, overlap)]
                    stage, dp_rank = out.stage, out.dp_rank
                    for step in range(len(plans)):
                        where = (name, overlap, rank, step)
                        if stage == P - 1:
                            assert out.losses[step] == reference.losses[step][dp_rank], where
                        else:
                            assert out.losses[step] == [], where
                        for param, grad in out.grads[step].items():
                            assert_bitwise_equal(grad, reference.grads[step][param], msg=str((where, param)))
                        for param, value in out.params[step].items():
                            assert_bitwise_equal(value, reference.params[step][param], msg=str((where, param)))
                        assert len(out.grads[step]) == 2 * V  # weight and bias per chunk
                        sites = set(out.launch_sites[step])
                        assert sites == ({"hook"} if overlap else {"finish"}), (where, sites)
                        # Chunks enable in reverse order, once each; with overlap, chunk
                        # V-1's buckets are already reducing when chunk 0 starts its last
                        # backward (the sync hides behind the other chunks' cooldown).
                        enables = out.chunk_enables[step]
                        assert [c for c, _ in enables] == list(range(V - 1, -1, -1)), where
                        if V > 1:
                            assert enables[-1][1][V - 1] is overlap, where

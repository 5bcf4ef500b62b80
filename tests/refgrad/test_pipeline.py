"""refgrad.pipeline: the one-process reference of a pipelined, data-parallel step."""

import dataclasses

import pytest
import torch

from gradvocab import Averaging
from refgrad.exact import correctly_rounded_sum
from refgrad.pipeline import (
    EMBEDDING_PARAM,
    HEAD_PARAM,
    LinearStackSpec,
    StageModule,
    StepPlan,
    VocabParallelFirstLayer,
    expected_on_rank,
    head_weight_init,
    loss_target,
    microbatch_data,
    microbatch_loss,
    rank_microbatches,
    reduce_across_replicas,
    reduce_and_tie,
    reference_training,
    replica_grad_sums,
    sequence_shard,
    sgd_update,
    splits_loss,
    stage_loss,
    stage_param_name,
    updated_once,
    vocab_block,
)
from verify.metrics import assert_bitwise_equal, bitwise_equal

ULP1 = 2.0**-23  # spacing of fp32 just above 1.0


def _t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_reduce_across_replicas_hand_values():
    # 1 + ulp/2 is a tie: rounds to even (1.0). 1 + 1.5 ulp is a tie between
    # 1 + ulp and 1 + 2 ulp: rounds to the even 1 + 2 ulp.
    got = reduce_across_replicas([_t(1.0, 1.0, 7.0), _t(ULP1 / 2, 1.5 * ULP1, -7.0)], Averaging.SUM)
    assert_bitwise_equal(got, _t(1.0, 1.0 + 2 * ULP1, 0.0))
    assert_bitwise_equal(reduce_across_replicas([_t(1.0, 3.0), _t(3.0, 4.0)], Averaging.AVG), _t(2.0, 3.5))
    assert_bitwise_equal(reduce_across_replicas([_t(3.0, 1.0), _t(5.0, 2.0)], Averaging.PRESCALE), _t(4.0, 1.5))
    single = _t(1.5, -2.0)
    assert_bitwise_equal(reduce_across_replicas([single], Averaging.PRESCALE), single)


def test_reduce_across_replicas_keeps_shape_and_rejects_bad_input():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert_bitwise_equal(reduce_across_replicas([a, a], Averaging.SUM), 2 * a)
    with pytest.raises(ValueError, match="reduction"):
        reduce_across_replicas([a], "max")
    with pytest.raises(ValueError, match="reduction must be one of Averaging"):
        reduce_across_replicas([a], "sum")  # the type, not its old string
    with pytest.raises(ValueError, match="reduction must be one of Averaging"):
        reduce_across_replicas([a, a], Averaging.POSTSCALE)  # no pipeline post-scales
    with pytest.raises(ValueError, match="at least one"):
        reduce_across_replicas([], Averaging.SUM)


def test_grads_are_summed_in_microbatch_order():
    spec = LinearStackSpec(num_stages=2, seed=4)
    ref = reference_training(spec, [StepPlan(3)], dp_size=1)
    inputs, targets = microbatch_data(spec, 0, 0, 3)
    per_microbatch = []
    for x, t in zip(inputs, targets):
        stages = [StageModule(spec, s) for s in range(2)]  # fresh weights each time
        microbatch_loss(stages[1](stages[0](x)), t, 3).backward()
        per_microbatch.append({stage_param_name(s, n): p.grad for s, m in enumerate(stages)
                               for n, p in m.named_parameters()})
    for name, got in ref.grads[0].items():
        expected = (per_microbatch[0][name] + per_microbatch[1][name]) + per_microbatch[2][name]
        assert_bitwise_equal(got, expected, msg=str(name))


def test_frozen_parameter_gets_zero_grad_and_no_update_and_replicas_differ():
    spec = LinearStackSpec(num_stages=2, seed=2)
    frozen = stage_param_name(1, "layers.0.bias")
    ref = reference_training(spec, [StepPlan(2), StepPlan(1, frozenset({frozen}))], dp_size=2)
    assert torch.count_nonzero(ref.grads[1][frozen]) == 0
    assert_bitwise_equal(ref.params[1][frozen], ref.params[0][frozen])
    other = stage_param_name(0, "layers.0.weight")
    assert not bitwise_equal(ref.params[1][other], ref.params[0][other])
    assert_bitwise_equal(ref.params[0][other], sgd_update(StageModule(spec, 0).layers[0].weight.detach(),
                                                          ref.grads[0][other], 0.05))
    assert ref.losses[0][0] != ref.losses[0][1]  # rank-specific data
    assert [len(step[0]) for step in ref.losses] == [2, 1]


def test_sgd_update_has_two_visible_roundings():
    # Hand-derived: fp32(0.1) = 13421773 * 2^-27; * 7 = 93952411 * 2^-27 rounds (ulp 2^-24 in
    # [1/2, 1)) to 11744051 * 2^-24; 1 - that = 5033165 * 2^-24 exactly. A fused multiply-add
    # would round 1 - 93952411 * 2^-27 = 40265317 * 2^-27 once: 10066329 * 2^-25, a different value.
    assert_bitwise_equal(sgd_update(_t(1.0), _t(7.0), 0.1), _t(5033165 * 2.0**-24))
    assert 5033165 * 2.0**-24 != 10066329 * 2.0**-25


def test_validation():
    with pytest.raises(ValueError, match="num_stages"):
        LinearStackSpec(num_stages=0)
    with pytest.raises(TypeError, match="hidden"):
        LinearStackSpec(num_stages=1, hidden=2.0)
    with pytest.raises(ValueError, match="seed"):
        LinearStackSpec(num_stages=1, seed=-1)
    with pytest.raises(ValueError, match="num_microbatches"):
        StepPlan(0)
    with pytest.raises(ValueError, match="stage"):
        StageModule(LinearStackSpec(num_stages=2), 2)
    with pytest.raises(ValueError, match="unknown"):
        reference_training(LinearStackSpec(num_stages=1), [StepPlan(1, frozenset({"nope"}))], 1)
    with pytest.raises(ValueError, match="dp_size"):
        reference_training(LinearStackSpec(num_stages=1), [StepPlan(1)], 0)
    with pytest.raises(ValueError, match="reduction"):
        reference_training(LinearStackSpec(num_stages=1), [StepPlan(1)], 1, reduction="max")
    with pytest.raises(ValueError, match="lr"):
        reference_training(LinearStackSpec(num_stages=1), [StepPlan(1)], 1, lr=float("inf"))


def test_tied_output_head_copies_stay_equal_and_get_the_summed_grad():
    spec = LinearStackSpec(num_stages=2, seed=5, output_head=True, tied_embedding=True)
    ref = reference_training(spec, [StepPlan(3), StepPlan(2)], dp_size=2)
    head, emb = stage_param_name(1, HEAD_PARAM), stage_param_name(0, EMBEDDING_PARAM)
    for step in range(2):
        assert_bitwise_equal(ref.grads[step][head], ref.grads[step][emb])
        assert_bitwise_equal(ref.params[step][head], ref.params[step][emb])
        # Per copy: DP-reduce first, then the embedding all-reduce adds the two copies.
        sums = ref.replica_sums[step]
        expected = correctly_rounded_sum(
            [reduce_across_replicas([s[emb] for s in sums], Averaging.SUM),
             reduce_across_replicas([s[head] for s in sums], Averaging.SUM)], torch.float32)
        assert_bitwise_equal(ref.grads[step][emb], expected)
    assert torch.count_nonzero(ref.replica_sums[0][0][head]) > 0


def test_tied_on_one_stage_is_one_weight_head_wgrad_then_first_layer_grad_per_microbatch():
    """Production's PP 1: per microbatch ``acc = (acc + Gᵀ·X) + grad_first``, no all-reduce;
    by hand with the head's use detached, so each contribution is computed on its own."""
    spec = LinearStackSpec(num_stages=1, seed=7, output_head=True, tied_embedding=True,
                           defer_output_wgrad=False)
    assert spec.shares_one_weight
    ref = reference_training(spec, [StepPlan(3)], dp_size=1)
    head, emb = stage_param_name(0, HEAD_PARAM), stage_param_name(0, EMBEDDING_PARAM)
    stage = StageModule(spec, 0)
    weight = stage.layers[0].weight
    inputs, targets = microbatch_data(spec, 0, 0, 3)
    expected, other_order = torch.zeros_like(weight), torch.zeros_like(weight)
    for x, t in zip(inputs, targets):
        stage.zero_grad()
        hidden = stage(x)
        hidden.retain_grad()
        logits = torch.matmul(hidden, weight.detach().t())
        logits.retain_grad()
        microbatch_loss(logits, t, 3).backward()
        head_wgrad = torch.mm(logits.grad.t(), hidden.detach())
        expected = (expected + head_wgrad) + weight.grad
        other_order = (other_order + weight.grad) + head_wgrad
    assert_bitwise_equal(ref.grads[0][emb], expected)
    assert_bitwise_equal(ref.grads[0][head], expected)
    assert not bitwise_equal(expected, other_order)  # the order shows at these values


def test_head_wgrad_is_the_microbatch_ordered_sum_of_gemms():
    spec = LinearStackSpec(num_stages=2, seed=6, output_head=True)
    ref = reference_training(spec, [StepPlan(2)], dp_size=1)
    inputs, targets = microbatch_data(spec, 0, 0, 2)
    expected = torch.zeros(spec.hidden, spec.hidden)
    weight = head_weight_init(spec)
    for x, t in zip(inputs, targets):
        stages = [StageModule(spec, s) for s in range(2)]
        hidden = stages[1](stages[0](x)).detach().requires_grad_(True)
        logits = torch.matmul(hidden, weight.t())
        logits.retain_grad()
        microbatch_loss(logits, t, 2).backward()
        expected = expected + torch.mm(logits.grad.t(), hidden.detach())
    assert_bitwise_equal(ref.grads[0][stage_param_name(1, HEAD_PARAM)], expected)


def test_head_flags_validation():
    with pytest.raises(ValueError, match="tied_embedding"):
        LinearStackSpec(num_stages=2, tied_embedding=True)
    with pytest.raises(ValueError, match="output_head"):
        LinearStackSpec(num_stages=1, output_head=True)
    with pytest.raises(TypeError, match="output_head"):
        LinearStackSpec(num_stages=2, output_head=1)


def test_tensor_parallel_spec_rules_and_hand_checked_tp_sums():
    """TP 2: the head's vocabulary and (SP) the rows split over TP; the TP sums are one add."""


    with pytest.raises(ValueError, match=r"hidden \(5\) must be divisible by tensor_parallel"):
        LinearStackSpec(num_stages=2, hidden=5, output_head=True, tied_embedding=True,
                        tensor_parallel=2)
    with pytest.raises(ValueError, match="sequence_parallel needs tensor_parallel > 1"):
        LinearStackSpec(num_stages=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="microbatch_size .3. must be divisible"):
        LinearStackSpec(num_stages=2, microbatch_size=3, tensor_parallel=2, sequence_parallel=True)
    spec = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=4, microbatch_size=2,
                           tensor_parallel=2, sequence_parallel=True, output_head=True)
    assert spec.stage_activation_shape == (1, 4) and splits_loss(spec)
    x = torch.arange(8.0).reshape(2, 4)
    assert sequence_shard(spec, x, 1).tolist() == [[4.0, 5.0, 6.0, 7.0]]
    assert loss_target(spec, x, 1).tolist() == [[2.0, 3.0], [6.0, 7.0]]  # vocab block 1
    # Partial loss over a block: sum of squares / (rows * V) / M, by hand: (4 + 9) / 8 / 2.
    assert float(stage_loss(spec, torch.tensor([[2.0], [3.0]]), torch.zeros(2, 1), 2)) == 13 / 16
    # Under SP each block parameter's per-replica sum has one row per TP rank, and the
    # reduction adds them after the DP sum: reduced = sum_k (sum_d g[d][k]) (one add each).
    spec = dataclasses.replace(spec, output_head=False)  # the loss split over sequence shards
    stages = [StageModule(spec, s) for s in range(2)]
    named = {stage_param_name(s, n): p for s, st in enumerate(stages) for n, p in st.named_parameters()}
    sums, losses = replica_grad_sums(spec, stages, named, None, 0, 2, 1)
    name = stage_param_name(0, "layers.0.weight")
    assert sums[0][name].shape == (2, 4, 4) and len(losses[0]) == 2
    reduced = reduce_and_tie(spec, sums, Averaging.SUM)
    assert_bitwise_equal(reduced[name], sums[0][name][0] + sums[0][name][1])


def test_tied_first_layer_at_tp2_is_a_vocab_parallel_embedding_by_hand():
    """Tied at TP 2: stage 0's first layer is ``x · W + b`` with W's rows split over TP as the
    head's; each rank's wgrad is ``x_kᵀ · G`` (small integers: every product and sum exact)."""
    spec = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=4, microbatch_size=2,
                           output_head=True, tied_embedding=True, tensor_parallel=2)
    assert spec.vocab_parallel_embedding
    first = StageModule(spec, 0).layers[0]
    assert isinstance(first, VocabParallelFirstLayer)
    x = torch.tensor([[1.0, -2.0, 0.0, 3.0], [2.0, 1.0, -1.0, 0.0]])
    assert vocab_block(spec, x, 1).tolist() == [[0.0, 3.0], [-1.0, 0.0]]
    weight = torch.arange(16.0).reshape(4, 4) - 5
    bias = torch.tensor([1.0, 0.0, -1.0, 2.0])
    layer = VocabParallelFirstLayer(spec, weight, bias)
    out = layer(x)
    assert_bitwise_equal(out, (x.double() @ weight.double() + bias.double()).float())
    grad = torch.tensor([[1.0, 0.0, 2.0, -1.0], [0.0, 3.0, 1.0, 1.0]])
    out.backward(grad)
    assert_bitwise_equal(layer.weight.grad, (x.double().t() @ grad.double()).float())
    assert_bitwise_equal(layer.bias.grad, grad.sum(0))
    # Each TP rank holds its rows of the first layer, as of the head: same shard shape.
    name = stage_param_name(0, "layers.0.weight")
    assert_bitwise_equal(expected_on_rank(spec, name, weight, 1), weight[2:])
    assert_bitwise_equal(expected_on_rank(spec, stage_param_name(0, "layers.0.bias"), bias, 1), bias)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tied_tp2_copies_stay_equal_and_sp_keeps_one_embedding_grad(sequence_parallel):
    """Tied at TP 2 (SP or not): both copies get reduced_first + reduced_head, and under SP the
    embedding's grad is one sum over all rows (no per-shard split), unlike the blocks'."""
    spec = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=4, microbatch_size=2,
                           seed=3, output_head=True, tied_embedding=True, tensor_parallel=2,
                           sequence_parallel=sequence_parallel)
    ref = reference_training(spec, [StepPlan(3), StepPlan(2)], dp_size=2, reduction=Averaging.PRESCALE)
    head, emb = stage_param_name(1, HEAD_PARAM), stage_param_name(0, EMBEDDING_PARAM)
    for step in range(2):
        sums = ref.replica_sums[step]
        assert sums[0][emb].shape == (4, 4)  # not (2, 4, 4): TP-split, not per sequence shard
        assert sums[0][stage_param_name(0, "layers.0.bias")].dim() == (2 if sequence_parallel else 1)
        expected = correctly_rounded_sum(
            [reduce_across_replicas([s[emb] for s in sums], Averaging.PRESCALE),
             reduce_across_replicas([s[head] for s in sums], Averaging.PRESCALE)], torch.float32)
        assert_bitwise_equal(ref.grads[step][emb], expected)
        assert_bitwise_equal(ref.grads[step][head], expected)
        assert_bitwise_equal(ref.params[step][head], ref.params[step][emb])


def test_updated_once_steps_a_shared_weight_once_and_no_frozen_one():
    """By hand: a weight under two names is stepped once (first name kept), a frozen name
    never, the rest in name order."""
    a, b, c = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    named = {"s0.a": a, "s1.tied": b, "s0.tied": b, "s1.c": c}
    got = updated_once(named, frozen={"s1.c"})
    assert len(got) == 2 and got[0] is a and got[1] is b
    assert updated_once(named, frozen={"s1.tied"}) == [a, b, c]  # still stepped by its other name


def test_rank_microbatches_is_this_ranks_shard_of_the_replicas_data():
    """TP 2 with SP: each rank gets its replica's microbatches (``microbatch_data`` at its DP
    rank), its sequence rows of the inputs, its vocab block of the targets, and the partial
    loss; at TP 1 the whole microbatch."""
    spec = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=4, microbatch_size=2,
                           tensor_parallel=2, sequence_parallel=True, output_head=True)
    inputs, targets, loss_fn = rank_microbatches(spec, 1, 0, 0, 2)  # DP rank 1, TP rank 0
    whole_in, whole_tg = microbatch_data(spec, 1, 0, 2)
    assert len(inputs) == len(targets) == 2
    for k in range(2):
        assert_bitwise_equal(inputs[k], sequence_shard(spec, whole_in[k], 0))
        assert_bitwise_equal(targets[k], loss_target(spec, whole_tg[k], 0))
        assert inputs[k].shape == (1, 4) and targets[k].shape == (2, 2)
    out = torch.ones(2, 2)
    assert float(loss_fn(out, targets[0])) == float(stage_loss(spec, out, targets[0], 2))
    plain = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=4, microbatch_size=2)
    inputs, targets, _ = rank_microbatches(plain, 0, 0, 3, 1)
    whole_in, whole_tg = microbatch_data(plain, 0, 3, 1)
    assert_bitwise_equal(inputs[0], whole_in[0])
    assert_bitwise_equal(targets[0], whole_tg[0])

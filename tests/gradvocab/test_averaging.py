"""gradvocab.averaging: the one type for how DP grads are averaged, its factors by hand.

Expected values are derived by hand: over dp replicas the mean is the sum times 1/dp, applied
before the collective (PRESCALE: Megatron-Core's ``gradient_scaling_factor = 1.0 /
data_parallel_world_size``), after it (POSTSCALE: FSDP2's post-division under a forced SUM), or
by the collective itself (AVG: ``ReduceOp.AVG``, no multiplier); dp 1 multiplies by nothing.
"""

import json

import pytest
import torch.distributed as dist

from gradvocab import Averaging, AveragingFactors, MegatronAveragingFlags

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


@pytest.mark.parametrize("averaging, dp, op, pre, post", [
    (Averaging.SUM, 3, SUM, None, None),
    (Averaging.AVG, 3, AVG, None, None),
    (Averaging.PRESCALE, 3, SUM, 1 / 3, None),
    (Averaging.PRESCALE, 4, SUM, 0.25, None),
    (Averaging.POSTSCALE, 3, SUM, None, 1 / 3),
    (Averaging.POSTSCALE, 8, SUM, None, 0.125),
    (Averaging.PRESCALE, 1, SUM, None, None),   # x * 1.0 is x: no multiplier at all
    (Averaging.POSTSCALE, 1, SUM, None, None),
    (Averaging.AVG, 1, AVG, None, None),        # the op asked for, as Megatron-Core passes it
    (Averaging.SUM, 1, SUM, None, None),
])
def test_factors_by_hand(averaging, dp, op, pre, post):
    assert averaging.factors(dp) == AveragingFactors(op, pre_scale=pre, post_scale=post)
    assert averaging.reduce_op == op


def test_which_ways_average():
    assert [a for a in Averaging if not a.averages] == [Averaging.SUM]


def test_the_names_are_the_old_strings_in_reports_and_json():
    # refgrad's and the reports' names, unchanged: equal to, printed and serialised as them
    assert [a.value for a in Averaging] == ["sum", "avg", "prescale", "postscale"]
    assert Averaging("prescale") is Averaging.PRESCALE and Averaging.AVG == "avg"
    assert f"{Averaging.PRESCALE}" == str(Averaging.PRESCALE) == "prescale"
    assert json.dumps({"reduction": Averaging.AVG}) == '{"reduction": "avg"}'
    assert {"sum": 1, "avg": 2}[Averaging.AVG] == 2 and {Averaging.SUM: 1}["sum"] == 1


def test_torch_ops_convert_both_ways():
    assert Averaging.from_reduce_op(SUM) is Averaging.SUM
    assert Averaging.from_reduce_op(AVG) is Averaging.AVG
    with pytest.raises(ValueError, match="op must be ReduceOp.SUM or ReduceOp.AVG"):
        Averaging.from_reduce_op(dist.ReduceOp.MAX)


@pytest.mark.parametrize("average, in_collective, expected", [
    (False, False, Averaging.SUM),       # calculate_per_token_loss: the grads are summed
    (True, False, Averaging.PRESCALE),   # Megatron-Core's default 1/dp scaling factor
    (True, True, Averaging.AVG),         # --ddp-average-in-collective
])
def test_megatron_flags_convert_in_one_place(average, in_collective, expected):
    assert Averaging.from_megatron(average=average, average_in_collective=in_collective) is expected


# By hand from DistributedDataParallel.__init__: per-token loss leaves the grads summed;
# average_in_collective averages in ReduceOp.AVG; neither is the 1/dp scaling factor.
MEGATRON_FLAGS = {
    Averaging.SUM: MegatronAveragingFlags(average_in_collective=False, calculate_per_token_loss=True),
    Averaging.AVG: MegatronAveragingFlags(average_in_collective=True, calculate_per_token_loss=False),
    Averaging.PRESCALE: MegatronAveragingFlags(average_in_collective=False,
                                               calculate_per_token_loss=False),
}


@pytest.mark.parametrize("averaging", list(MEGATRON_FLAGS))
def test_megatron_flags_are_the_inverse_of_from_megatron(averaging):
    flags = averaging.megatron_flags()
    assert flags == MEGATRON_FLAGS[averaging]
    assert flags.average is (averaging is not Averaging.SUM)
    assert Averaging.from_megatron(average=flags.average,
                                   average_in_collective=flags.average_in_collective) is averaging


def test_postscale_and_contradictory_megatron_flags_are_refused():
    with pytest.raises(ValueError, match="POSTSCALE has no Megatron-Core flags"):
        Averaging.POSTSCALE.megatron_flags()
    with pytest.raises(ValueError, match="exclude each other"):
        MegatronAveragingFlags(average_in_collective=True, calculate_per_token_loss=True)
    with pytest.raises(TypeError, match="calculate_per_token_loss must be a bool"):
        MegatronAveragingFlags(average_in_collective=False, calculate_per_token_loss=0)


def test_contradictions_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="cannot be combined with average=False"):
        Averaging.from_megatron(average=False, average_in_collective=True)
    with pytest.raises(TypeError, match="average must be a bool"):
        Averaging.from_megatron(average=1, average_in_collective=False)
    for dp in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="dp_size must be an int >= 1"):
            Averaging.PRESCALE.factors(dp)
    with pytest.raises(ValueError, match="op must be ReduceOp.SUM or ReduceOp.AVG"):
        AveragingFactors(dist.ReduceOp.MAX)
    with pytest.raises(ValueError, match="pre_scale goes with a SUM collective"):
        AveragingFactors(AVG, pre_scale=0.5)
    with pytest.raises(ValueError, match="exclude each other"):
        AveragingFactors(SUM, pre_scale=0.5, post_scale=0.5)
    with pytest.raises(ValueError, match=r"post_scale must be None or a float in \(0, 1\)"):
        AveragingFactors(SUM, post_scale=1.0)

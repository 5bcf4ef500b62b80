"""fastgrad.averaging: the one decision of how data-parallel grads are averaged.

Expected plans: Megatron-Core's ``DistributedDataParallel.__init__``
(``megatron/core/distributed/distributed_data_parallel.py``: ``gradient_scaling_factor =
1.0`` with ``average_in_collective``, else ``1.0 / data_parallel_world_size``) and
``_ParamAndGradBucketGroup.start_grad_sync`` (``param_and_grad_buffer.py``: ``grad_data *=
gradient_scaling_factor`` unless it is 1.0, then ``ReduceOp.AVG`` with
``average_in_collective``, else ``SUM``); fastgrad's own rule on top: with the
fp32-accumulating reduce-scatter the pre-scale happens inside the collective (same bits,
tests/fastgrad/test_reduce_scatter.py). The bits of every path are held to refgrad by
test_ddp.py, test_buffer.py and test_reduce_scatter.py.
"""

import pytest
import torch.distributed as dist

from fastgrad.averaging import GradAveraging, PrescaleSite, grad_averaging
from gradvocab import Averaging, DDPConfig

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
DIST_OPT = dict(use_distributed_optimizer=True)
FP32_RS = dict(use_distributed_optimizer=True, reduce_scatter_with_fp32_accumulation=True)


SUM_, AVG_, PRESCALE = Averaging.SUM, Averaging.AVG, Averaging.PRESCALE


@pytest.mark.parametrize("config, dp, averaging, how, op, prescale, site", [
    (dict(), 4, SUM_, SUM_, SUM, None, None),                       # a sum: nothing scaled
    (dict(), 4, None, PRESCALE, SUM, 0.25, PrescaleSite.BUCKET),    # Megatron's default: 1/dp first
    (dict(), 4, PRESCALE, PRESCALE, SUM, 0.25, PrescaleSite.BUCKET),
    (DIST_OPT, 3, None, PRESCALE, SUM, 1 / 3, PrescaleSite.BUCKET),
    (FP32_RS, 4, None, PRESCALE, SUM, 0.25, PrescaleSite.COLLECTIVE),  # folded into the fp32 reduction
    (FP32_RS, 4, SUM_, SUM_, SUM, None, None),
    (dict(average_in_collective=True), 4, None, AVG_, AVG, None, None),
    (dict(average_in_collective=True), 4, AVG_, AVG_, AVG, None, None),
    ({**FP32_RS, "average_in_collective": True}, 2, None, AVG_, AVG, None, None),
    (dict(), 1, None, PRESCALE, SUM, None, None),                   # x * 1.0 is x: no pre-scale
])
def test_the_plan_by_hand(config, dp, averaging, how, op, prescale, site):
    plan = grad_averaging(DDPConfig(**config), dp, averaging)
    assert (plan.averaging, plan.dp_size) == (how, dp)
    assert (plan.factors.op, plan.factors.pre_scale, plan.site) == (op, prescale, site)
    for where in PrescaleSite:
        assert plan.prescale_at(where) == (prescale if where is site else None)


def test_contradictions_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="averaging=sum contradicts DDPConfig.average_in_collective=True"):
        grad_averaging(DDPConfig(average_in_collective=True), 2, Averaging.SUM)
    with pytest.raises(ValueError, match="averaging=prescale contradicts DDPConfig.average_in_collective=True"):
        grad_averaging(DDPConfig(average_in_collective=True), 2, Averaging.PRESCALE)
    with pytest.raises(ValueError, match="averaging=avg contradicts DDPConfig.average_in_collective=False"):
        grad_averaging(DDPConfig(), 2, Averaging.AVG)
    with pytest.raises(ValueError, match="POSTSCALE has no Megatron-Core flags"):
        grad_averaging(DDPConfig(), 2, Averaging.POSTSCALE)
    with pytest.raises(TypeError, match="config must be a DDPConfig"):
        grad_averaging({}, 2)
    with pytest.raises(ValueError, match="dp_size must be an int >= 1"):
        grad_averaging(DDPConfig(), 0)
    with pytest.raises(TypeError, match="averaging must be a gradvocab.Averaging or None, got str"):
        grad_averaging(DDPConfig(), 2, "avg")
    with pytest.raises(ValueError, match="site is given exactly when there is a pre-scale"):
        GradAveraging(Averaging.PRESCALE, 2)  # a pre-scale of 0.5 with nowhere to apply it
    with pytest.raises(ValueError, match="site is given exactly when there is a pre-scale"):
        GradAveraging(Averaging.AVG, 2, site=PrescaleSite.BUCKET)  # AVG has no pre-scale
    with pytest.raises(ValueError, match="site is given exactly when there is a pre-scale"):
        GradAveraging(Averaging.PRESCALE, 1, site=PrescaleSite.BUCKET)  # x 1.0 is nothing
    with pytest.raises(ValueError, match="fastgrad never post-scales"):
        GradAveraging(Averaging.POSTSCALE, 2)
    with pytest.raises(TypeError, match="averaging must be an Averaging"):
        GradAveraging("avg", 2)
    with pytest.raises(ValueError, match="dp_size must be an int >= 1"):
        GradAveraging(Averaging.SUM, 0)


def test_reports_describe_the_plan():
    assert grad_averaging(DDPConfig(), 4).describe() == \
        "x 0.25 (grad dtype, in the bucket) then SUM"
    assert grad_averaging(DDPConfig(**FP32_RS), 2).describe() == \
        "x 0.5 (grad dtype, inside the collective) then SUM"
    assert grad_averaging(DDPConfig(average_in_collective=True), 2).describe() == \
        "AVG in the collective"
    assert grad_averaging(DDPConfig(), 1).describe() == \
        "SUM (one replica: the average is the sum)"
    assert grad_averaging(DDPConfig(), 4, Averaging.SUM).describe() == "SUM"

"""gradvocab.results: the one record a rank of a pipeline check or preflight twin returns."""

import pickle

import pytest
import torch

from gradvocab import LAUNCH_SITES, OptimizerRecord, RankResult, StepOutcome


def test_sgd_and_optimizer_runs_are_one_type_told_apart_by_the_optimizer_record():
    sgd = RankResult(stage=1, dp_rank=0)
    assert sgd.optimizer is None and sgd.tp_rank == 0 and sgd.relearn_count == 0
    under_adamw = RankResult(stage=0, dp_rank=1, tp_rank=1, optimizer=OptimizerRecord())
    under_adamw.optimizer.steps.append(StepOutcome(True, 0.5, None, None))
    assert type(sgd) is type(under_adamw)
    assert under_adamw.optimizer.steps == [StepOutcome(True, 0.5, None, None)]
    assert under_adamw.optimizer.buffer_shared is False


def test_the_record_pickles_back_from_a_rank():
    result = RankResult(stage=0, dp_rank=0, relearn_count=None,
                        optimizer=OptimizerRecord(state=[{"w": {"exp_avg": torch.ones(2)}}]))
    result.losses.append([1.5])
    result.launch_sites.append(("hook", "finish"))
    back = pickle.loads(pickle.dumps(result))
    assert back.losses == [[1.5]] and back.launch_sites == [("hook", "finish")]
    assert torch.equal(back.optimizer.state[0]["w"]["exp_avg"], torch.ones(2))
    assert set(back.launch_sites[0]) <= set(LAUNCH_SITES)


def test_bad_fields_are_refused():
    with pytest.raises(ValueError, match="RankResult.stage must be an int >= 0"):
        RankResult(stage=-1, dp_rank=0)
    with pytest.raises(ValueError, match="RankResult.dp_rank must be an int >= 0"):
        RankResult(stage=0, dp_rank=True)
    with pytest.raises(ValueError, match="RankResult.relearn_count must be an int >= 0"):
        RankResult(stage=0, dp_rank=0, relearn_count=-2)
    with pytest.raises(TypeError, match="RankResult.optimizer must be an OptimizerRecord or None"):
        RankResult(stage=0, dp_rank=0, optimizer={"steps": []})
    with pytest.raises(TypeError, match="OptimizerRecord.buffer_shared must be a bool"):
        OptimizerRecord(buffer_shared=1)

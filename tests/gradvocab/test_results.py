"""gradvocab.results: the one record a rank of a pipeline check or preflight twin returns."""

import dataclasses
import math
import pickle
import struct

import pytest
import torch

from gradvocab import LAUNCH_SITES, OptimizerRecord, RankResult, StepOutcome, TimelineEvent
from verify.metrics import bitwise_equal


def differences(a: object, b: object, where: str = "") -> list[str]:
    """Where ``b`` is not ``a``: tensors and floats by their bits (-0.0 is not 0.0, a NaN is
    its own bits), containers and dataclasses field by field, anything else by ``==``; the
    types must match exactly (a tuple is no list, a StepOutcome no tuple)."""
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        return [] if bitwise_equal(a, b) else [f"{where}: tensor bits differ"]
    if isinstance(a, float):
        return [] if struct.pack("<d", a) == struct.pack("<d", b) else [f"{where}: {a!r} vs {b!r}"]
    if dataclasses.is_dataclass(a):
        return [d for f in dataclasses.fields(a)
                for d in differences(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} vs {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def every_field_set() -> RankResult:
    """A rank's record with every field, the optimizer's included, away from its default, the
    values chosen to catch a lossy copy: -0.0 and a NaN in the tensors and the losses."""
    nan_grad = torch.tensor([1.5, -0.0, math.nan], dtype=torch.bfloat16)
    optimizer = OptimizerRecord(
        state=[{"w": {"exp_avg": torch.tensor([-0.0, 2.0**-140]), "master": torch.ones(2)}}],
        steps=[StepOutcome(True, 0.5, 0.25, 1024.0, reason="clipped"),
               StepOutcome(False, math.nan, None, None, reason="found NaN")],
        gathers_waited_in_hooks=[(True, False)],
        mxfp8=[{"w": (torch.tensor([127, 3], dtype=torch.uint8),
                      torch.tensor([1, -2], dtype=torch.int8))}],
        buffer_shared=True)
    return RankResult(
        stage=1, dp_rank=2, tp_rank=3, losses=[[1.5, math.nan]], grads=[{"w": nan_grad}],
        params=[{"w": torch.tensor([-0.0, 1.0], dtype=torch.float16)}],
        launch_sites=[("hook", "finish")], relearn_count=None,
        events=[[TimelineEvent(rank=5, kind="forward", microbatch=0, start=0.0, end=0.125),
                 TimelineEvent(rank=5, kind="grad_sync_wait", microbatch=-1, start=0.5, end=0.5)]],
        chunk_enables=[[(0, (False, True))]], errors=["step 1: boom"],
        drained_in_flight=[None, True], optimizer=optimizer)


def test_a_fresh_record_is_an_sgd_run_with_nothing_observed():
    sgd = RankResult(stage=1, dp_rank=0)
    assert sgd.optimizer is None and sgd.tp_rank == 0 and sgd.relearn_count == 0
    assert OptimizerRecord().buffer_shared is False and OptimizerRecord().steps == []


def test_the_sample_sets_every_field_so_the_round_trip_covers_them_all():
    sample, defaults = every_field_set(), RankResult(stage=0, dp_rank=0, optimizer=OptimizerRecord())
    for record, default in ((sample, defaults), (sample.optimizer, defaults.optimizer)):
        for f in dataclasses.fields(record):
            assert differences(getattr(default, f.name), getattr(record, f.name)), f.name
    assert set(sample.launch_sites[0]) <= set(LAUNCH_SITES)


def test_every_field_pickles_back_from_a_rank_bit_for_bit():
    sample = every_field_set()
    back = pickle.loads(pickle.dumps(sample))
    assert differences(sample, back) == []


def test_the_comparison_sees_a_sign_of_zero_a_nan_and_a_tuple_for_a_step_outcome():
    sample = every_field_set()
    flipped = every_field_set()
    flipped.optimizer.state[0]["w"]["exp_avg"][0] = 0.0  # +0 for -0: equal values, other bits
    assert differences(sample, flipped) == [".optimizer.state[0]['w']['exp_avg']: tensor bits differ"]
    flipped = every_field_set()
    flipped.losses[0][1] = -math.nan
    assert differences(sample, flipped) == [".losses[0][1]: nan vs nan"]
    flipped = every_field_set()
    flipped.optimizer.steps[0] = (True, 0.5, 0.25, 1024.0)
    assert differences(sample, flipped) == [".optimizer.steps[0]: StepOutcome vs tuple"]


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

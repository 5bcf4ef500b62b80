"""The optimizer seam's learning-rate and weight-decay schedule (``HyperparameterSchedule``).

Expected values are derived by hand (schedules whose every value is a dyadic fraction, so
each fp64 operation is exact) and, where megatron-core is installed, are Megatron-LM's own
``OptimizerParamScheduler``'s, bitwise: the schedule is its formula as data, and the
Megatron-Core candidate drives that scheduler with the same fields.
"""

from __future__ import annotations

import warnings

import pytest

from verify.candidates.interfaces import HyperparameterSchedule, OptimizerSettings
from verify.candidates.megatron_core.version import missing_reason
from verify.checks.optim.cases import SCHEDULES

# lr: warm-up 0.5 -> 1 over 2 updates, linear decay to 0.25 at update 4; weight decay 0 -> 0.5
# over 4 updates, linear. Update k: lr 0.5 + 0.5 k/2 (k <= 2), then 0.25 + (1 - (k-2)/2) 0.75.
LINEAR = HyperparameterSchedule(max_lr=1.0, min_lr=0.25, init_lr=0.5, warmup_steps=2,
                                decay_steps=4, decay_style="linear", start_wd=0.0, end_wd=0.5,
                                wd_incr_steps=4, wd_incr_style="linear")
LINEAR_BY_HAND = ((0.5, 0.0), (0.75, 0.125), (1.0, 0.25), (0.625, 0.375), (0.25, 0.5), (0.25, 0.5))
# cosine from 1 to 0 over 2 updates, no warm-up: 0.5 (cos 0 + 1), 0.5 (cos pi/2 + 1), 0.5 (cos pi + 1)
COSINE = HyperparameterSchedule(max_lr=1.0, min_lr=0.0, decay_steps=2, start_wd=0.25, end_wd=0.25,
                                wd_incr_steps=1, wd_incr_style="constant")
COSINE_BY_HAND = ((1.0, 0.25), (0.5, 0.25), (0.0, 0.25), (0.0, 0.25))


def test_the_schedule_gives_the_hand_derived_values():
    assert LINEAR.values(6) == LINEAR_BY_HAND
    assert COSINE.values(4) == COSINE_BY_HAND
    assert HyperparameterSchedule.constant(0.01, 0.1).values(3) == ((0.01, 0.1),) * 3


def test_the_settings_give_each_updates_values():
    scheduled = OptimizerSettings(schedule=LINEAR)
    assert [scheduled.lr_and_weight_decay(k) for k in range(3)] == list(LINEAR_BY_HAND[:3])
    constant = OptimizerSettings()
    assert constant.lr_and_weight_decay(5) == (constant.adamw.lr, constant.adamw.weight_decay)
    with pytest.raises(TypeError, match="OptimizerSettings.schedule must be a HyperparameterSchedule"):
        OptimizerSettings(schedule=lambda step: 0.1)


@pytest.mark.parametrize(("fields", "message"), [
    ({"min_lr": 2.0}, "need 0 <= min_lr <= max_lr"),
    ({"init_lr": -0.1}, r"init_lr must be in \[0, max_lr"),
    ({"warmup_steps": 4}, r"warmup_steps \(4\) must be < decay_steps \(4\)"),
    ({"decay_steps": 0}, "decay_steps must be an int >= 1"),
    ({"start_wd": 0.75}, "need 0 <= start_wd <= end_wd"),
    ({"decay_style": "WSD"}, "decay_style must be one of"),
    ({"wd_incr_style": "constant"}, "a constant weight decay needs start_wd == end_wd"),
    ({"max_lr": float("nan")}, "max_lr must be a finite number"),
    ({"wd_incr_steps": True}, "wd_incr_steps must be an int >= 1"),
])
def test_a_bad_schedule_is_refused_naming_the_field(fields, message):
    base = {f: getattr(LINEAR, f) for f in LINEAR.__dataclass_fields__}
    with pytest.raises(ValueError, match=message):
        HyperparameterSchedule(**(base | fields))
    with pytest.raises(ValueError, match="update must be an int >= 0"):
        LINEAR.lr(-1)


@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
@pytest.mark.parametrize("schedule", [LINEAR, COSINE, *SCHEDULES.values(),
                                      HyperparameterSchedule.constant(0.01, 0.1)],
                         ids=["linear", "cosine", *SCHEDULES, "constant"])
def test_the_schedule_is_megatrons_optimizer_param_scheduler_bitwise(schedule):
    """Megatron's scheduler over a stand-in optimizer (two groups: wd_mult 1 and 0), stepped
    once per update as the Megatron-Core candidate steps it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Groups:
        param_groups = [{"wd_mult": 1.0}, {"wd_mult": 0.0}]

    groups = Groups()
    scheduler = OptimizerParamScheduler(
        groups, init_lr=schedule.init_lr, max_lr=schedule.max_lr, min_lr=schedule.min_lr,
        lr_warmup_steps=schedule.warmup_steps, lr_decay_steps=schedule.decay_steps,
        lr_decay_style=schedule.decay_style, start_wd=schedule.start_wd, end_wd=schedule.end_wd,
        wd_incr_steps=schedule.wd_incr_steps, wd_incr_style=schedule.wd_incr_style)
    for update, (lr, weight_decay) in enumerate(schedule.values(7)):
        decayed, undecayed = groups.param_groups
        assert (decayed["lr"], decayed["weight_decay"], undecayed["weight_decay"]) == (
            lr, weight_decay, 0.0), update
        scheduler.step(increment=1)


def test_the_checks_schedules_change_lr_and_weight_decay_at_every_update():
    for schedule in SCHEDULES.values():
        values = schedule.values(3)
        assert len({lr for lr, _ in values}) == 3 and len({wd for _, wd in values}) == 3, values

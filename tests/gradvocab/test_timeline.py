"""gradvocab.timeline: the timeline record and summarize_step on hand-built timelines.

Every expected value is derived by hand in the comments from the module doc's definitions:
step time = latest end - earliest start; a rank's busy time = its forwards', backwards' and
drains' durations (communication is not compute); bubble = the mean over ranks of
1 - busy / step time; exposed grad sync = max(0, step end - last compute end); grad_sync_wait =
the longest wait. The times are binary fractions, so every expected value but 1 - 2/5 is exact.
"""

import pytest

from gradvocab import TimelineEvent, summarize_step


def test_hand_built_timeline():
    # Two ranks; rank 0 computes [0,1] and [3,4]; rank 1 computes [1,3]; rank 0's
    # grad-sync wait ends at 5, one unit after the last compute (4): exposed = 1.
    # busy 2 and 2 of 5: bubble = 1 - 2/5 on both ranks.
    events = [
        TimelineEvent(0, "forward", 0, 0.0, 1.0),
        TimelineEvent(1, "forward", 0, 1.0, 2.0),
        TimelineEvent(1, "backward", 0, 2.0, 3.0),
        TimelineEvent(0, "backward", 0, 3.0, 4.0),
        TimelineEvent(1, "grad_sync_wait", -1, 3.0, 3.5),
        TimelineEvent(0, "grad_sync_wait", -1, 4.0, 5.0),
    ]
    report = summarize_step(events)
    assert report.step_time == 5.0
    assert report.compute_end == 4.0
    assert report.exposed_grad_sync == 1.0
    assert report.per_rank_busy == (2.0, 2.0)
    assert report.bubble_fraction == pytest.approx(1 - 2.0 / 5.0)
    assert report.grad_sync_wait == 1.0
    assert report.mean_forward == 1.0 and report.mean_backward == 1.0


def test_communication_hidden_under_compute_exposes_nothing():
    # Rank 1 finishes its compute at 3 and waits for its grad sync over [3, 3.75], while rank 0
    # still computes its backward over [3, 4]: the sync ends before the last compute (4), so
    # exposed = max(0, 4 - 4) = 0 although the wait lasted 0.75. The launch and the sends are
    # communication, not busy time: busy = 1 + 1 = 2 on each rank of a 4-long step, bubble
    # 1 - 2/4 = 0.5 on both.
    events = [
        TimelineEvent(0, "forward", 0, 0.0, 1.0),
        TimelineEvent(0, "send", 0, 1.0, 1.25),
        TimelineEvent(1, "recv", 0, 1.0, 1.25),
        TimelineEvent(1, "forward", 0, 1.0, 2.0),
        TimelineEvent(1, "backward", 0, 2.0, 3.0),
        TimelineEvent(1, "grad_sync_launch", -1, 2.5, 2.75),
        TimelineEvent(1, "grad_sync_wait", -1, 3.0, 3.75),
        TimelineEvent(0, "backward", 0, 3.0, 4.0),
    ]
    report = summarize_step(events)
    assert report.step_time == 4.0
    assert report.compute_end == 4.0
    assert report.exposed_grad_sync == 0.0
    assert report.per_rank_busy == (2.0, 2.0)
    assert report.bubble_fraction == 0.5
    assert report.grad_sync_wait == 0.75


def test_communication_partly_exposed():
    # Rank 1's grad sync waits over [2.5, 4]; the last compute (rank 0's backward [2, 3.5])
    # ends at 3.5, so 1 of the 1.5 is hidden and 4 - 3.5 = 0.5 exposed. Busy: rank 0
    # 1 + 1.5 = 2.5, rank 1 1 + 1 = 2, of a 4-long step: bubble (1 - 2.5/4 + 1 - 2/4) / 2
    # = (0.375 + 0.5) / 2 = 0.4375. Backwards 1.5 and 1: mean 1.25.
    events = [
        TimelineEvent(0, "forward", 0, 0.0, 1.0),
        TimelineEvent(1, "forward", 0, 0.5, 1.5),
        TimelineEvent(0, "backward", 0, 2.0, 3.5),
        TimelineEvent(1, "backward", 0, 1.5, 2.5),
        TimelineEvent(1, "grad_sync_wait", -1, 2.5, 4.0),
    ]
    report = summarize_step(events)
    assert report.step_time == 4.0
    assert report.compute_end == 3.5
    assert report.exposed_grad_sync == 0.5
    assert report.per_rank_busy == (2.5, 2.0)
    assert report.bubble_fraction == 0.4375
    assert report.grad_sync_wait == 1.5
    assert report.mean_forward == 1.0 and report.mean_backward == 1.25


def test_times_are_relative_to_the_step_start():
    # A one-rank step starting at 10: compute_end is reported from the step's start
    # (12 - 10 = 2), exposed = 14 - 12 = 2, busy 2 of 4: bubble 1 - 2/4 = 0.5.
    events = [
        TimelineEvent(0, "forward", 0, 10.0, 11.0),
        TimelineEvent(0, "wgrad_drain", -1, 11.0, 12.0),
        TimelineEvent(0, "grad_sync_wait", -1, 12.0, 14.0),
    ]
    report = summarize_step(events)
    assert (report.step_time, report.compute_end, report.exposed_grad_sync) == (4.0, 2.0, 2.0)
    assert report.per_rank_busy == (2.0,)
    assert report.bubble_fraction == 0.5
    assert report.mean_backward == 0.0  # no backward event (the drain is compute, not a backward)


def test_empty_timeline_refused():
    with pytest.raises(ValueError, match="empty"):
        summarize_step([])


def test_event_refuses_unknown_kind_and_negative_duration():
    with pytest.raises(ValueError, match="kind"):
        TimelineEvent(0, "nap", 0, 0.0, 1.0)
    with pytest.raises(ValueError, match="end"):
        TimelineEvent(0, "forward", 0, 1.0, 0.0)
    assert TimelineEvent(0, "send", 0, 1.0, 1.25).duration == 0.25

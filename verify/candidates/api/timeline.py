"""The timeline vocabulary a candidate reports its schedule in and a check analyses.

``fastgrad.timeline`` defines it without depending on any fastgrad implementation (plain
records and arithmetic on them): :class:`TimelineEvent` (one interval on one rank; the
``kind`` names in ``EVENT_KINDS``), and :func:`summarize_step`, which turns the events of all
ranks into a :class:`StepReport` (step time, bubble, exposed grad sync). A candidate other
than fastgrad records the same events around its own schedule's work.
"""

from __future__ import annotations

from fastgrad.timeline import EVENT_KINDS, StepReport, TimelineEvent, summarize_step

__all__ = ["EVENT_KINDS", "StepReport", "TimelineEvent", "summarize_step"]

"""``verify.attribution.explaining``: which known finding explains a failing case, decided by
each finding's rule on the case's settings and, for a crash, its signature; never by label."""

from __future__ import annotations

from verify.attribution import explaining
from verify.candidates.interfaces import CrashSignature, Effect, Finding, LaunchSettings


def _finding(key: str, effect: Effect, crash: CrashSignature | None = None) -> Finding:
    return Finding(key=key, number=1, title=key, effect=effect, launch="--overlap-grad-reduce",
                   api_only=None, upstream="none found", reproduction=f"examples/{key}.py",
                   avoid="turn it off", reaches=lambda s: s.overlap_grad_reduce, crash=crash)


WRONG = _finding("wrong-grad", Effect.WRONG_GRADIENT)
CRASH = _finding("crash", Effect.CRASH, CrashSignature("RuntimeError", "start_grad_sync"))
REACHED = LaunchSettings(overlap_grad_reduce=True)


def test_a_wrong_number_is_explained_by_the_first_reached_finding_that_is_not_a_crash():
    assert explaining((CRASH, WRONG), REACHED) is WRONG


def test_a_crash_is_explained_only_by_a_finding_with_its_signature():
    assert explaining((WRONG, CRASH), REACHED, ("RuntimeError", "start_grad_sync")) is CRASH
    assert explaining((WRONG, CRASH), REACHED, ("RuntimeError", "elsewhere")) is None
    assert explaining((WRONG, CRASH), REACHED, ("ValueError", "start_grad_sync")) is None


def test_settings_the_rule_does_not_reach_are_explained_by_nothing():
    assert explaining((WRONG, CRASH), LaunchSettings()) is None
    assert explaining((WRONG, CRASH), LaunchSettings(), ("RuntimeError", "start_grad_sync")) is None

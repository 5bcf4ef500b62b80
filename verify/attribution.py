"""Which of a candidate's known findings explains a failing case: the harness's rule, not the
seam's.

A candidate lists its known root causes (``Candidate.findings()``, each a
:class:`~verify.candidates.interfaces.Finding` with a rule over
:class:`~verify.candidates.interfaces.LaunchSettings`); the harness (``verify.check``'s
recorder, ``verify preflight``'s findings and twin verdict) decides with :func:`explaining`
which one a failing case shows. A failing case is never attributed by its label, and whatever
no finding explains is a FAIL of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from verify.candidates.interfaces import Effect, Finding, LaunchSettings


def explaining(findings: Sequence[Finding], settings: LaunchSettings,
               crash: tuple[str, str | None] | None = None) -> Finding | None:
    """The finding that explains a failing case with ``settings``: for a crash (``crash`` =
    its root cause's exception type and function) the first finding whose rule reaches the
    settings and whose crash signature matches; otherwise the first finding whose rule reaches
    them and whose effect is not a crash. None: no known finding explains it."""
    for finding in findings:
        if not finding.reaches(settings):
            continue
        if crash is not None:
            if finding.crash is not None and finding.crash.matches(*crash):
                return finding
        elif finding.effect is not Effect.CRASH:
            return finding
    return None


__all__ = ["explaining"]

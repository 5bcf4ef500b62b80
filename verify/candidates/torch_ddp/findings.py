"""torch DDP's known findings (none yet: filled as the checks find them)."""

from __future__ import annotations

from verify.candidates.api.findings import Finding

FINDINGS: tuple[Finding, ...] = ()

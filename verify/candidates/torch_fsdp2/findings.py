"""FSDP2's known findings (filled as the checks find them)."""

from __future__ import annotations

from verify.candidates.api.findings import Finding

FINDINGS: tuple[Finding, ...] = ()

"""Shared by the reproductions: print findings that are not matches; exit 1 if any is a bug."""

from __future__ import annotations

import sys
import warnings

from verify.candidates.megatron_core.findings import Verdict

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


def report(findings) -> None:
    bugs = [f for f in findings if f.verdict is Verdict.BUG]
    for f in findings:
        if f.verdict is not Verdict.MATCH:
            print(f.line())
    print(f"{len(bugs)} bug finding(s) of {len(findings)}")
    sys.exit(1 if bugs else 0)

"""The layout, deferred_wgrad and mxfp8 checks reach the implementation only through the seam."""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from verify.candidates import Candidate, CandidateInfo, FastgradCandidate, Unsupported
from verify.candidates.interfaces import MXFP8, BucketLayout, DeferredWgrad, PipelineTraining
from verify.check import CheckContext
from verify.checks import check_by_name

ROOT = Path(__file__).resolve().parents[2]
SEAM_CHECKS = ("layout", "deferred_wgrad", "mxfp8")


@dataclass(frozen=True)
class BareCandidate(Candidate):
    """A candidate that implements none of the techniques (the base class's accessors)."""

    name = "bare"

    def info(self) -> CandidateInfo:
        return CandidateInfo(name=self.name, version="0", description="implements nothing")


@pytest.mark.parametrize("name", SEAM_CHECKS)
def test_a_candidate_without_the_technique_is_a_skip_naming_it(name):
    result = check_by_name(name).execute(CheckContext(quick=True), BareCandidate())
    assert result.status == "SKIP", (result.status, result.error)
    assert result.skipped == [f"{name}: bare does not implement " + {
        "layout": "the bucket layout", "deferred_wgrad": "deferred wgrad", "mxfp8": "MXFP8"}[name]]
    assert not result.comparisons and not result.expectations


@pytest.mark.parametrize(("accessor", "interface"), [
    ("layout", BucketLayout), ("deferred_wgrad", DeferredWgrad), ("mxfp8", MXFP8),
    ("pipeline", PipelineTraining)])
def test_fastgrads_adapters_are_the_interfaces_and_scopes(accessor, interface):
    adapter = getattr(FastgradCandidate(), accessor)()
    assert isinstance(adapter, interface)
    with adapter as entered:
        assert entered is adapter


def test_the_checks_do_not_import_fastgrad():
    # A fresh interpreter: importing every technique check loads none of fastgrad (what the
    # checks share with it is gradvocab's); the candidate's accessor does, where it runs.
    code = ("import sys\n"
            "import verify.checks.layout, verify.checks.reduce_scatter, verify.checks.deferred_wgrad\n"
            "import verify.checks.pipeline, verify.checks.optim, verify.checks.mxfp8\n"
            "print(sorted(m for m in sys.modules if m == 'fastgrad' or m.startswith('fastgrad.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert ast.literal_eval(out) == []


def test_unsupported_names_the_technique():
    with pytest.raises(Unsupported, match="^mxfp8: bare does not implement MXFP8$"):
        BareCandidate().mxfp8()

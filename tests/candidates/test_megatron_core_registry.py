"""Megatron-Core is a registered candidate; listing it never imports megatron, and without
megatron-core installed every technique is Unsupported saying how to install it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from verify.candidates import CANDIDATES, Technique, Unsupported, candidate_named
from verify.candidates.megatron_core.candidate import MegatronCoreCandidate

ROOT = Path(__file__).resolve().parents[2]
NOT_INSTALLED = "megatron-core is not installed: pip install -e '.[megatron]' (in the gradverify checkout)"
# Technique -> its accessor on a Candidate
ACCESSORS = {Technique.LAYOUT: "layout", Technique.GRAD_REDUCTION: "grad_reduction",
             Technique.DEFERRED_WGRAD: "deferred_wgrad", Technique.PIPELINE: "pipeline",
             Technique.OPTIMIZER: "optimizer", Technique.MXFP8: "mxfp8"}


def test_the_registry_names_megatron_core():
    assert CANDIDATES["megatron-core"] is MegatronCoreCandidate
    assert isinstance(candidate_named("megatron-core"), MegatronCoreCandidate)
    assert sorted(ACCESSORS) == sorted(Technique)


def test_importing_the_registry_does_not_import_megatron():
    # A fresh interpreter: listing the candidates must not load megatron (it is imported
    # where a technique runs, and may be absent).
    code = ("import sys\n"
            "import verify.candidates.registry\n"
            "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out


@pytest.mark.parametrize("technique", list(Technique))
def test_without_megatron_core_every_technique_is_unsupported_with_the_install_hint(
        monkeypatch, technique):
    # sys.modules["megatron"] = None makes importlib.util.find_spec("megatron") None: not installed
    monkeypatch.setitem(sys.modules, "megatron", None)
    candidate = MegatronCoreCandidate()
    with pytest.raises(Unsupported) as raised:
        getattr(candidate, ACCESSORS[technique])()
    assert raised.value.technique is technique
    assert raised.value.reason == NOT_INSTALLED
    assert str(raised.value) == f"{technique.value}: {NOT_INSTALLED}"


def test_without_megatron_core_info_lists_every_technique_as_unsupported(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)
    info = MegatronCoreCandidate().info()
    assert (info.name, info.version) == ("megatron-core", "not installed")
    assert dict(info.unsupported) == {t.value: NOT_INSTALLED for t in Technique}

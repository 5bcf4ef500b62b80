"""The candidate seam, as imports (grimp; imports inside functions count): a migrated check
reaches fastgrad only through ``verify.candidates``, and the interfaces module imports nothing
of fastgrad (the vocabulary it shares with fastgrad is gradvocab's)."""

from __future__ import annotations

import grimp
import pytest

# Checks that reach the implementation under test only through a Candidate.
MIGRATED_CHECKS = ("verify.checks.layout", "verify.checks.reduce_scatter",
                   "verify.checks.deferred_wgrad", "verify.checks.mxfp8", "verify.checks.pipeline",
                   "verify.checks.optim")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    # no cache (as tests/test_import_graph.py): a stale one can report imports long removed
    return grimp.build_graph("gradvocab", "refgrad", "fastgrad", "verify", include_external_packages=False,
                             cache_dir=None)


def _fastgrad_imports(graph: grimp.ImportGraph, package: str) -> dict[str, set[str]]:
    modules = {package} | graph.find_descendants(package)
    found = {}
    for module in sorted(modules):
        imported = {m for m in graph.find_modules_directly_imported_by(module)
                    if m == "fastgrad" or m.startswith("fastgrad.")}
        if imported:
            found[module] = imported
    return found


@pytest.mark.parametrize("check", MIGRATED_CHECKS)
def test_a_migrated_check_imports_no_fastgrad(graph, check):
    assert _fastgrad_imports(graph, check) == {}


def test_the_interfaces_module_imports_no_fastgrad(graph):
    assert _fastgrad_imports(graph, "verify.candidates.interfaces") == {}


def test_the_rule_sees_a_late_import_of_fastgrad():
    toy = grimp.ImportGraph()
    for module in ("verify.checks.pipeline", "verify.checks.pipeline.entry", "fastgrad.ddp"):
        toy.add_module(module)
    toy.add_import(importer="verify.checks.pipeline.entry", imported="fastgrad.ddp")  # in a function
    assert _fastgrad_imports(toy, "verify.checks.pipeline") == {
        "verify.checks.pipeline.entry": {"fastgrad.ddp"}}

"""A candidate imports the seam and the vocabulary, nothing else of ours.

Every package under ``verify/candidates/`` is a candidate. Of gradverify's own packages it may
import only ``verify.candidates.interfaces`` (the technique interfaces, and what they hand over:
refgrad's records and specification helpers), the vocabulary (``gradvocab``) and its own
package; the fastgrad candidate may import fastgrad, its own library, as Megatron-Core's imports
megatron. Anything else (torch, megatron, the standard library) is its own business. Read with
``ast``: imports inside functions and ``TYPE_CHECKING`` blocks count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = ROOT / "verify" / "candidates"
SEAM = "verify.candidates.interfaces"
VOCABULARY = ("gradvocab",)
# A candidate's own library, where it is one of ours.
OWN_LIBRARY = {"fastgrad": "fastgrad"}
# gradverify's top-level packages, the vocabulary among them.
OURS = frozenset({p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()})


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def candidate_packages() -> list[str]:
    """The candidate packages' names under ``verify/candidates/``."""
    return sorted(p.name for p in CANDIDATES.iterdir() if (p / "__init__.py").is_file())


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in ``source`` (the code of ``module``), relative
    imports resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts if is_package else parts[:-1]
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def forbidden_imports(source: str, module: str, candidate: str, *,
                      is_package: bool = False) -> list[str]:
    """The imports of ``module`` (in candidate package ``candidate``) that break the rule."""
    own = f"verify.candidates.{candidate}"
    allowed = (SEAM, own, *VOCABULARY) + ((OWN_LIBRARY[candidate],) if candidate in OWN_LIBRARY else ())
    return [f"{module}:{line}: {name}" for line, name in imported_modules(source, module, is_package)
            if name.split(".")[0] in OURS and not any(_within(name, a) for a in allowed)]


def package_violations(candidate: str) -> list[str]:
    """Every import in candidate package ``candidate`` that breaks the rule."""
    out = []
    for path in sorted((CANDIDATES / candidate).rglob("*.py")):
        relative = path.relative_to(ROOT).with_suffix("")
        is_package = relative.name == "__init__"
        module = ".".join(relative.parent.parts if is_package else relative.parts)
        out += forbidden_imports(path.read_text(encoding="utf-8"), module, candidate,
                                 is_package=is_package)
    return out


def test_every_candidate_package_is_scanned():
    assert {"fastgrad", "megatron_core", "torch_ddp", "torch_fsdp2"} <= set(candidate_packages())


@pytest.mark.parametrize("candidate", candidate_packages())
def test_a_candidate_imports_only_the_seam_the_vocabulary_and_its_own_library(candidate):
    assert package_violations(candidate) == []


def test_the_rule_sees_each_kind_of_forbidden_import():
    """Planted: refgrad, a check, another candidate, fastgrad from a non-fastgrad candidate, a
    relative import out of the package, a late import inside a function and a module of
    ``verify.candidates`` beside the seam, each found; the seam, the vocabulary, the own
    package and third-party libraries pass."""
    source = (
        "import torch\n"
        "from megatron.core import parallel_state\n"
        "from verify.candidates.interfaces import PipelineCase\n"
        "from verify.candidates.torch_ddp.layout import TorchDDPLayout\n"
        "from gradvocab.averaging import Averaging\n"
        "from gradvocab import StepOutcome\n"
        "from .layout import rebuilt_layout\n"
        "from refgrad.pipeline import sgd_update\n"
        "import verify.checks.pipeline\n"
        "from verify.candidates.fastgrad import FastgradCandidate\n"
        "from fastgrad.ddp import DistributedDataParallel\n"
        "from ..interfaces import Candidate\n"
        "from .. import registry\n"
        "from verify.candidates.registry import CANDIDATES\n"
        "def late():\n"
        "    from verify.fixtures.mxfp8 import toy_config\n"
    )
    found = forbidden_imports(source, "verify.candidates.torch_ddp.candidate", "torch_ddp")
    assert found == [
        "verify.candidates.torch_ddp.candidate:8: refgrad.pipeline",
        "verify.candidates.torch_ddp.candidate:9: verify.checks.pipeline",
        "verify.candidates.torch_ddp.candidate:10: verify.candidates.fastgrad",
        "verify.candidates.torch_ddp.candidate:11: fastgrad.ddp",
        "verify.candidates.torch_ddp.candidate:13: verify.candidates",
        "verify.candidates.torch_ddp.candidate:14: verify.candidates.registry",
        "verify.candidates.torch_ddp.candidate:16: verify.fixtures.mxfp8",
    ], found
    # the fastgrad candidate may import fastgrad, its own library
    assert forbidden_imports("from fastgrad.ddp import DistributedDataParallel\n",
                             "verify.candidates.fastgrad.pipeline", "fastgrad") == []

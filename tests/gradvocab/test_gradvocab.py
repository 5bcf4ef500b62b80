"""gradvocab is the vocabulary every package may import, so it imports none of them: only
itself, torch and the standard library. Read from the source (ast), so an import inside a
function or a ``TYPE_CHECKING`` block counts as much as one at the top."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import gradvocab

PACKAGE = Path(gradvocab.__file__).parent
ALLOWED = frozenset({"gradvocab", "torch"}) | frozenset(sys.stdlib_module_names)


def imported_packages(source: str) -> set[str]:
    """The top-level package of every import in ``source`` (relative imports: ``gradvocab``,
    the only package they can reach from inside it)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add("gradvocab" if node.level else node.module.partition(".")[0])
    return found


def foreign_imports() -> dict[str, set[str]]:
    """Each gradvocab module that imports anything but gradvocab, torch and the stdlib."""
    found = {}
    for path in sorted(PACKAGE.glob("*.py")):
        foreign = imported_packages(path.read_text()) - ALLOWED
        if foreign:
            found[path.name] = foreign
    return found


def test_gradvocab_imports_only_itself_torch_and_the_standard_library():
    assert list(PACKAGE.glob("*.py")), PACKAGE
    assert foreign_imports() == {}


def test_the_rule_sees_an_import_of_fastgrad_hidden_in_a_function():
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from refgrad.layout import Layout\n"
              "def late():\n    import verify.candidates\n    from fastgrad.ddp import x\n")
    assert imported_packages(source) - ALLOWED == {"refgrad", "verify", "fastgrad"}


def test_every_public_name_is_reexported_from_its_module():
    for name in gradvocab.__all__:
        value = getattr(gradvocab, name)
        module = getattr(value, "__module__", None)
        if module is not None and module != "builtins":  # a constant has no home module
            assert module.startswith("gradvocab."), (name, module)


def submodule_public_names() -> dict[str, object]:
    """Every name a gradvocab module exports in its ``__all__``, with its value."""
    found = {}
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"gradvocab.{path.stem}")
        found.update({name: getattr(module, name) for name in module.__all__})
    return found


def test_the_package_exports_exactly_what_its_modules_export():
    # Both directions: nothing public in a module is missing from the one public face, and
    # the face holds nothing no module exports; each name is the module's own object.
    public = submodule_public_names()
    assert sorted(gradvocab.__all__) == sorted(public)
    for name, value in public.items():
        assert getattr(gradvocab, name) is value, name


def test_the_default_bucket_size_is_megatron_cores_rule():
    # max(40_000_000, 1_000_000 * dp): the floor up to DP 40, then 1M elements per rank
    assert [gradvocab.default_bucket_size(dp) for dp in (1, 8, 40, 41, 64, 1024)] == [
        40_000_000, 40_000_000, 40_000_000, 41_000_000, 64_000_000, 1_024_000_000]


@pytest.mark.parametrize(("dp_size", "error"), [(0, ValueError), (-3, ValueError),
                                                 (True, TypeError), (8.0, TypeError)])
def test_the_default_bucket_size_refuses_a_size_that_is_not_a_positive_int(dp_size, error):
    with pytest.raises(error, match="dp_size"):
        gradvocab.default_bucket_size(dp_size)


def test_a_step_outcome_holds_floats_or_none():
    outcome = gradvocab.StepOutcome(stepped=True, grad_norm=3, clip_coefficient=None,
                                    loss_scale=65536)
    assert (outcome.grad_norm, outcome.loss_scale, outcome.reason) == (3.0, 65536.0, "")
    assert type(outcome.grad_norm) is float


@pytest.mark.parametrize(("field", "value"), [("stepped", 1), ("grad_norm", "1.0"),
                                              ("clip_coefficient", True), ("reason", None)])
def test_a_step_outcome_refuses_a_field_of_the_wrong_type(field, value):
    fields = {"stepped": False, "grad_norm": None, "clip_coefficient": None, "loss_scale": None}
    with pytest.raises(TypeError, match=f"StepOutcome.{field}"):
        gradvocab.StepOutcome(**{**fields, field: value})

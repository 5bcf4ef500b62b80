"""preflight's paper figures come from the specification (refgrad), never from fastgrad, the
implementation under test: a full-size layout computed by fastgrad would judge fastgrad by
itself. An ast scan of every module the figures' modules import (transitively, through
``verify`` and ``refgrad``; imports inside functions and ``TYPE_CHECKING`` blocks count)."""

from __future__ import annotations

import ast
from pathlib import Path

from refgrad.layout import Layout
from tests.verify.preflight_launch import preflight_config
from tests.verify.test_preflight_paper import TOY
from verify.preflight.paper import chunk_layouts

ROOT = Path(__file__).resolve().parents[2]
# The modules that compute the paper figures: layouts, memory, wire bytes, reduction error
# (paper), the pipeline step (timing) and the hazards decided from them (hazards).
PAPER_MODULES = ("verify.preflight.paper", "verify.preflight.timing", "verify.preflight.hazards")
# Followed into: our own packages (third-party imports are not scanned).
FOLLOWED = ("verify", "refgrad")


def module_file(root: Path, module: str) -> Path | None:
    """The source file of ``module`` under ``root`` (a package's ``__init__.py``), or None."""
    path = root.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return None


def imported_names(source: str, module: str, is_package: bool) -> list[str]:
    """Every module name ``source`` imports, anywhere in it: ``import a.b`` gives ``a.b``,
    ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a module); relative imports
    resolved against ``module``."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def fastgrad_imports(root: Path, start: tuple[str, ...]) -> dict[str, set[str]]:
    """``{module: fastgrad modules it imports}`` over ``start`` and everything it imports
    from ``FOLLOWED`` packages (their parent packages too: importing runs their
    ``__init__``)."""
    found: dict[str, set[str]] = {}
    seen: set[str] = set()
    todo = list(start)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = module_file(root, module)
        if path is None:  # a name imported from a module, not a module itself
            continue
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        for name in imported_names(path.read_text(), module, path.name == "__init__.py"):
            top = name.partition(".")[0]
            if top == "fastgrad" and module_file(root, name) is not None:
                found.setdefault(module, set()).add(name)
            elif top in FOLLOWED:
                todo.append(name)
    return found


def test_the_paper_figures_import_nothing_of_fastgrad_under_test():
    # The parallel sizes come from the vocabulary (gradvocab), which imports none of ours.
    assert fastgrad_imports(ROOT, PAPER_MODULES) == {}


def test_the_paper_layout_is_refgrads():
    chunks = chunk_layouts(preflight_config(TOY))
    assert chunks and all(type(chunk.layout) is Layout for chunk in chunks)


def test_the_scan_sees_a_late_import_two_modules_away(tmp_path):
    # verify.preflight.paper -> verify.helper (inside a function) -> fastgrad's package and
    # its layout: found; the vocabulary (gradvocab) is not fastgrad.
    (tmp_path / "fastgrad").mkdir()
    (tmp_path / "gradvocab").mkdir()
    (tmp_path / "gradvocab" / "__init__.py").write_text("")
    for name in ("__init__", "layout"):
        (tmp_path / "fastgrad" / f"{name}.py").write_text("")
    (tmp_path / "verify" / "preflight").mkdir(parents=True)
    (tmp_path / "verify" / "__init__.py").write_text("")
    (tmp_path / "verify" / "preflight" / "__init__.py").write_text("")
    (tmp_path / "verify" / "preflight" / "paper.py").write_text(
        "from gradvocab import ParallelDims\nfrom ..helper import sizes\n")
    (tmp_path / "verify" / "helper.py").write_text(
        "def sizes():\n    from fastgrad import layout\n    return layout\n")
    found = fastgrad_imports(tmp_path, ("verify.preflight.paper",))
    assert found == {"verify.helper": {"fastgrad", "fastgrad.layout"}}

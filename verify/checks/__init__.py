"""The registered checks, one module per technique.

Each module in ``CHECK_MODULES`` defines ``CHECK``, a :class:`verify.check.Check`.
The registry is a fixed tuple, read once; nothing is registered at import time.
"""

from __future__ import annotations

import importlib

from verify.check import Check

# Order is the order of the report: the truth layer first, then the techniques.
CHECK_MODULES: tuple[str, ...] = (
    "formats",
    "oracle",
    "metrics",
    "layout",
    "reduce_scatter",
    "deferred_wgrad",
    "pipeline",
    "optim",
    "mxfp8",
)


RANK_MODULES: tuple[str, ...] = (
    "verify.candidates", *(f"verify.checks.{name}" for name in CHECK_MODULES))
"""What a check's rank imports to unpickle its worker and candidate: ``verify run`` has the
rank launcher's fork server import them once (about half a second a rank otherwise, every
world of every configuration)."""


def all_checks() -> tuple[Check, ...]:
    """Every registered check, in report order."""
    return tuple(
        importlib.import_module(f"verify.checks.{name}").CHECK for name in CHECK_MODULES
    )


def check_by_name(name: str) -> Check:
    """The check called ``name`` (its module's name); a ValueError lists the valid names otherwise."""
    if name not in CHECK_MODULES:
        raise ValueError(f"unknown check {name!r}; valid names: {', '.join(CHECK_MODULES)}")
    check = importlib.import_module(f"verify.checks.{name}").CHECK
    if check.name != name:
        raise RuntimeError(f"verify.checks.{name} defines a check named {check.name!r}")
    return check

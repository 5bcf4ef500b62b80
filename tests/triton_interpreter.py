"""When Triton's CPU interpreter (``TRITON_INTERPRET=1``) cannot run gradverify's kernels.

The interpreter tests run a kernel on the CPU in a subprocess. Two reasons stop them, each
outside gradverify: Triton is absent, or the installed Triton's interpreter cannot run a
loop whose bound is a kernel argument under the installed NumPy.
"""

from __future__ import annotations

import importlib
import importlib.util

from packaging.version import Version

# Triton before 3.7.0 turns a scalar kernel argument into a Python int with int() of a
# one-element array (interpreter.py, tensor.__index__), which NumPy 2.4 made a TypeError.
# Reported as triton-lang/triton#9171, fixed by #9172, first released in Triton 3.7.0. Seen
# here with Triton 3.6.0 (torch 2.11's) and NumPy 2.5.2: the lent H200's stack.
FIRST_TRITON_WITH_THE_FIX = Version("3.7.0")
FIRST_NUMPY_REFUSING_THE_CONVERSION = Version("2.4.0")


def missing_reason() -> str | None:
    """Why no interpreter test can run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def runtime_loop_reason(
    triton_version: str | None = None, numpy_version: str | None = None
) -> str | None:
    """Why a kernel looping to a runtime argument cannot run in the interpreter here, or None.

    The versions default to the installed ones; tests pass them to check the rule itself.
    """
    if triton_version is None:
        reason = missing_reason()
        if reason is not None:
            return reason
        # The module's own version: torch nightlies ship it as the pytorch-triton distribution.
        triton_version = importlib.import_module("triton").__version__
    if numpy_version is None:
        numpy_version = importlib.import_module("numpy").__version__
    triton, numpy = Version(triton_version), Version(numpy_version)
    if triton < FIRST_TRITON_WITH_THE_FIX and numpy >= FIRST_NUMPY_REFUSING_THE_CONVERSION:
        return (f"Triton {triton_version}'s interpreter cannot loop to a kernel argument under "
                f"NumPy {numpy_version} (int() of a one-element array; triton-lang/triton#9171, "
                f"fixed in Triton {FIRST_TRITON_WITH_THE_FIX}); the compiled kernel is unaffected")
    return None

"""GPU kernels (Triton). Importing this package never imports Triton.

Kernels are used only when :func:`triton_available` says so and the tensors are
on CUDA; everything else takes the torch path, which gives the same bits.
"""

from __future__ import annotations

import importlib.util

import torch


def triton_available() -> bool:
    """True when Triton is importable and a CUDA device is present.

    Not memoised (no module-level cache): both probes are cheap, and tests can
    change the environment between calls.
    """
    if not torch.cuda.is_available():
        return False
    return importlib.util.find_spec("triton") is not None

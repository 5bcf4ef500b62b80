"""The environment fingerprint embedded in every report.

Reduction order, and so the bits of a result, depends on the library versions,
the GPU, and NCCL/cuBLAS settings; a report without them cannot be reproduced.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from typing import Any

import numpy
import torch

# Variables that change collective algorithms, reduction order or GEMM determinism.
RELEVANT_VARIABLES = (
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_NVLS_ENABLE",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_COLLNET_ENABLE",
    "NCCL_P2P_DISABLE",
    "NCCL_IB_DISABLE",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NVTE_FLASH_ATTN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TRITON_INTERPRET",
    "OMP_NUM_THREADS",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
)


def _nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL
        return None
    if isinstance(version, tuple):
        return ".".join(str(v) for v in version)
    return str(version)


def _triton_version() -> str | None:
    try:
        import triton  # noqa: PLC0415 - optional dependency
    except Exception:  # noqa: BLE001 - absent or broken on this machine
        return None
    return getattr(triton, "__version__", "unknown")


def gradverify_version() -> str:
    """The installed gradverify version ("unknown" when not installed as a package)."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("gradverify")
    except PackageNotFoundError:
        return "unknown"


def git_commit() -> str | None:
    """The commit of the checkout this code runs from (``+dirty`` with local changes), or None."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty.strip() else "") if commit else None


def provenance() -> dict[str, Any]:
    """What produced a report: the gradverify version and, from a checkout, the git commit."""
    return {"gradverify": gradverify_version(), "git_commit": git_commit()}


def fingerprint() -> dict[str, Any]:
    """A JSON-safe description of the software, hardware and settings in force."""
    cuda = torch.cuda.is_available()
    return {
        "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": cuda,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": _nccl_version(),
        "triton": _triton_version(),
        "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "distributed_backends": {
            "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
            "nccl": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        },
        "variables": {name: os.environ.get(name) for name in RELEVANT_VARIABLES},
    }


def format_fingerprint(env: dict[str, Any]) -> str:
    """A human-readable rendering of :func:`fingerprint`."""
    lines = []
    for key, value in env.items():
        if key == "variables":
            lines.append("variables:")
            lines.extend(f"  {name}={val if val is not None else '(unset)'}" for name, val in value.items())
        elif isinstance(value, dict):
            lines.append(f"{key}: " + ", ".join(f"{k}={v}" for k, v in value.items()))
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)

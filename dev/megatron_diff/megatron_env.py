"""Import Megatron-LM's launch path (megatron-core 0.19.2's ``megatron/training``) on a CPU.

The wheel ships ``megatron/training``, identical to Megatron-LM branch
``core_r0.19.0``; unzip it and point ``MEGATRON_SRC`` at the folder that holds
``megatron/`` (default ``/work/notes/mc19``). It runs on the project's Python
3.11 venv (torch, numpy, packaging) with two stand-ins for the GPU node it
was written for, each applied here and nowhere else:

- ``typing.override`` (Python 3.12) is an identity decorator on 3.11;
- the node is a Hopper GPU (``get_device_arch_version() == 9``) with
  Transformer Engine 2.12 installed: validate_args and TransformerConfig ask
  for both (the ``CUDA_DEVICE_MAX_CONNECTIONS`` rule, TE-gated features, the
  fused RoPE kernel), and a CPU has neither.

``WORLD_SIZE``/``RANK`` are the launcher's, ``CUDA_DEVICE_MAX_CONNECTIONS=1``
is what every Megatron-LM example script exports.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import typing
import warnings

MEGATRON_SRC = os.environ.get("MEGATRON_SRC", "/work/notes/mc19")
HOPPER = 9
TE_VERSION = "2.12.0"


def load() -> None:
    """Put Megatron on sys.path and apply the GPU-node stand-ins (idempotent)."""
    if getattr(load, "done", False):
        return
    if not os.path.isdir(os.path.join(MEGATRON_SRC, "megatron", "training")):
        raise SystemExit(f"MEGATRON_SRC={MEGATRON_SRC} holds no megatron/training: unzip the "
                         "megatron-core 0.19.2 wheel there")
    if not hasattr(typing, "override"):
        typing.override = lambda f: f  # Python 3.12's decorator, an identity
    sys.path.insert(0, MEGATRON_SRC)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    warnings.filterwarnings("ignore")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import megatron.core.utils as core_utils
        import megatron.training.arguments as arguments
        import torch
        from megatron.core.models.common.embeddings import rope_utils
        from packaging.version import Version

        core_utils._te_version = Version(TE_VERSION)
        torch.cuda.get_device_capability = lambda device=None: (HOPPER, 0)
        arguments.get_device_arch_version = lambda: HOPPER
        if rope_utils.fused_apply_rotary_pos_emb is None:  # TE's kernel, present on the node
            rope_utils.fused_apply_rotary_pos_emb = lambda *args, **kwargs: None
    load.done = True

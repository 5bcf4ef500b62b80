"""Driver: Megatron-Core's MXFP8 params and param/grad buffer sharing, where they can run.

Megatron-Core's MXFP8 parameters are Transformer Engine's ``MXFP8Tensor``
(``megatron.core.fp8_utils.is_mxfp8tensor``), and only a buffer holding such params gets
the shared param/grad buffer (``_ParamAndGradBuffer.__init__``: ``shared_buffer`` when
``any(is_mxfp8tensor(p) for p in params)``), used with ``reuse_grad_buf_for_mxfp8_param_ag``.
Transformer Engine quantizes on CUDA only. So this driver runs nothing on a CPU or where
Transformer Engine is absent: :func:`unavailable_reason` says exactly why, from the
installed code (``version.installed().features["mxfp8_param_buffer_sharing"]``). Where it
is available (a GPU node with Transformer Engine), the MXFP8 check is the next driver to
write: this one only reports.
"""

from __future__ import annotations

from verify.candidates.megatron_core.version import MegatronCoreInfo, installed

FEATURE = "mxfp8_param_buffer_sharing"


def unavailable_reason(info: MegatronCoreInfo | None = None) -> str | None:
    """Why Megatron-Core's MXFP8 path cannot run here (None: it can)."""
    info = info or installed()
    feature = info.features[FEATURE]
    if feature.present:
        return None
    return feature.reason

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


NOT_WIRED = (
    "has Transformer Engine's MXFP8 on CUDA here, but its MXFP8 path is not wired to the "
    "seam yet and has never been run by gradverify (no GPU where the adapter was written). "
    "What would run: Transformer Engine's MXFP8Quantizer for quantize/dequantize (held to "
    "refgrad.mxfp8 in the scale mode it implements), and DistributedDataParallel with "
    "DistributedDataParallelConfig(fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag="
    "True) and its DistributedOptimizer for the MXFP8 param all-gather through the grad buffer "
    "(_ParamAndGradBuffer's shared_buffer)")


def unavailable_reason(info: MegatronCoreInfo | None = None) -> str | None:
    """Why Megatron-Core's MXFP8 path cannot run here (None: it can)."""
    info = info or installed()
    feature = info.features[FEATURE]
    if feature.present:
        return None
    return feature.reason

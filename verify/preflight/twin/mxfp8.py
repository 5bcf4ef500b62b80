"""The twin's MXFP8 parameters: ``--fp8-recipe mxfp8 --fp8-param-gather`` (and the grad-buffer reuse).

With MXFP8 params the candidate builds every weight of the twin's stages as an MXFP8 param
(E8M0 scales, E4M3 elements, blocks of 32 along the last dimension, floor scales;
:class:`verify.candidates.interfaces.MXFP8Params`) and its distributed optimizer on their
buffer: each step stages the fp32 master shards as bf16, all-gathers them (through the grad
buffer's bytes with ``--reuse-grad-buf-for-mxfp8-param-ag``), quantizes the gathered slices
into the MXFP8 params and zeroes the bucket (fastgrad: ``verify.candidates.fastgrad.stages``).
The stage modules compute in fp32 on the dequantized MXFP8 values.

The reference is ``refgrad.pipeline``'s model stepped by ``refgrad.optim`` whose forward
weights are ``refgrad.mxfp8.dequantize(quantize(bf16(master)))``
(:func:`verify.preflight.twin.reference.reference_with_mxfp8`); the twin compares every
MXFP8 param's scale and element bits after each step
(:func:`verify.preflight.twin.compare.compare_mxfp8_params`) besides the losses, reduced
grads, dequantized params, masters and AdamW state. With the buffer reused, a param
all-gather that overwrote grads before their reduce-scatter shows up as a reduced gradient
that differs from refgrad's. This module reads the settings from the configuration.
"""

from __future__ import annotations

from dataclasses import replace

from verify.candidates.interfaces import MXFP8_BLOCK
from verify.preflight.config import PreflightConfig
from verify.preflight.twin.variants import AdamWTwin, MXFP8Twin, twins_mxfp8

BLOCK = MXFP8_BLOCK  # MXFP8 block size (OCP Microscaling v1.0): the twin's hidden size is a multiple
SCALE_MODE = "floor"  # the OCP spec's rule, fastgrad.mxfp8.MXFP8Parameter's default


def mxfp8_twin_for(config: PreflightConfig, adamw: AdamWTwin) -> tuple[MXFP8Twin | None, list[str]]:
    """The twin's MXFP8 settings for ``config`` (None: no MXFP8 params), and what it leaves out."""
    if not twins_mxfp8(config):
        return None, []
    left_out = ["FP8 compute: production's GEMMs read MXFP8 operands (weights, and quantized "
                "activations and grads); the twin computes in fp32 on the dequantized MXFP8 "
                "weights",
                "which weights are MXFP8: production keeps biases, norms, the embedding and the "
                "output layer in bf16; the twin quantizes every weight, biases and output layer "
                f"included (floor scales, blocks of {BLOCK})"]
    if adamw.loss_scale is not None:
        left_out.append(f"loss scale {adamw.loss_scale:g}: fastgrad's MXFP8 buffer takes no loss "
                        "scaler, so the MXFP8 twin's AdamW steps unscaled grads")
        adamw = replace(adamw, loss_scale=None, dynamic=False)
    reuse = config.reuse_grad_buf_for_mxfp8_param_ag
    if reuse and not (config.overlap_grad_reduce and config.overlap_param_gather):
        left_out.append("grad-buffer reuse for the MXFP8 param all-gather without both overlaps: "
                        "fastgrad refuses it (Megatron-Core's NaN, see the hazards), so the twin "
                        "all-gathers into a separate buffer")
        reuse = False
    return MXFP8Twin(adamw=adamw, reuse_grad_buffer=reuse), left_out


def with_mxfp8_rows(mapping: tuple[tuple[str, str, str], ...], config: PreflightConfig,
                    mx: MXFP8Twin | None,
                    virtual_stages: int = 1) -> tuple[tuple[str, str, str], ...]:
    """``mapping`` as the MXFP8 twin runs it: its grad reduce and param all-gather rows say how
    fastgrad's MXFP8 buffer does them, and the MXFP8 rows come before ``steps``."""
    if mx is None:
        return mapping
    twin = {
        "overlap grad reduce": "False (the MXFP8 buffer reduce-scatters after the backward)",
        "param all-gather": "every bucket launched at the end of the step, then waited there "
                            "(quantized into the MXFP8 params; no forward pre-hooks)",
    }
    rows = [(name, production, twin.get(name, mine)) for name, production, mine in mapping]
    chunks = (f"; one MXFP8 buffer for this rank's {virtual_stages} model chunks, bucketed as "
              "its first" if virtual_stages > 1 else "")
    reuse = config.reuse_grad_buf_for_mxfp8_param_ag
    extra = [
        ("MXFP8 params", "fp32 master shard -> bf16 -> all-gather -> MXFP8 (the blocks' weights)",
         "fp32 master shard -> bf16 -> all-gather -> MXFP8 (every weight, floor scales; fastgrad "
         "MXFP8ParamGradBuffer + DistributedOptimizer); forward on the dequantized values" + chunks),
        ("param all-gather buffer", "the grad buffer's bytes" if reuse else "its own buffer",
         "the grad buffer's bytes" if mx.reuse_grad_buffer else "its own buffer"),
    ]
    at = next((i for i, row in enumerate(rows) if row[0] == "steps"), len(rows))
    return tuple(rows[:at] + extra + rows[at:])

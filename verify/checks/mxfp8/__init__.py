"""Check ``mxfp8``: MXFP8 quantization against the exact spec, and param/grad buffer sharing.

1. Quantizer: the candidate's (fastgrad: ``fastgrad.mxfp8``) vs ``refgrad.mxfp8``
   bitwise, every scale mode, on the special blocks (zeros, -0, NaN/inf, subnormal amax, amax 448*2^k,
   mantissa above 1.75, E4M3 ties) and random blocks (from ``ctx.seed``), for fp32, bf16 and
   fp16 inputs; dequantize likewise for every output dtype; its GPU kernel
   (fastgrad: Triton) too on CUDA. A conformance table puts torch's own casts and torchao's
   ``to_mx`` beside the spec; where they disagree it is a finding, not a failure.
2. Sharing: a 4-layer MXFP8 MLP trained 3 iterations on dp=2 gloo ranks with
   ``reuse_grad_buf_for_mxfp8_param_ag`` on and off (fp32 and bf16 grads):
   MXFP8 bits, scales, master shards and grads bitwise equal at every
   iteration, and the gathered MXFP8 params equal refgrad's quantization of
   the all-gathered master params.
3. Memory: bytes of the param+grad allocations (``untyped_storage().nbytes()``)
   with sharing on and off equal the expected saving; a 7B-540B table computed
   with ``refgrad.layout.compute_layout``, checking the published arithmetic.
4. Requantization drift MXFP8 -> bf16 -> MXFP8: the fraction of block scales
   that move, per mode.

Package layout: ``quantizer`` (part 1), ``sharing`` (part 2, the multi-rank worker glue),
``memory`` (part 3), ``drift`` (part 4), ``entry`` (the run function and the registration).
The implementation is reached only through ``candidate.mxfp8()``
(:mod:`verify.candidates.interfaces`).
"""

from verify.checks.mxfp8.drift import check_drift
from verify.checks.mxfp8.entry import CHECK, run
from verify.checks.mxfp8.memory import check_memory, toy_reference_numel
from verify.checks.mxfp8.quantizer import check_gpu_kernel, check_quantizer, conformance_table
from verify.checks.mxfp8.sharing import check_sharing

__all__ = [
    "CHECK",
    "check_drift",
    "check_memory",
    "check_quantizer",
    "check_sharing",
    "check_gpu_kernel",
    "conformance_table",
    "run",
    "toy_reference_numel",
]

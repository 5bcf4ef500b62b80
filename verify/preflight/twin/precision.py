"""The twin's precision: 16-bit (bf16/fp16) params and compute, and the main-grad buffer's dtype.

Under ``--bf16``/``--fp16`` production holds 16-bit params and runs the
forward and backward in that dtype; each microbatch's grads are added into the
DDP main-grad buffer of ``config.grad_dtype`` (fp32 with
``--accumulate-allreduce-grads-in-fp32``, the default under ``--bf16``, else
the param dtype), reduced over DP in that dtype, and the optimizer steps fp32
master copies and casts them back into the 16-bit params before the param
all-gather. The candidate does the same on the twin's ranks
(:class:`verify.candidates.interfaces.StageSettings`: the param dtype, the loss in fp32
on the 16-bit output, the grad buffer's dtype) and refgrad's model
(``refgrad.pipeline.precision``, its params cast by :func:`cast_stage_params_`) does it in one
process.

At twin TP 2 the same holds per TP rank (``refgrad.pipeline.tensor_parallel``): the
output layer's 16-bit partial dgrads are all-reduced (reduce-scattered under
SP) over TP in 16 bits, as are (tied) the vocab-parallel first layer's 16-bit
partial products, and, under SP, the blocks' grad-dtype ``main_grad`` is
all-reduced over TP after the DP sync; each such sum has two terms, so it is
bitwise. Where the reduction order of a 16-bit model's
grads is the backend's (DP > 2 without the fp32-accumulating reduce-scatter),
the twin runs DP 2: a grad differing by one rounding moves an fp32 master,
flips its 16-bit param's rounding, and every later 16-bit forward carries that
ULP of the 16-bit format, so no bound tight enough to catch a bug holds; at
DP 2 a sum of two values is one rounding in any order, so the check is bitwise.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from refgrad.pipeline import cast_params_
from verify.preflight.config import PreflightConfig
from verify.preflight.twin.variants import Dtype, TwinPrecision, twins_mxfp8


def precision_for(config: PreflightConfig, twin_tp: int, *, mxfp8: bool | None = None
                  ) -> tuple[TwinPrecision, int, list[str]]:
    """The twin's precision for ``config``, its DP size, and what it leaves out (with why).
    ``mxfp8``: whether the twin has MXFP8 params (None: as the configuration asks)."""
    if mxfp8 is None:
        mxfp8 = twins_mxfp8(config)
    if twin_tp not in (1, 2):
        raise ValueError(f"twin_tp must be 1 or 2 (the twin caps TP at 2), got {twin_tp}")
    dp = config.data_context_parallel_size  # the dp_cp group reduces the grads
    if mxfp8:  # the MXFP8 twin's own path: fp32 compute on dequantized weights
        left_out = []
        if config.params_dtype != "fp32":
            left_out.append(f"{config.params_dtype} params and compute with MXFP8 params: the MXFP8 "
                            "twin computes in fp32 on the dequantized weights (its masters go to "
                            "the gather as bf16, as production's)")
        if config.grad_dtype != "fp32":
            left_out.append(f"{config.grad_dtype} grad buffer with MXFP8 params: the MXFP8 twin's "
                            "buffer accumulates and reduces fp32 grads")
        if dp > 2:
            # The MXFP8 buffer reduce-scatters in the backend's order; one rounding moved by it
            # moves AdamW's update of an element whose moments are near eps far more than any
            # bound in ULPs of the largest element, and re-quantization carries it on.
            left_out.append(f"data parallelism DP {dp} scaled to DP 2 for the MXFP8 twin: its "
                            f"buffer sums the {dp} grads in the backend's order, which AdamW and "
                            "the re-quantization amplify past any useful ULP bound; at DP 2 the "
                            "sum is one rounding, bitwise (x 1/2 instead of x 1/DP)")
            dp = 2
        return TwinPrecision(), dp, left_out
    if config.params_dtype == "fp32":
        return TwinPrecision(), dp, []
    precision = TwinPrecision(Dtype(config.params_dtype), Dtype(config.grad_dtype))
    rs_fp32 = config.ddp_reduce_scatter_with_fp32_accumulation and config.use_distributed_optimizer
    left_out = []
    if config.gradient_accumulation_fusion:
        left_out.append("gradient-accumulation fusion (Megatron's default) on the blocks: "
                        "production's wgrad GEMMs "
                        f"accumulate into the {config.grad_dtype} main grad in fp32; the twin's "
                        f"Linear+tanh blocks round each microbatch's wgrad to {config.params_dtype} "
                        "before the add (its output layer's accumulation is the fused one)")
    if dp > 2 and not rs_fp32:
        return precision, 2, left_out + [
            f"data parallelism DP {dp} scaled to DP 2 for the {config.params_dtype} twin: the backend "
            f"chooses the order of the {dp}-term {config.grad_dtype} grad sum, and one rounding "
            f"moved by it flips a {config.params_dtype} param that every later step carries "
            "(a bound in 16-bit ULPs would hide real bugs); at DP 2 the sum is one rounding, "
            "bitwise (x 1/2 instead of x 1/DP)"]
    return precision, dp, left_out


def cast_stage_params_(params: Iterable[torch.Tensor], precision: TwinPrecision) -> None:
    """Round freshly built fp32 params to the param dtype, as production casts its model."""
    if precision.mixed:
        cast_params_(list(params), precision.param_dtype)


def precision_mapping(config: PreflightConfig, precision: TwinPrecision) -> tuple[tuple[str, str, str], ...]:
    """(setting, production, twin) rows for the param and grad dtypes."""
    twin_params = (f"{precision.params} params and compute, fp32 loss, fp32 master weights"
                   if precision.mixed else "fp32")
    production = (f"{config.params_dtype} params and compute, fp32 master weights"
                  if config.params_dtype != "fp32" else "fp32")
    return (("params and compute", production, twin_params),
            ("main-grad buffer and DP wire dtype", config.grad_dtype, precision.grads))

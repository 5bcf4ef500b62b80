"""The mxfp8 check's quantizer part: every scale mode vs refgrad bitwise, the Triton kernel, and the conformance table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from refgrad import mxfp8 as ref
from verify.candidates.interfaces import MXFP8
from verify.check import CheckContext, CheckRecorder
from verify.fixtures import mxfp8_inputs as support
from verify.metrics import bitwise_equal

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def as_e4m3(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float8_e4m3fn)


def as_e8m0(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float8_e8m0fnu)


# ----------------------------------------------------------------------------- quantizer


def _inputs(ctx: CheckContext, dtype: torch.dtype) -> tuple[list[str], torch.Tensor]:
    names, special = support.special_blocks(dtype)
    n_random = (32 if ctx.quick else 96) + len(names) % 2  # an even number of blocks
    random = support.random_blocks(n_random, ctx.generator(17 + DTYPES.index(dtype)), dtype)
    names = names + [f"random #{i}" for i in range(n_random)]
    # Two blocks per row, so the blocks also run along a last dimension of 64.
    return names, torch.cat([special, random]).reshape(-1, 2 * support.BLOCK)


def check_quantizer(
    ctx: CheckContext, rec: CheckRecorder, mxfp8: MXFP8
) -> dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The candidate's quantizer and dequantizer vs refgrad, bitwise; returns
    {(mode, dtype): (x, ref scales, ref elements)}."""
    results = {}
    for dtype in DTYPES:
        _, x = _inputs(ctx, dtype)
        if ctx.device == "cuda":
            x = x.cuda()
        for mode in ref.SCALE_MODES:
            ref_scales, ref_elements = ref.quantize(x.cpu(), scale_mode=mode)
            scales, elements = mxfp8.quantize(x, scale_mode=mode)
            label = f"quantize {mode} {DTYPE_NAMES[dtype]}"
            rec.compare(f"{label}: E8M0 scales", as_e8m0(ref_scales), as_e8m0(scales.cpu()))
            rec.compare(f"{label}: E4M3 elements", as_e4m3(ref_elements), as_e4m3(elements.cpu()))
            results[(mode, dtype)] = (x.cpu(), ref_scales, ref_elements)
    # Dequantize: every output dtype, from the fp32 inputs' codes of two modes.
    for mode in ("floor", "ceil"):
        _, ref_scales, ref_elements = results[(mode, torch.float32)]
        for out_dtype in DTYPES:
            expected = ref.dequantize(ref_scales, ref_elements, dtype=out_dtype)
            got = mxfp8.dequantize(ref_scales, ref_elements, dtype=out_dtype)
            rec.compare(f"dequantize {mode} codes -> {DTYPE_NAMES[out_dtype]}", expected, got)
    return results


def check_gpu_kernel(ctx: CheckContext, rec: CheckRecorder, mxfp8: MXFP8) -> None:
    """The candidate's GPU kernel (fastgrad: Triton) vs refgrad, bitwise, per mode (CUDA only;
    else a skip, as when the candidate has no kernel here)."""
    if ctx.device != "cuda":
        rec.skip("GPU quantization kernel: needs ctx.device='cuda' (the quantizer ran on the CPU instead)")
        return
    kernel = mxfp8.gpu_kernel()
    for dtype in DTYPES:
        _, x = _inputs(ctx, dtype)
        for mode in ref.SCALE_MODES:
            ref_scales, ref_elements = ref.quantize(x, scale_mode=mode)
            scales, elements = kernel(x.cuda(), scale_mode=mode)
            label = f"{kernel.name} {mode} {DTYPE_NAMES[dtype]}"
            rec.compare(f"{label}: scales", as_e8m0(ref_scales), as_e8m0(scales.cpu()))
            rec.compare(f"{label}: elements", as_e4m3(ref_elements), as_e4m3(elements.cpu()))


def _agreement(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{100.0 * a.eq(b).double().mean().item():.1f}%"


def conformance_table(
    ctx: CheckContext,
    rec: CheckRecorder,
    results: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    candidate_name: str,
    mxfp8: MXFP8,
) -> None:
    """The candidate and peers beside the spec on the same fp32/bf16 inputs; the peers'
    disagreements become findings."""
    peers: dict[str, Callable[[torch.Tensor, str], Any]] = {
        candidate_name: lambda x, mode: mxfp8.quantize(x, scale_mode=mode),
        "torch casts (naive)": support.torch_cast_quantize,
        "spec scale + torch e4m3 cast": support.torch_cast_elements,
    }
    if not support.torchao_available():
        rec.skip("torchao is not installed: its column is left out of the conformance table")
    elif ctx.quick:
        rec.skip("torchao column left out in quick mode (importing torchao takes seconds)")
    else:
        peers["torchao to_mx"] = support.torchao_quantize
    rows = []
    cast_finite_mismatches = []
    for mode in ref.SCALE_MODES:
        for peer, fn in peers.items():
            cells = [mode, peer]
            for dtype in (torch.float32, torch.bfloat16):
                x, ref_scales, ref_elements = results[(mode, dtype)]
                scales, elements = fn(x, mode)
                cells += [_agreement(ref_scales, scales), _agreement(ref_elements, elements)]
                if peer == "spec scale + torch e4m3 cast":
                    finite = (ref_scales != 0xFF).repeat_interleave(support.BLOCK, dim=-1)
                    differ = ref_elements.ne(elements) & finite
                    # The spec saturates to ±448 (0x7E/0xFE); a non-saturating cast gives NaN.
                    to_nan = differ & (ref_elements & 0x7F).eq(0x7E) & (elements & 0x7F).eq(0x7F)
                    cast_finite_mismatches.append((int(to_nan.sum()), int((differ & ~to_nan).sum())))
                if dtype == torch.float32 and peer != candidate_name:
                    _disagreement_findings(rec, peer, mode, (ref_scales, ref_elements), (scales, elements))
            rows.append(cells)
    if "torchao to_mx" in peers:
        rec.note(
            "torchao to_mx, why it differs: (1) a block holding +-inf gets a finite scale in "
            "floor/ceil/even (inf's exponent field read as a number: code 247) and 0xFE in "
            "rceil (Transformer Engine's convention), where the spec says NaN (0xFF); "
            "(2) a block whose scale is 2^-127 (code 0) is divided by 2^-126, because torchao "
            "clamps the float32 scale to the smallest normal: its elements are half the "
            "spec's, so dequantizing with its own scale halves the values (in rceil the "
            "reciprocal becomes 1.0 and the elements flush to 0); (3) rceil takes "
            "ceil(log2(amax/448)) with a float32 log2, which rounds log2 of an amax just above "
            "448*2^k down to k when |k| is large enough: one code too small, so the largest "
            "element saturates; (4) NaN blocks: the elements beside the NaN are not NaN codes "
            "(a definitional difference: the NaN scale makes every value NaN either way)."
        )
    saturated_to_nan = sum(n for n, _ in cast_finite_mismatches)
    other = sum(n for _, n in cast_finite_mismatches)
    if saturated_to_nan + other == 0:
        why = " (it rounds to nearest even and saturates, as the spec);"
    else:
        why = (f": {saturated_to_nan} where the spec saturates to ±448 (0x7E/0xFE) and the cast "
               "gives NaN (0x7F/0xFF), as torch's e4m3fn cast past 464 does before torch 2.13 "
               f"(verify.torch_casts), and {other} other(s);")
    rec.note(
        f"torch {torch.__version__} .to(float8_e4m3fn) of exactly scaled values (spec scale, "
        f"x*2^-e in float64): {saturated_to_nan + other} element(s) differ from the spec inside "
        "finite blocks, over every mode and input dtype" + why
        + " inside NaN/inf blocks it differs by definition (the spec makes every element NaN)."
    )
    rec.table(
        "MXFP8 conformance: share of bits equal to refgrad (the spec), same inputs",
        ["mode", "quantizer", "fp32 scales", "fp32 elements", "bf16 scales", "bf16 elements"],
        rows,
        notes=[
            f"inputs per dtype: {len(support.special_blocks()[0])} special blocks + "
            "random blocks (half wide-exponent normals, half raw bit patterns, so NaN/inf "
            "blocks appear at their natural rate)",
            "torch casts (naive): (amax/448).to(float8_e8m0fnu), (x/scale).to(float8_e4m3fn); "
            "it has no scale modes",
        ],
    )


def _disagreement_findings(
    rec: CheckRecorder,
    peer: str,
    mode: str,
    spec: tuple[torch.Tensor, torch.Tensor],
    peer_bits: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Name the special blocks (the first rows of the inputs) where ``peer`` differs from the spec."""
    names = support.special_blocks(torch.float32)[0]
    ref_s, ref_e = spec[0].reshape(-1), spec[1].reshape(-1, support.BLOCK)
    got_s, got_e = peer_bits[0].reshape(-1), peer_bits[1].reshape(-1, support.BLOCK)
    bad = []
    for i, name in enumerate(names):
        if bitwise_equal(ref_s[i], got_s[i]) and bitwise_equal(ref_e[i], got_e[i]):
            continue
        if bitwise_equal(ref_s[i], got_s[i]):
            bad.append(f"{name} ({int(ref_e[i].ne(got_e[i]).sum())} element(s) differ)")
        else:
            bad.append(f"{name} (scale {int(got_s[i])} vs spec {int(ref_s[i])})")
    if bad:
        rec.note(f"{peer}, mode {mode}: differs from the spec on special blocks: " + "; ".join(bad))


def rceil_versus_fp32_division(ctx: CheckContext, rec: CheckRecorder, mxfp8: MXFP8) -> None:
    """The candidate's rceil vs Transformer Engine's recipe: ``amax / 448`` in fp32, then
    ceil(log2) of it.

    Random positive fp32 amax values plus the neighbours of 1.75 * 2^k for every k, each the
    amax of a block of its own (the rest zeros), whose scale code the candidate computes.
    """
    count = 1 << (14 if ctx.quick else 18)
    random_bits = torch.randint(0, 0x7F800000, (count,), generator=ctx.generator(99), dtype=torch.int64)
    binades = torch.arange(1, 255, dtype=torch.int64) << 23
    near_1_75 = torch.cat([(binades | 0x600000) + d for d in (-2, -1, 0, 1, 2)])
    bits = torch.cat([random_bits, near_1_75]).to(torch.int32)
    quotient = (bits.view(torch.float32) / 448.0).view(torch.int32)
    field, fraction = quotient >> 23, quotient & 0x7FFFFF
    divided = torch.where(field == 0, -127, field - 127 + (fraction != 0).to(torch.int32))
    blocks = torch.zeros(bits.numel(), support.BLOCK, dtype=torch.float32)
    blocks[:, 0] = bits.view(torch.float32)
    scale_bits, _ = mxfp8.quantize(blocks, scale_mode="rceil")
    exact = scale_bits.reshape(-1).to(torch.int32) - 127
    differ = divided.clamp(-127, 127) != exact
    outside = int((differ & (field != 0)).sum())
    rec.expect(
        "exact rceil equals ceil(log2(fp32(amax / 448))) wherever the quotient is an fp32 normal",
        outside == 0,
        f"{outside} disagreement(s) outside the subnormal-quotient range",
    )
    rec.note(
        f"rceil, exact vs Transformer Engine's fp32 division: over {bits.numel():,} fp32 amax "
        f"values they differ on {int(differ.sum())}, all where amax/448 is an fp32 subnormal "
        "(amax < 448 * 2^-126): the rounded quotient loses the bits that decide the ceiling"
    )

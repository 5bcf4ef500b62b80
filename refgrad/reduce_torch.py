"""Reference semantics of torch's own data-parallel gradient reductions, element by element.

Each departs from refgrad's spec of the DP mean (``refgrad.reduce_scatter``: accumulated in
fp32 in rank order, rounded once) by design; these are refgrad's models of them, built from
``refgrad.reduce_scatter``'s collectives and one visible rounding per step
(``refgrad.formats``), each following the torch 2.13 source it names:

* :func:`cast`: ``Tensor.to(dtype)``, rounded to nearest even (exact when widening).
* :func:`divide_like_torch`: ``Tensor.div_(d)`` by a Python number. On the CPU
  (``aten/src/ATen/native/cpu/BinaryOpsKernel.cpp``, ``div_true_kernel``) the quotient is
  computed in the op-math type (fp32 for 16-bit tensors) and rounded to the tensor's dtype;
  on CUDA (``BinaryDivTrueKernel.cu``) a scalar divisor is turned into a multiplication by
  its reciprocal, ``x * fp32(1/d)``. Both agree when ``d`` is a power of two.
* :func:`compress_hook_all_reduce`: DDP's ``fp16_compress_hook`` / ``bf16_compress_hook``
  (``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``, ``_compress_hook``):
  ``buffer.to(dtype).div_(world_size)``, an all-reduce SUM in that dtype (the backend's
  order), then ``decompress`` copies the result back into the bucket (its dtype).
* :func:`fsdp2_divide_factors` (a :class:`FSDP2DivideFactors`) and
  :func:`fsdp2_reduce_scatter`: FSDP2's
  ``foreach_reduce`` (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``): the
  grads cast to ``reduce_dtype``, divided by ``predivide_factor``, reduce-scattered with the
  op ``_get_gradient_divide_factors`` chose, divided by ``postdivide_factor``, cast to the
  sharded parameter's dtype.
* :func:`fsdp2_accumulate` : microbatches under ``set_requires_gradient_sync(False)``
  (``_fsdp_param.FSDPParam.to_accumulated_grad_if_needed`` and
  ``accumulate_unsharded_grad_if_needed``): the first grad cast to ``reduce_dtype`` (when it
  is set and differs), each later one added to it in that dtype.

``ReduceOp.AVG`` is the backend's: gloo (torch 2.13) sums in the wire dtype, then divides
by ``W`` once (``refgrad.reduce_scatter``'s ``op=Averaging.AVG``); NCCL turns a floating-point AVG
into a pre-multiplication by ``1/W`` rounded to the wire dtype, then a SUM
(``src/enqueue.cc``, ``hostToDevRedOp``: ``ncclDevPreMulSum``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from gradvocab import Averaging
from refgrad import formats
from refgrad import reduce_scatter as refc

AVG_BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")


def _per_value(t: torch.Tensor, dtype: torch.dtype, fn) -> torch.Tensor:
    """``fn`` on every decoded value of ``t``, the results rounded to ``dtype`` (once each)."""
    fmt = formats.format_of(dtype)
    values = [fn(v) for v in formats.decode_tensor(t.detach().cpu().contiguous())]
    return formats.round_values_to_tensor(fmt, values, tuple(t.shape))


def cast(per_rank: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Every tensor rounded to ``dtype`` (to nearest even; exact when widening)."""
    return [_per_value(t, dtype, lambda v: v) for t in per_rank]


def _times(value: formats.Value, factor: Fraction) -> formats.Value:
    if isinstance(value, formats.Special):
        return value  # NaN, +-inf and -0 keep their identity under a positive factor
    return value * factor


def divide_like_torch(per_rank: Sequence[torch.Tensor], divisor: float, *,
                      device: str = "cpu") -> list[torch.Tensor]:
    """``t.div_(divisor)`` for every tensor, as torch computes it on ``device`` (module doc).

    The divisor and the op-math are fp32 (16-bit and fp32 tensors); the result is rounded to
    fp32, then to the tensor's dtype (an innocuous double rounding: 24 >= 2p + 2)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    d32 = formats.round_to_value(formats.FLOAT32, Fraction(divisor))
    if not isinstance(d32, Fraction) or d32 <= 0:
        raise ValueError(f"divisor must be a positive finite number, got {divisor!r}")
    out = []
    for t in per_rank:
        if device == "cpu":
            def step(v, d32=d32):
                return formats.round_to_value(formats.FLOAT32, _times(v, 1 / d32))
        else:
            reciprocal = formats.round_to_value(formats.FLOAT32, 1 / d32)

            def step(v, reciprocal=reciprocal):
                return formats.round_to_value(formats.FLOAT32, _times(v, reciprocal))
        out.append(_per_value(t, t.dtype, step))
    return out


def compress_hook_all_reduce(per_rank: Sequence[torch.Tensor], wire: torch.dtype, *, order: str,
                             device: str = "cpu") -> list[torch.Tensor]:
    """DDP's ``fp16_compress_hook`` / ``bf16_compress_hook`` on a bucket (``wire`` =
    ``torch.float16`` / ``torch.bfloat16``): every rank's bucket cast to ``wire``, divided by
    ``W`` there (:func:`divide_like_torch`), all-reduced (SUM, the partial sums rounded to
    ``wire``, in ``order``: gloo ``ring_reverse``, NCCL ``ring``), cast back to the bucket's
    dtype (exact). Returns every rank's bucket."""
    if not per_rank:
        raise ValueError("per_rank must hold one bucket per rank")
    compressed = divide_like_torch(cast(per_rank, wire), len(per_rank), device=device)
    summed = refc.all_reduce(compressed, accumulate="wire", order=order, op=Averaging.SUM)
    return cast(summed, per_rank[0].dtype)


@dataclass(frozen=True)
class FSDP2DivideFactors:
    """What ``_get_gradient_divide_factors`` decides for one reduce-scatter (torch 2.13,
    ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``): the collective's ``op``
    (``Averaging.AVG`` or ``Averaging.SUM``), the divisors applied to every rank's input before
    it (``predivide``) and to the result after it (``postdivide``), and torch's
    ``ReduceOp.PREMUL_SUM(premultiplier)``: a SUM whose every input is first multiplied by
    ``premultiplier`` (``1 / factor``), which is no ``Averaging`` and so is its own field.

    The combinations are torch's three answers: AVG alone; a SUM with divisors (or none);
    a PREMUL_SUM alone. A divisor is None where torch divides by nothing."""

    op: Averaging
    predivide: float | None = None
    postdivide: float | None = None
    premultiplier: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.op, Averaging) or self.op not in (Averaging.AVG, Averaging.SUM):
            raise ValueError(f"FSDP2DivideFactors.op must be Averaging.AVG or Averaging.SUM "
                             f"(torch's ReduceOp.AVG / ReduceOp.SUM), got {self.op!r}")
        for name in ("predivide", "postdivide", "premultiplier"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, float):
                raise TypeError(f"FSDP2DivideFactors.{name} must be None or a float, "
                                f"got {type(value).__name__}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"FSDP2DivideFactors.{name} must be a positive finite float, "
                                 f"got {value!r}")
        dividing = self.predivide is not None or self.postdivide is not None
        if self.op is Averaging.AVG and (dividing or self.premultiplier is not None):
            # torch's AVG branch returns (None, None, AVG): an AVG is never scaled around
            raise ValueError("FSDP2DivideFactors: op AVG takes no predivide, postdivide or "
                             "premultiplier (the collective divides)")
        if self.premultiplier is not None and dividing:
            # torch's PREMUL_SUM branch returns (None, None, PREMUL_SUM(1/factor))
            raise ValueError("FSDP2DivideFactors: premultiplier (PREMUL_SUM) excludes predivide "
                             "and postdivide")

    @property
    def premul_sum(self) -> bool:
        """Whether the collective is torch's ``PREMUL_SUM`` (a SUM of premultiplied inputs)."""
        return self.premultiplier is not None


def fsdp2_divide_factors(reduce_dtype: torch.dtype, world_size: int, *, factor: float | None = None,
                         force_sum: bool = False) -> FSDP2DivideFactors:
    """``_get_gradient_divide_factors`` (one reduce-scatter group, no all-reduce group).

    fp32 and bf16 (no overflow risk), not forced to SUM: no factor -> AVG in the collective
    (SUM at W = 1); ``factor == W`` -> AVG; another factor -> PREMUL_SUM(1/factor). Otherwise
    (fp16, or forced): the factor (default W) split as ``pre * post``, ``pre`` the largest
    power of two with ``factor % pre == 0`` and ``factor / pre > pre`` before doubling stops
    (fp16), or no predivide and ``post = factor`` (forced fp32/bf16), then SUM."""
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum:
        if factor is None:
            return FSDP2DivideFactors(Averaging.SUM if world_size == 1 else Averaging.AVG)
        if factor == world_size:
            return FSDP2DivideFactors(Averaging.AVG)
        return FSDP2DivideFactors(Averaging.SUM, premultiplier=1 / factor)
    if factor is None:
        factor = float(world_size)
    if overflow_risk:
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return FSDP2DivideFactors(Averaging.SUM, predivide=float(pre), postdivide=factor / pre)
    return FSDP2DivideFactors(Averaging.SUM, postdivide=float(factor))


def _avg_by_premultiplying(per_rank: Sequence[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    """NCCL's AVG: every element times the scalar ``(float)(1.0 / nRanks)`` rounded to its
    dtype, the product rounded once."""
    out = []
    for t in per_rank:
        as_float = formats.round_to_value(formats.FLOAT32, Fraction(1, world_size))
        scalar = formats.round_to_value(formats.format_of(t.dtype), as_float)
        out.append(_per_value(t, t.dtype, lambda v, s=scalar: _times(v, s)))
    return out


def fsdp2_reduce_scatter(per_rank_inputs: Sequence[torch.Tensor], *, reduce_dtype: torch.dtype | None,
                         orig_dtype: torch.dtype, order: str, avg_backend: str = "gloo",
                         device: str = "cpu", factor: float | None = None,
                         force_sum: bool = False) -> list[torch.Tensor]:
    """``foreach_reduce`` on every rank's reduce-scatter input (the grads' dtype, ``W``
    equal chunks, :func:`refgrad.layout_torch.fsdp2_reduce_scatter_placement`): cast to
    ``reduce_dtype`` (None: the grads' dtype), pre-divide, reduce-scatter in that dtype
    (``order``; AVG as ``avg_backend`` does it), post-divide, cast to ``orig_dtype``.
    Returns rank ``r``'s chunk for every ``r``."""
    if avg_backend not in AVG_BACKENDS:
        raise ValueError(f"avg_backend must be one of {AVG_BACKENDS}, got {avg_backend!r}")
    world = len(per_rank_inputs)
    dtype = reduce_dtype or per_rank_inputs[0].dtype
    factors = fsdp2_divide_factors(dtype, world, factor=factor, force_sum=force_sum)
    if factors.premul_sum:
        raise ValueError("PREMUL_SUM (a gradient divide factor other than W with fp32/bf16 "
                         "reduce_dtype) is not modelled")
    op, pre, post = factors.op, factors.predivide, factors.postdivide
    inputs = cast(per_rank_inputs, dtype)
    if pre is not None and pre != 1:
        inputs = divide_like_torch(inputs, pre, device=device)
    if op is Averaging.AVG and avg_backend == "nccl":
        inputs, op = _avg_by_premultiplying(inputs, world), Averaging.SUM
    outputs = refc.reduce_scatter(inputs, accumulate="wire", order=order, op=op)
    if post is not None and post != 1:
        outputs = divide_like_torch(outputs, post, device=device)
    return cast(outputs, orig_dtype)


def fsdp2_accumulate(microbatch_grads: Sequence[torch.Tensor], *,
                     reduce_dtype: torch.dtype | None) -> torch.Tensor:
    """One rank's unsharded grad after the microbatches of a step (in order): the first cast
    to ``reduce_dtype`` when set and not the grads' dtype, each later one added in the
    accumulator's dtype (one rounding per addition)."""
    if not microbatch_grads:
        raise ValueError("microbatch_grads must hold at least one grad")
    first = microbatch_grads[0]
    dtype = reduce_dtype if reduce_dtype is not None and reduce_dtype != first.dtype else first.dtype
    fmt = formats.format_of(dtype)
    (acc,) = cast([first], dtype)
    values = formats.decode_tensor(acc)
    for grad in microbatch_grads[1:]:
        values = [refc.add(fmt, a, b) for a, b in zip(values, formats.decode_tensor(grad.contiguous()))]
    return formats.round_values_to_tensor(fmt, values, tuple(first.shape))


__all__ = ["AVG_BACKENDS", "FSDP2DivideFactors", "cast", "compress_hook_all_reduce", "divide_like_torch",
           "fsdp2_accumulate", "fsdp2_divide_factors", "fsdp2_reduce_scatter"]

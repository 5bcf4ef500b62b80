"""Inputs, peer quantizers and a toy training run shared by the ``mxfp8`` check, tests and bench.

* :func:`special_blocks` — the blocks the spec has explicit rules for.
* :func:`random_blocks` — seeded blocks with wide exponent spread and raw bit patterns.
* Peers: :func:`torch_cast_quantize` (a naive quantizer built on torch's own
  ``float8_e8m0fnu``/``float8_e4m3fn`` casts), :func:`torch_cast_elements`
  (the spec's scale, torch's element cast) and :func:`torchao_quantize`
  (``torchao.prototype.mx_formats.mx_tensor.to_mx``; None when not installed).
* :func:`train_toy_rank` — a 4-layer MXFP8 MLP trained with the distributed
  optimizer on one gloo rank, sharing on or off, returning per-iteration bits.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from fastgrad import mxfp8
from fastgrad.config import DDPConfig
from fastgrad.mxfp8_sharing import MXFP8Parameter, MXFP8ParamGradBuffer, ShardedOptimizer

BLOCK = 32
F32_MAX = torch.finfo(torch.float32).max


def _next_up(value: float, dtype: torch.dtype) -> float:
    t = torch.tensor(value, dtype=dtype)
    return torch.nextafter(t, torch.tensor(float("inf"), dtype=dtype)).item()


def _block(fill: list[float], base: float = 0.0, *, negative_rest: bool = False) -> list[float]:
    """A block of 32: ``fill`` first, then a ramp of small values scaled by ``base``."""
    rest = [base * (k + 1) / 64 * (-1 if negative_rest and k % 2 else 1) for k in range(BLOCK - len(fill))]
    return fill + rest


def special_blocks(dtype: torch.dtype = torch.float32) -> tuple[list[str], torch.Tensor]:
    """(names, tensor of shape (n, 32)) for every block the spec has an explicit rule for."""
    nan, inf = float("nan"), float("inf")
    tiny = torch.finfo(dtype).smallest_normal
    blocks: dict[str, list[float]] = {
        "all +0": [0.0] * BLOCK,
        "all -0": [-0.0] * BLOCK,
        "+0/-0 mix": [0.0 if k % 2 else -0.0 for k in range(BLOCK)],
        "-0 beside negatives": _block([-0.0, -3.0, -0.0, 1.0], 1.0, negative_rest=True),
        "NaN inside": _block([1.0, nan, -2.0], 1.0),
        "+inf inside": _block([inf, 5.0], 1.0),
        "-inf inside": _block([-inf, 5.0], 1.0),
        "NaN and inf": _block([nan, inf, -inf], 1.0),
        "subnormal amax": [tiny * (k + 1) / 64 * (-1) ** k for k in range(BLOCK)],
        "single subnormal": _block([tiny / 4], 0.0),
        "amax 448": _block([448.0, -447.0 / 4], 3.0),
        "amax 448*2^-20": _block([448.0 * 2**-20], 2.0**-20),
        "amax -448*2^10": _block([-448.0 * 2**10], 2.0**10),
        "amax 448*2^-120 (clamped)": _block([448.0 * 2**-120], 2.0**-120),
        "mantissa 1.75+ulp": _block([_next_up(1.75, dtype)], 0.5),
        "mantissa 1.75+ulp *2^10": _block([_next_up(1.75 * 2**10, dtype)], 2.0**9),
        "mantissa 1.75+ulp *2^-30": _block([-_next_up(1.75 * 2**-30, dtype)], 2.0**-31),
        "mantissa 1.875": _block([1.875 * 2**3], 2.0),
        "mantissa 1.9375 (even carry)": _block([1.9375], 0.25),
        "mantissa 1.99": _block([_next_up(1.984375, dtype)], 0.5),
        "amax power of two": _block([2.0**5, -(2.0**4)], 1.0),
        "E4M3 ties (amax 448)": _block(
            [448.0, 8.5, 9.5, -10.5, 11.5, 12.5, -13.5, 14.5, 15.5, 1.0625, -1.1875]
            + [k * 2.0**-10 for k in (1, 3, 5, -7, 9, 11, 13, 15, 17)]
            + [464.0 / 2, -240.0 - 8.0, 464.0 - 0.5]
        ),
        "values rounding to -0": _block([256.0, -(2.0**-10), -(2.0**-12)], 0.0),
        "amax 2^-119 (smallest unclamped)": _block([2.0**-119], 2.0**-121),
        "amax near float max": _block([F32_MAX if dtype != torch.float16 else 65504.0, -1.0], 1.0),
    }
    names = list(blocks)
    values = torch.tensor([blocks[n] for n in names], dtype=torch.float64).to(dtype)
    return names, values


def random_blocks(
    n_blocks: int, generator: torch.Generator, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Seeded blocks: half normal values with a per-block exponent in [-140, 125], half raw bits.

    Raw bit patterns cover NaN/inf/subnormal blocks at their natural rates.
    """
    half = n_blocks // 2
    scale = torch.exp2(torch.randint(-140, 126, (half, 1), generator=generator).double())
    normal = (torch.randn(half, BLOCK, generator=generator, dtype=torch.float64) * scale).to(dtype)
    raw_count = (n_blocks - half) * BLOCK
    if dtype == torch.float32:
        raw = torch.randint(-(2**31), 2**31, (raw_count,), generator=generator, dtype=torch.int64)
        raw = raw.to(torch.int32).view(torch.float32)
    else:
        raw = torch.randint(-(2**15), 2**15, (raw_count,), generator=generator, dtype=torch.int32)
        raw = raw.to(torch.int16).view(dtype)
    return torch.cat([normal, raw.reshape(-1, BLOCK)])


# ------------------------------------------------------------------------- peers

QuantizeFn = Callable[[torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]


def torch_cast_quantize(x: torch.Tensor, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A naive MXFP8 quantizer from torch's casts: ``(amax/448).to(e8m0)``, ``(x/scale).to(e4m3)``.

    Ignores ``scale_mode``: torch's e8m0 cast has a rounding of its own.
    """
    blocks = x.float().reshape(-1, BLOCK)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    scale = (amax / 448.0).to(torch.float8_e8m0fnu)
    elements = (blocks / scale.float()).to(torch.float8_e4m3fn)
    scale_shape = (*x.shape[:-1], x.shape[-1] // BLOCK)
    return scale.view(torch.uint8).reshape(scale_shape), elements.view(torch.uint8).reshape(x.shape)


def torch_cast_elements(x: torch.Tensor, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's scale, with elements from torch's ``float8_e4m3fn`` cast of ``x * 2^-e``.

    ``x * 2^-e`` is exact in float64, so only the cast's rounding is under test.
    """
    scale_bits, _ = mxfp8.quantize(x, scale_mode=scale_mode)
    exponent = scale_bits.to(torch.float64).sub(127).reshape(-1, 1)
    scaled = x.double().reshape(-1, BLOCK) * torch.exp2(-exponent)
    elements = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(x.shape)
    return scale_bits, elements


def torchao_available() -> bool:
    """True when torchao can be imported (found on the path; not imported here)."""
    return importlib.util.find_spec("torchao") is not None


@contextlib.contextmanager
def _quiet_import() -> Any:
    """Importing torchao logs warnings (missing CUDA extensions, torch pytree deprecations)."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    previous = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, previous):
            logger.setLevel(level)


def torchao_to_mx() -> Callable[..., Any] | None:
    """``(to_mx, ScaleCalculationMode)`` from torchao, or None when torchao is not installed."""
    if not torchao_available():
        return None
    with _quiet_import():
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    return lambda x, mode: to_mx(x, torch.float8_e4m3fn, BLOCK, ScaleCalculationMode(mode))


def torchao_quantize(x: torch.Tensor, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """torchao's ``to_mx`` bits, or None without torchao (fp16 input goes through fp32, exactly)."""
    to_mx = torchao_to_mx()
    if to_mx is None:
        return None
    source = x.float() if x.dtype == torch.float16 else x
    scale, data = to_mx(source.contiguous(), scale_mode)
    return scale.view(torch.uint8).reshape(*x.shape[:-1], -1), data.view(torch.uint8).reshape(x.shape)


# ------------------------------------------------------------------------- toy training

TOY_SHAPES: tuple[tuple[int, int], ...] = ((64, 64), (32, 64), (32, 32), (8, 32))
TOY_BUCKET_SIZE = 1000  # three buckets for the toy model's 7,424 elements


def toy_config(*, sharing: bool, grad_fp32: bool) -> DDPConfig:
    """The production configuration for MXFP8 params, sharing on or off."""
    return DDPConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        fp8_param_gather=True,
        reuse_grad_buf_for_mxfp8_param_ag=sharing,
        grad_reduce_in_fp32=grad_fp32,
        bucket_size=TOY_BUCKET_SIZE,
    )


def train_toy_rank(
    rank: int,
    world_size: int,
    sharing: bool,
    grad_fp32: bool,
    iterations: int,
    optimizer_kind: str = "adam",
    scale_mode: str = "floor",
    seed: int = 0,
    microbatches: int = 2,
) -> dict[str, Any]:
    """Train the toy MLP on this rank; return per-iteration bits and the buffer's bytes.

    Weights are initialised identically on every rank; the data are rank-specific.
    """
    init = torch.Generator().manual_seed(seed)
    weights = [
        MXFP8Parameter(torch.randn(shape, generator=init) * 0.25, scale_mode=scale_mode)
        for shape in TOY_SHAPES
    ]
    buffer = MXFP8ParamGradBuffer(weights, config=toy_config(sharing=sharing, grad_fp32=grad_fp32))
    optimizer = ShardedOptimizer(buffer, kind=optimizer_kind, lr=1e-2)
    snapshots = []
    for iteration in range(iterations):
        buffer.zero_grad()
        optimizer.stage()
        buffer.gather_all_params()
        losses = []
        for micro in range(microbatches):
            data = torch.Generator().manual_seed(
                1_000_003 * seed + 10_007 * iteration + 101 * rank + micro
            )
            x = torch.randn(4, TOY_SHAPES[0][1], generator=data)
            target = torch.randn(4, TOY_SHAPES[-1][0], generator=data)
            leaves = [w.dequantize(torch.float32).requires_grad_(True) for w in weights]
            h = x
            for i, leaf in enumerate(leaves):
                h = h @ leaf.T
                if i < len(leaves) - 1:
                    h = torch.relu(h)
            loss = ((h - target) ** 2).mean()
            loss.backward()
            losses.append(loss.detach())
            for weight, leaf in reversed(list(zip(weights, leaves))):
                buffer.accumulate_grad(weight, leaf.grad)
        buffer.reduce_grads()
        snapshot = {
            "scale_bits": [w.scale_bits.clone() for w in weights],
            "element_bits": [w.element_bits.clone() for w in weights],
            "grads": buffer.grad_data.clone(),
            "local_grad_shards": [b.local_grad_shard.clone() for b in buffer.buckets],
            "masters_before": [m.clone() for m in optimizer.master_shards],
            "loss": torch.stack(losses),
        }
        optimizer.step()
        snapshot["masters_after"] = [m.clone() for m in optimizer.master_shards]
        snapshots.append(snapshot)
    return {
        "snapshots": snapshots,
        "allocated_bytes": buffer.allocated_bytes(),
        "numel": buffer.numel,
        "sharing": buffer.sharing,
        "shard_ranges": [b.local_shard_range for b in buffer.buckets],
        "param_ranges": [buffer.param_range(w) for w in weights],
    }


def train_both_modes_rank(
    rank: int,
    world_size: int,
    iterations: int,
    optimizer_kind: str,
    seed: int,
    grad_fp32_options: tuple[bool, ...] = (True, False),
) -> dict[tuple[bool, bool], dict[str, Any]]:
    """Run :func:`train_toy_rank` for sharing off/on x the grad dtypes, in one process.

    Keys are ``(sharing, grad_fp32)``; tensors come back by value through
    :func:`verify.distributed.spawn`'s plain pickling.
    """
    return {
        (sharing, grad_fp32): train_toy_rank(
            rank, world_size, sharing, grad_fp32, iterations, optimizer_kind, "floor", seed
        )
        for grad_fp32 in grad_fp32_options
        for sharing in (False, True)
    }

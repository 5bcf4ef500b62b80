"""Run Megatron-Core's own code on a machine without CUDA: one context manager, undone on exit.

Megatron-Core hard-codes its device: it allocates with ``device="cuda"`` and
``device=torch.cuda.current_device()``, moves tensors with ``.cuda()``, checks
params by the type names ``torch.cuda.FloatTensor`` / ``HalfTensor`` /
``BFloat16Tensor``, and accumulates wgrads through apex's CUDA extension
``fused_weight_gradient_mlp_cuda``. :func:`cpu_redirects` points each of those
at the CPU for the duration of a ``with`` block and records which of them
actually fired, so a report can list them:

==========================  ===============================================================
redirect                    what it does inside the block
==========================  ===============================================================
``current_device``          ``torch.cuda.current_device()`` returns ``"cpu"``
``cuda_factory_device``     a ``device="cuda"`` (or ``cuda:N``, or a bare int) argument of a
                            torch function becomes ``"cpu"`` (a ``TorchFunctionMode``)
``tensor_cuda``             ``Tensor.cuda()`` returns the tensor itself (it stays on the CPU)
``tensor_type_name``        ``Tensor.type()`` (no argument) reports ``torch.cuda.<T>Tensor``
``synchronize``             ``torch.cuda.synchronize()`` does nothing (the CPU is synchronous)
``current_stream``          ``torch.cuda.current_stream()`` returns ``torch.cpu.current_stream()``
                            (torch's device-agnostic stand-in: ``wait_event`` / ``wait_stream``
                            do nothing). From 0.17 on, ``_ParamAndGradBucketGroup.start_grad_sync``
                            asks for the current stream to wait for CUDA-graph wgrad events
``wgrad_gemm_accum_fp32``   apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``:
                            ``main_grad += grad_outputᵀ · input``, the GEMM in fp32 on the
                            16-bit inputs' exact fp32 values, then one fp32 add (cuBLAS with
                            an fp32 compute type, alpha = beta = 1, fp32 output)
``wgrad_gemm_accum_fp16``   the same GEMM, the fp32 add rounded once to ``main_grad``'s
                            16-bit dtype (apex's fp16/bf16 output variant)
==========================  ===============================================================

Only the first four are what every run needs (``current_stream`` too where the
installed version's grad sync asks for it); the stand-in extension is what the
deferred embedding wgrad needs (Megatron requires gradient-accumulation fusion for it).
The GEMM's summation order is the CPU BLAS's, not cuBLAS's: a comparison of these
wgrads needs a bound (``refgrad.deferred_wgrad.fastgrad_error_factor``) or inputs on
which every partial sum is exact.

How the stand-in is provided: inside the block the module is importable by its name
(``sys.modules``), which is what ``megatron.core.utils.drain_embedding_wgrad_compute``
imports, and ``megatron.core.tensor_parallel.layers``, which bound the name (and
``_grad_accum_fusion_available = False``) when it was first imported, sees it in its
two module globals. On exit every swapped attribute, the ``sys.modules`` entry and the
mode are restored exactly (attributes that did not exist are removed again).

On a machine with CUDA nothing is redirected: the block runs Megatron-Core as shipped
and :attr:`RedirectLog.active` is False.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

FUSED_WGRAD_MODULE = "fused_weight_gradient_mlp_cuda"
LAYERS_MODULE = "megatron.core.tensor_parallel.layers"
_MISSING = object()

# What each redirect does, for reports (the table in the module docstring, one line each).
REDIRECTS: dict[str, str] = {
    "current_device": "torch.cuda.current_device() returns 'cpu'",
    "cuda_factory_device": "device='cuda' arguments of torch functions become 'cpu' (TorchFunctionMode)",
    "tensor_cuda": "Tensor.cuda() returns the tensor itself (stays on the CPU)",
    "tensor_type_name": "Tensor.type() reports the torch.cuda.<T>Tensor name",
    "synchronize": "torch.cuda.synchronize() is a no-op (the CPU is synchronous)",
    "current_stream": ("torch.cuda.current_stream() returns torch.cpu.current_stream() "
                       "(its wait_event / wait_stream do nothing: the CPU is synchronous)"),
    "wgrad_gemm_accum_fp32": (f"{FUSED_WGRAD_MODULE}.wgrad_gemm_accum_fp32 stand-in: "
                              "main_grad += fp32(grad_output)ᵀ·fp32(input) in fp32, then one fp32 add"),
    "wgrad_gemm_accum_fp16": (f"{FUSED_WGRAD_MODULE}.wgrad_gemm_accum_fp16 stand-in: the fp32 GEMM "
                              "and add, rounded once to main_grad's 16-bit dtype"),
}


@dataclass
class RedirectLog:
    """Which redirects fired inside one :func:`cpu_redirects` block, and how often."""

    active: bool
    fired: Counter = field(default_factory=Counter)

    def hit(self, name: str) -> None:
        self.fired[name] += 1

    def summary(self) -> list[str]:
        """One line per redirect that fired: ``name (count): what it does``."""
        return [f"{name} ({count}x): {REDIRECTS[name]}" for name, count in sorted(self.fired.items())]


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    # A bare int names a CUDA device index (torch's convention); bool is not a device.
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments, ``Tensor.cuda()`` and ``Tensor.type()`` to the CPU."""

    def __init__(self, log: RedirectLog) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            self.log.hit("tensor_cuda")
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None and args[0].device.type == "cpu":
                self.log.hit("tensor_type_name")
                return name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            self.log.hit("cuda_factory_device")
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            self.log.hit("cuda_factory_device")
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _wgrad_gemm_fp32(log: RedirectLog):
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        """``main_grad += grad_outputᵀ · total_input``: fp32 GEMM, then one fp32 add."""
        log.hit("wgrad_gemm_accum_fp32")
        if main_grad.dtype != torch.float32:
            raise TypeError(f"wgrad_gemm_accum_fp32 needs an fp32 main_grad, got {main_grad.dtype}")
        with torch.no_grad():  # an extension op: it writes the buffer, autograd never sees it
            wgrad = torch.mm(grad_output.float().t(), total_input.float())
            main_grad.add_(wgrad)

    return wgrad_gemm_accum_fp32


def _wgrad_gemm_fp16(log: RedirectLog):
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        """``main_grad = 16-bit(fp32(main_grad) + fp32 GEMM)``: one rounding to the 16-bit dtype."""
        log.hit("wgrad_gemm_accum_fp16")
        if main_grad.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"wgrad_gemm_accum_fp16 needs a 16-bit main_grad, got {main_grad.dtype}")
        with torch.no_grad():
            wgrad = torch.mm(grad_output.float().t(), total_input.float())
            main_grad.copy_(main_grad.float() + wgrad)

    return wgrad_gemm_accum_fp16


def fused_wgrad_standin(log: RedirectLog) -> types.ModuleType:
    """A module with apex's two wgrad-accumulation entry points, computed on the CPU."""
    module = types.ModuleType(FUSED_WGRAD_MODULE, "CPU stand-in for apex's fused wgrad GEMMs "
                              "(gradverify.verify.candidates.megatron_core.redirect)")
    module.wgrad_gemm_accum_fp32 = _wgrad_gemm_fp32(log)
    module.wgrad_gemm_accum_fp16 = _wgrad_gemm_fp16(log)
    return module


@contextmanager
def _swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` for the block; the old value (or its absence) restored after."""
    previous = owner.__dict__.get(name, _MISSING) if isinstance(owner, types.ModuleType) \
        else getattr(owner, name, _MISSING)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if previous is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)


@contextmanager
def _sys_module(name: str, module: types.ModuleType) -> Iterator[None]:
    previous = sys.modules.get(name, _MISSING)
    sys.modules[name] = module
    try:
        yield
    finally:
        if previous is _MISSING:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous


def _fused_wgrad_installed() -> bool:
    try:
        __import__(FUSED_WGRAD_MODULE)
    except ImportError:
        return False
    return True


@contextmanager
def cpu_redirects(*, force: bool = False) -> Iterator[RedirectLog]:
    """Redirect Megatron-Core's CUDA assumptions to the CPU inside the block (see the module doc).

    Does nothing (``log.active`` False) when CUDA is available, unless ``force``. The
    stand-in wgrad extension is provided only when the real one is not importable.
    Enter it inside a rank process, around the code that builds and runs Megatron.
    """
    if torch.cuda.is_available() and not force:
        yield RedirectLog(active=False)
        return
    log = RedirectLog(active=True)

    def current_device() -> str:
        log.hit("current_device")
        return "cpu"

    def synchronize(device: Any = None) -> None:
        log.hit("synchronize")

    def current_stream(device: Any = None) -> torch.cpu.Stream:
        log.hit("current_stream")
        return torch.cpu.current_stream()

    with ExitStack() as stack:
        stack.enter_context(_swapped(torch.cuda, "current_device", current_device))
        stack.enter_context(_swapped(torch.cuda, "synchronize", synchronize))
        stack.enter_context(_swapped(torch.cuda, "current_stream", current_stream))
        if not _fused_wgrad_installed():
            standin = fused_wgrad_standin(log)
            # Import the layers module (Megatron-Core is this redirect's optional dependency)
            # BEFORE the stand-in is importable: imported inside the block it would bind the
            # stand-in for good, and the swap below would "restore" the stand-in.
            layers = importlib.import_module(LAYERS_MODULE)
            stack.enter_context(_sys_module(FUSED_WGRAD_MODULE, standin))
            stack.enter_context(_swapped(layers, FUSED_WGRAD_MODULE, standin))
            stack.enter_context(_swapped(layers, "_grad_accum_fusion_available", True))
        stack.enter_context(_CudaToCpuMode(log))
        yield log

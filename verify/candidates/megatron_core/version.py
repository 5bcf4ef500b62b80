"""Which Megatron-Core is installed, and which of the verified features it has.

Features are detected by inspecting the installed code (modules, dataclass fields,
function signatures, module attributes), never by comparing version strings, so a
backport or a removal is seen as it is. Each feature is :class:`Feature`: present or
not, and why (the thing that was looked for). Importing this module does not import
Megatron-Core; :func:`installed` does, once per call.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradvocab import DDPConfig
from verify.candidates.interfaces import Technique, Unsupported

DISTRIBUTION = "megatron-core"
INSTALL_HINT = "pip install -e '.[megatron]' (in the gradverify checkout)"


@dataclass(frozen=True)
class Feature:
    """One capability of the installed Megatron-Core (``present``) and what decided it."""

    present: bool
    reason: str


@dataclass(frozen=True)
class MegatronCoreInfo:
    """The installed version and its feature table (name -> :class:`Feature`)."""

    version: str
    features: dict[str, Feature]

    def has(self, name: str) -> bool:
        return self.features[name].present

    def skip_reason(self, *names: str) -> str | None:
        """None when every named feature is present, else the first missing one's reason."""
        for name in names:
            if not self.features[name].present:
                return f"{name}: {self.features[name].reason}"
        return None


def missing_reason() -> str | None:
    """Why Megatron-Core cannot be used here (not installed), or None when it can."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return f"megatron-core is not installed: {INSTALL_HINT}"
    return None


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _field(cls: type, name: str) -> Feature:
    names = {f.name for f in dataclasses.fields(cls)}
    where = f"{cls.__module__}.{cls.__qualname__}"
    if name in names:
        return Feature(True, f"{where} has the field {name!r}")
    return Feature(False, f"{where} has no field {name!r} in this version")


def _attr(module_name: str, dotted: str) -> Feature:
    """Whether ``module_name`` has ``dotted`` (``name`` or ``Class.name``)."""
    owner = _module(module_name)
    for part in dotted.split("."):
        owner = getattr(owner, part, None) if owner is not None else None
    if owner is not None:
        return Feature(True, f"{module_name}.{dotted} exists")
    return Feature(False, f"{module_name}.{dotted} does not exist in this version")


def _buffer_layout_feature() -> Feature:
    """Whether ``_ParamAndGradBuffer`` is handed its params with names and a precomputed
    layout (after 0.16) or lays itself out from a plain param list (up to 0.16)."""
    module = _module("megatron.core.distributed.param_and_grad_buffer")
    buffer = getattr(module, "_ParamAndGradBuffer", None)
    if buffer is None:
        return Feature(False, "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer "
                       "does not exist in this version")
    params = inspect.signature(buffer.__init__).parameters
    where = "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__"
    if "params_with_names" in params and "param_layout" in params:
        return Feature(True, f"{where} takes params_with_names and a param_layout (the "
                       "distributed optimizer's, from DistributedOptimizer."
                       "_compute_per_buffer_param_layout)")
    return Feature(False, f"{where} takes a plain param list and lays the buffer out itself")


def _fp32_rs_feature(ddp_config_cls: type) -> tuple[Feature, Feature]:
    field = _field(ddp_config_cls, "reduce_scatter_with_fp32_accumulation")
    module = _module("megatron.core.distributed.reduce_scatter_with_fp32_accumulation")
    if not field.present or module is None:
        missing = Feature(False, field.reason if not field.present else
                          "megatron.core.distributed.reduce_scatter_with_fp32_accumulation is absent")
        return missing, missing
    fn = module.reduce_scatter_with_fp32_accumulation
    params = inspect.signature(fn).parameters
    scratch = "all_to_all_output_tensor" in params
    return (Feature(True, f"{field.reason}; {fn.__module__}.{fn.__name__}{inspect.signature(fn)}"),
            Feature(scratch, "reduce_scatter_with_fp32_accumulation takes all_to_all_output_tensor"
                    if scratch else "reduce_scatter_with_fp32_accumulation has no caller scratch "
                    "argument (all_to_all_output_tensor) in this version"))


def _mxfp8_feature(ddp_config_cls: type) -> Feature:
    field = _field(ddp_config_cls, "reuse_grad_buf_for_mxfp8_param_ag")
    if not field.present:
        return field
    fp8_utils = _module("megatron.core.fp8_utils")
    if not getattr(fp8_utils, "HAVE_TE_MXFP8TENSOR", False):
        return Feature(False, "Megatron-Core's MXFP8 params are Transformer Engine's MXFP8Tensor "
                       "(megatron.core.fp8_utils.HAVE_TE_MXFP8TENSOR is False: transformer_engine "
                       "is not importable); Transformer Engine needs CUDA")
    if not torch.cuda.is_available():
        return Feature(False, "Transformer Engine's MXFP8 quantization runs on CUDA only; "
                       "this machine has no CUDA device")
    return Feature(True, f"{field.reason}; Transformer Engine's MXFP8Tensor is importable")


def _fused_wgrad_feature() -> Feature:
    try:
        spec = importlib.util.find_spec("fused_weight_gradient_mlp_cuda")
    except ValueError:  # inside cpu_redirects: the stand-in (no __spec__) is in sys.modules
        spec = None
    if spec is not None:
        return Feature(True, "apex's fused_weight_gradient_mlp_cuda is installed")
    if torch.cuda.is_available():
        return Feature(False, "defer_embedding_wgrad_compute needs gradient_accumulation_fusion, "
                       "i.e. apex's CUDA extension fused_weight_gradient_mlp_cuda, which is not "
                       "installed on this CUDA machine")
    return Feature(True, "apex's fused_weight_gradient_mlp_cuda is absent; on the CPU the "
                   "redirect's documented stand-in computes it (redirect.REDIRECTS)")


def installed() -> MegatronCoreInfo:
    """The installed Megatron-Core's version and features (ImportError when it is absent)."""
    reason = missing_reason()
    if reason is not None:
        raise ImportError(reason)
    from importlib.metadata import version

    with warnings.catch_warnings():  # its notice that it falls back to torch's optimizers
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.model_parallel_config import ModelParallelConfig

    fp32_rs, fp32_rs_scratch = _fp32_rs_feature(DistributedDataParallelConfig)
    optimizer = _module("megatron.core.optimizer")
    torch_adam = getattr(optimizer, "USING_PYTORCH_OPTIMIZER", None)
    features = {
        "ddp_buffers": _attr("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBuffer"),
        "buffer_param_layout": _buffer_layout_feature(),
        "pad_buckets_for_high_nccl_busbw": _field(DistributedDataParallelConfig,
                                                  "pad_buckets_for_high_nccl_busbw"),
        "average_in_collective": _field(DistributedDataParallelConfig, "average_in_collective"),
        "optimizer_full_param_layout": _attr("megatron.core.optimizer.distrib_optimizer",
                                             "DistributedOptimizer.compute_full_param_layout"),
        "reduce_scatter_with_fp32_accumulation": fp32_rs,
        "fp32_rs_caller_scratch": fp32_rs_scratch,
        "defer_embedding_wgrad_compute": _field(ModelParallelConfig, "defer_embedding_wgrad_compute"),
        "drain_embedding_wgrad_compute": _attr("megatron.core.utils", "drain_embedding_wgrad_compute"),
        "fused_wgrad_gemm": _fused_wgrad_feature(),
        "schedule_1f1b": _attr("megatron.core.pipeline_parallel.schedules",
                               "forward_backward_pipelining_without_interleaving"),
        "schedule_interleaved": _attr("megatron.core.pipeline_parallel.schedules",
                                      "forward_backward_pipelining_with_interleaving"),
        "distributed_optimizer": _attr("megatron.core.optimizer", "get_megatron_optimizer"),
        "torch_adam_fallback": Feature(bool(torch_adam), "megatron.core.optimizer uses torch.optim "
                                       "AdamW/Adam (neither Transformer Engine nor apex FusedAdam "
                                       "is importable)" if torch_adam else
                                       "megatron.core.optimizer uses a fused Adam (TE or apex)"),
        "mxfp8_param_buffer_sharing": _mxfp8_feature(DistributedDataParallelConfig),
    }
    return MegatronCoreInfo(version=version(DISTRIBUTION), features=features)


# DDPConfig fields that an installed Megatron-Core may lack, and the feature that says so.
_DDP_FIELD_FEATURES = ("reduce_scatter_with_fp32_accumulation", "average_in_collective",
                       "pad_buckets_for_high_nccl_busbw")


def megatron_ddp_config(config: DDPConfig, found: MegatronCoreInfo,
                        refuse: Callable[[str], Exception], ddp_class: type | None = None):
    """``config`` as the installed ``DistributedDataParallelConfig`` (``ddp_class``): a setting
    this version lacks raises ``refuse(reason)`` (the caller's Unsupported), and a field its
    dataclass does not have is passed only where it is off, so that no version gets a field it
    cannot take (a TypeError) nor silently loses one that is on."""
    if ddp_class is None:
        from megatron.core.distributed import DistributedDataParallelConfig as ddp_class
    for name in _DDP_FIELD_FEATURES:
        if getattr(config, name) and not found.has(name):
            raise refuse(found.features[name].reason)
    have = {f.name for f in dataclasses.fields(ddp_class)}
    defaults = DDPConfig()
    for name, value in config.to_dict().items():
        if name not in have and value != getattr(defaults, name):
            raise refuse(f"{ddp_class.__module__}.{ddp_class.__qualname__} has no field {name!r} "
                         f"in this version (DDPConfig.{name}={value!r})")
    return ddp_class(**{name: value for name, value in config.to_dict().items() if name in have})


def require_modelled_adamw() -> None:
    """Unsupported (optimizer) where Megatron-Core's optimizer is not the torch.optim.AdamW
    refgrad models, nor its distributed optimizer there."""
    reason = installed().skip_reason("distributed_optimizer", "torch_adam_fallback")
    if reason is not None:
        raise Unsupported(Technique.OPTIMIZER, f"megatron-core {reason}: refgrad models "
                          "torch.optim.AdamW's order only")

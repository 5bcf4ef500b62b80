"""Driver: Megatron-Core's deferred output-layer (embedding) wgrad and its drain.

On each rank of a TP group (TP 1 or 2, sequence parallel or not) this builds Megatron's
own ``ColumnParallelLinear`` output layer with ``defer_embedding_wgrad_compute`` (its
``embedding_activation_buffer`` / ``grad_output_buffer``, ``wgrad_deferral_limit``) and
``gradient_accumulation_fusion`` (Megatron requires it for deferral), runs M microbatches
forward and backward with rank-specific inputs and output gradients, and calls
``megatron.core.utils.drain_embedding_wgrad_compute`` as the schedule does after the
cooldown. Per step the activation buffer is cleared first, as the schedules'
``clear_embedding_activation_buffer`` does. The weight's ``main_grad`` (fp32, zeroed per
step as DDP's ``zero_grad_buffer`` does) is what it returns, with the local inputs and
output gradients so that the parent can build refgrad's reference, and what was left in
the two buffers.

Megatron's config insists on ``pipeline_model_parallel_size > 1`` with deferral; the
output layer and the drain do not use the pipeline group, so the grid here is TP only
and the config says PP 2 (the real schedule with PP 2 is the ``pipeline`` driver).
The fused wgrad GEMM is apex's CUDA extension; on the CPU it is the redirect's
documented stand-in (``redirect.REDIRECTS``).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verify.candidates.megatron_core.runtime import ParallelGrid, megatron_world
from verify.distributed import spawn

INPUT_GRIDS = ("integers", "normal")


@dataclass(frozen=True)
class DeferredWgradCase:
    """One deferred-wgrad configuration: TP size, SP, microbatches, the deferral limit."""

    num_microbatches: int
    wgrad_deferral_limit: int = 0
    defer: bool = True
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    sequence: int = 4
    batch: int = 2
    hidden: int = 8
    vocab: int = 6
    steps: int = 2
    inputs: str = "integers"
    seed: int = 0
    # The drain to call (None: megatron.core.utils.drain_embedding_wgrad_compute), with its
    # signature. Tests pass a deliberately broken copy to prove the comparison can fail.
    drain: Callable | None = None

    def __post_init__(self) -> None:
        if self.num_microbatches < 0 or self.wgrad_deferral_limit < 0:
            raise ValueError("DeferredWgradCase.num_microbatches and wgrad_deferral_limit must be >= 0")
        if self.inputs not in INPUT_GRIDS:
            raise ValueError(f"DeferredWgradCase.inputs must be one of {INPUT_GRIDS}")
        if self.vocab % self.tensor_parallel or self.sequence % self.tensor_parallel:
            raise ValueError("DeferredWgradCase.vocab and sequence must divide by tensor_parallel")
        if self.sequence_parallel and self.tensor_parallel < 2:
            raise ValueError("DeferredWgradCase.sequence_parallel needs tensor_parallel >= 2")

    def label(self) -> str:
        mode = f"defer limit={self.wgrad_deferral_limit}" if self.defer else "immediate"
        sp = " SP" if self.sequence_parallel else ""
        drain = f" drain={self.drain.__name__}" if self.drain is not None else ""
        return (f"TP={self.tensor_parallel}{sp} M={self.num_microbatches} {mode} "
                f"{self.inputs} inputs{drain}")


def _values(case: DeferredWgradCase, shape: tuple[int, ...], g: torch.Generator,
            scale: float) -> torch.Tensor:
    if case.inputs == "integers":
        # Small integers times a power of two: every product and partial sum is exact in
        # fp32, so the GEMM's summation order cannot change the bits.
        return (torch.randint(-3, 4, shape, generator=g).float() * scale).to(torch.bfloat16)
    return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)


def microbatch_tensors(case: DeferredWgradCase, rank: int, step: int, k: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local input [s/sp, b, h], local grad_output [s, b, v/tp])`` of microbatch k on ``rank``."""
    # Without sequence parallelism every TP rank sees the same layer input.
    input_rank = rank if case.sequence_parallel else 0
    g = torch.Generator().manual_seed(case.seed * 1_000_003 + input_rank * 7919 + step * 131 + k)
    rows = case.sequence // (case.tensor_parallel if case.sequence_parallel else 1)
    x = _values(case, (rows, case.batch, case.hidden), g, 0.25)
    g = torch.Generator().manual_seed(case.seed * 1_000_003 + rank * 7919 + step * 131 + k + 57)
    grad = _values(case, (case.sequence, case.batch, case.vocab // case.tensor_parallel), g, 0.125)
    return x, grad


def _config(case: DeferredWgradCase):
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=case.tensor_parallel, pipeline_model_parallel_size=2,
        pipeline_dtype=torch.bfloat16, sequence_parallel=case.sequence_parallel,
        gradient_accumulation_fusion=True, defer_embedding_wgrad_compute=case.defer,
        wgrad_deferral_limit=case.wgrad_deferral_limit, use_cpu_initialization=True,
        params_dtype=torch.bfloat16)


def _step(case, layer, config, act_buf, grad_buf, rank, step) -> dict:
    from megatron.core import parallel_state
    from megatron.core.utils import drain_embedding_wgrad_compute

    act_buf.clear()  # the schedules' clear_embedding_activation_buffer, at step start
    layer.weight.main_grad.zero_()  # DDP's zero_grad_buffer
    inputs, grads = [], []
    for k in range(case.num_microbatches):
        x, grad = microbatch_tensors(case, rank, step, k)
        x.requires_grad_(True)
        output, _ = layer(x)
        output.backward(grad)
        inputs.append(x.detach())
        grads.append(grad)
    record = {"inputs": inputs, "grads": grads, "deferred": len(grad_buf)}
    if case.defer:
        try:
            (case.drain or drain_embedding_wgrad_compute)(
                config, act_buf, grad_buf, layer.weight,
                parallel_state.get_tensor_model_parallel_group())
        except (IndexError, UnboundLocalError, AssertionError) as error:
            where = traceback.extract_tb(error.__traceback__)[-1]
            record["error"] = f"{type(error).__name__}: {error}"
            record["raised_at"] = f"{where.filename.split('site-packages/')[-1]}:{where.lineno} {where.name}"
    record["main_grad"] = layer.weight.main_grad.clone()
    record["left_in_buffers"] = (len(act_buf), len(grad_buf))
    return record


def _run_case(case: DeferredWgradCase, rank: int) -> dict:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    config = _config(case)
    act_buf, grad_buf = [], []
    layer = ColumnParallelLinear(
        case.hidden, case.vocab, config=config, init_method=torch.nn.init.normal_, bias=False,
        gather_output=False, embedding_activation_buffer=act_buf, grad_output_buffer=grad_buf)
    # What DDP allocates for a bf16 weight with grad_reduce_in_fp32 (a view into its buffer).
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
    return {"steps": [_step(case, layer, config, act_buf, grad_buf, rank, s)
                      for s in range(case.steps)]}


def _deferred_rank(rank: int, world_size: int, cases: list[DeferredWgradCase]) -> list[dict]:
    with megatron_world(ParallelGrid(tensor_parallel=world_size)) as (place, log):
        results = []
        for case in cases:
            result = _run_case(case, rank)
            result["tp_rank"] = place.tp_rank
            results.append(result)
            dist.barrier()
        for result in results:
            result["redirects"] = log.summary()
        return results


def run_deferred_wgrad(cases: list[DeferredWgradCase], *, timeout_s: float = 120.0
                       ) -> list[list[dict]]:
    """Megatron's output layer and drain for every case (one TP size) on TP gloo ranks.

    Returns per case the per-rank results.
    """
    sizes = {case.tensor_parallel for case in cases}
    if len(sizes) != 1:
        raise ValueError(f"run_deferred_wgrad needs cases of one tensor_parallel, got {sorted(sizes)}")
    per_rank = spawn(_deferred_rank, sizes.pop(), list(cases), timeout_s=timeout_s)
    return [[ranks[i] for ranks in per_rank] for i in range(len(cases))]

"""Driver: the DP gradient reduction through Megatron-Core's DDP buckets, as plain tensors.

On every rank of a DP group, a module of 1-D parameters gets rank- and
iteration-specific gradients through real autograd (``loss = Σ_p (p · c_p).sum()``, so
``p.grad = c_p`` exactly) and Megatron's own ``DistributedDataParallel`` accumulates
them into its buffers with its backward hooks. ``finish_grad_sync`` (and, with
``overlap_grad_reduce``, the bucket launches the hooks make from the second iteration
on) reduces them: a reduce-scatter into each rank's shard with the distributed
optimizer, an all-reduce without, ``ReduceOp.AVG`` with ``average_in_collective``,
otherwise a pre-scale by ``1/dp`` and a SUM, in fp32 with ``grad_reduce_in_fp32``, and
through ``reduce_scatter_with_fp32_accumulation`` where the installed version has it
and it is asked for. What each rank returns per iteration is what it put in (the
buffer before the reduction) and what came out (the buffer after), with its shard of
every bucket; :mod:`verify.candidates.megatron_core.findings.reduction` holds them to
refgrad.

Several cases with the same DP size run in one spawn, in the order given (Megatron's
import costs seconds per rank). Each result records which reduce-scatter function
Megatron's ``param_and_grad_buffer`` module used (its module global
``dist_reduce_scatter_func``), because building a bucket group with
``reduce_scatter_with_fp32_accumulation`` rebinds that global for every bucket group
built after it in the process: see ``findings.reduction``.

A run that Megatron-Core or gloo refuses (an assertion or an unsupported op) comes
back as ``{"error": "<type>: <message>"}`` from every rank instead of a crash, so the
caller can classify it.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verify.candidates.megatron_core.layout import transformer_config
from verify.candidates.megatron_core.runtime import ParallelGrid, megatron_world
from verify.distributed import spawn


@dataclass(frozen=True)
class ReductionCase:
    """One DDP configuration of Megatron-Core on ``dp_size`` gloo ranks."""

    dp_size: int
    numels: tuple[int, ...] = (96, 33, 200)
    param_dtype: torch.dtype = torch.bfloat16
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    average_in_collective: bool = False
    grad_reduce_in_fp32: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    bucket_size: int | None = None
    iterations: int = 2
    seed: int = 0
    # The DDP class to wrap the module in (None: Megatron-Core's DistributedDataParallel).
    # Tests pass a deliberately broken subclass to prove the comparison can fail.
    ddp_class: type | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ValueError(f"ReductionCase.dp_size must be an int >= 1, got {self.dp_size!r}")
        if not self.numels or any(n < 1 for n in self.numels):
            raise ValueError(f"ReductionCase.numels must be positive sizes, got {self.numels!r}")
        if self.iterations < 1:
            raise ValueError(f"ReductionCase.iterations must be >= 1, got {self.iterations}")

    @property
    def grad_dtype(self) -> torch.dtype:
        return torch.float32 if self.grad_reduce_in_fp32 else self.param_dtype

    def label(self) -> str:
        parts = [f"dp={self.dp_size}", str(self.param_dtype).removeprefix("torch."),
                 "distopt" if self.use_distributed_optimizer else "allreduce",
                 "overlap" if self.overlap_grad_reduce else "no-overlap",
                 "avg-in-collective" if self.average_in_collective else "prescale",
                 "fp32-grads" if self.grad_reduce_in_fp32 else "grad=param dtype"]
        if self.reduce_scatter_with_fp32_accumulation:
            parts.append("fp32-accumulating RS")
        if self.ddp_class is not None:
            parts.append(f"ddp_class={self.ddp_class.__name__}")
        return " ".join(parts)


def rank_gradient(case: ReductionCase, rank: int, iteration: int, index: int) -> torch.Tensor:
    """Parameter ``index``'s gradient on DP rank ``rank`` at ``iteration`` (param dtype).

    Normal values times powers of two from 2^-6 to 2^6, so sums carry and round, with
    a few exact zeros and negative zeros.
    """
    g = torch.Generator().manual_seed(case.seed * 1_000_003 + rank * 7919 + iteration * 131 + index)
    n = case.numels[index]
    scale = torch.pow(2.0, torch.randint(-6, 7, (n,), generator=g).float())
    values = torch.randn(n, generator=g) * scale
    values[::17] = 0.0
    values[5::23] = -0.0
    return values.to(case.param_dtype)


class _Coefficients(torch.nn.Module):
    """``loss = Σ_p (p · c_p).sum()``: each parameter's gradient is its coefficient ``c_p``."""

    def __init__(self, case: ReductionCase) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(n, dtype=case.param_dtype)) for n in case.numels])

    def forward(self, coefficients: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * c).sum() for p, c in zip(self.weights, coefficients))


def _run(case: ReductionCase, rank: int) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=case.use_distributed_optimizer,
        overlap_grad_reduce=case.overlap_grad_reduce, bucket_size=case.bucket_size,
        grad_reduce_in_fp32=case.grad_reduce_in_fp32,
        average_in_collective=case.average_in_collective,
        reduce_scatter_with_fp32_accumulation=case.reduce_scatter_with_fp32_accumulation)
    module = _Coefficients(case)
    ddp = (case.ddp_class or DistributedDataParallel)(transformer_config(), ddp_config, module)
    params = list(module.weights)
    (buffer,) = ddp.buffers
    size = buffer.data_parallel_world_size
    base = buffer.grad_data.storage_offset()
    shards = []
    for bucket in buffer.buckets:
        start = bucket.grad_data.storage_offset() - base
        length = bucket.grad_data.numel()
        shard = length // size if case.use_distributed_optimizer else length
        first = start + (rank * shard if case.use_distributed_optimizer else 0)
        shards.append((start, start + length, first, first + shard))
    index_map = [list(buffer.param_index_map[p]) for p in params]
    iterations = []
    for it in range(case.iterations):
        ddp.zero_grad_buffer()
        # The buffer before the reduction is these grads at the index map's places (one
        # exact add into a zeroed buffer); it cannot be read back here: with overlap the
        # hooks launch (and pre-scale) a bucket during the backward.
        coefficients = [rank_gradient(case, rank, it, i) for i in range(len(params))]
        module(coefficients).backward()
        ddp.finish_grad_sync()
        iterations.append({"after": buffer.grad_data.clone(), "grads": coefficients})
    return {"rank": rank, "shards": shards, "param_index_map": index_map,
            "grad_dtype": buffer.grad_dtype, "iterations": iterations}


def reduce_scatter_function() -> str:
    """The function Megatron's buffers reduce-scatter with right now (a module global)."""
    from megatron.core.distributed import param_and_grad_buffer

    fn = param_and_grad_buffer.dist_reduce_scatter_func
    return f"{fn.__module__}.{fn.__name__}"


def _reduction_rank(rank: int, world_size: int, cases: list[ReductionCase]) -> list[dict]:
    results = []
    with megatron_world(ParallelGrid(data_parallel=world_size)) as (place, log):
        for case in cases:
            try:
                result = _run(case, rank)
            except (AssertionError, RuntimeError, ValueError) as error:
                # Every rank fails the same way here (the config is the same everywhere); a
                # collective one rank never reached would have ended the run with a timeout.
                where = traceback.extract_tb(error.__traceback__)[-1]
                result = {"error": f"{type(error).__name__}: {error}".strip(),
                          "raised_at": f"{where.filename.split('site-packages/')[-1]}:"
                                       f"{where.lineno} {where.name}"}
            result["reduce_scatter_function"] = reduce_scatter_function()
            dist.barrier()
            results.append(result)
        for result in results:
            result["redirects"] = log.summary()
    return results


def run_reductions(cases: list[ReductionCase], *, timeout_s: float = 180.0) -> list[list[dict]]:
    """Megatron DDP's reduction for every case (one DP size), in order, in one spawn.

    Returns per case the per-rank results.
    """
    sizes = {case.dp_size for case in cases}
    if len(sizes) != 1:
        raise ValueError(f"run_reductions needs cases of one dp_size, got {sorted(sizes)}")
    per_rank = spawn(_reduction_rank, sizes.pop(), list(cases), timeout_s=timeout_s)
    return [[ranks[i] for ranks in per_rank] for i in range(len(cases))]

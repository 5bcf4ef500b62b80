"""DDP grad sync with the 1F1B schedules, plain and interleaved, as a candidate runs it.

The ``pipeline`` check (and the preflight twin) hand a candidate a :class:`PipelineCase`:
refgrad's Linear+tanh model (:class:`refgrad.pipeline.LinearStackSpec`, optionally with a
vocab-parallel output layer whose wgrad is deferred to the pipeline flush, tied to the first
layer) on a TP x DP x PP (x VPP) grid (:class:`gradvocab.ParallelDims`, the one
carrier of sizes and groups), trained for the case's step plans with SGD. The candidate
trains it on every rank with its own data-parallel engine, schedules and output layer and
reports what each rank saw as a :class:`gradvocab.results.RankResult`; the check holds the results to
``refgrad.pipeline.reference_training``.

:class:`PipelineTraining` is written so that Megatron-Core can implement it as well as
fastgrad: :meth:`~PipelineTraining.grid` is where a candidate sets up its process groups
for the case's grid and tears them down after (fastgrad: ``ParallelDims.build``;
Megatron-Core: its ``parallel_state`` initialised and destroyed again, or a
``ProcessGroupCollection`` made from the built dims), and :meth:`~PipelineTraining.train`
wraps the stage modules in the candidate's DDP (Megatron-Core's
``DistributedDataParallel`` over a plain module), runs its schedule
(``forward_backward_pipelining_without_interleaving`` / ``_with_interleaving``, with
``config.no_sync_func`` / ``grad_sync_func`` / ``finalize_model_grads_func`` and
``defer_embedding_wgrad_compute``) and records the observables below.

The preflight twin trains the same cases step by step under the candidate's own optimizer
(:mod:`verify.candidates.api.optimizer`): :meth:`~PipelineTraining.model` builds this rank's
stages as :class:`StageSettings` says (16-bit params and compute, the grad buffer's dtype,
both overlaps, MXFP8 params) and returns a :class:`PipelineModel`
(:meth:`~PipelineModel.train_step`, :meth:`~PipelineModel.reduced_grads`);
:meth:`~PipelineTraining.model_support` says beforehand what it cannot build here
(:class:`ModelSupport`), so the twin scales that part away and lists it.

What the check compares, per case, per overlap setting, per rank and step: the losses
(the TP sum of the partial losses: :func:`total_losses`), every parameter's reduced
gradient (the whole gradient: with the distributed optimizer the other shards gathered),
the parameters after ``refgrad.pipeline.sgd_update`` (frozen ones and the second name of a
shared weight not stepped), and where each bucket's reduction was launched. Observables a
candidate has no notion of are left at ``None`` / empty and the check skips what needs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gradvocab import LAUNCH_SITES, Averaging, ParallelDims, RankResult
from refgrad.pipeline import (
    REDUCTIONS,
    LinearStackSpec,
    StepPlan,
    loss_target,
    microbatch_data,
    sequence_shard,
    splits_loss,
    stage_loss,
    vocab_block,
)
from verify.candidates.api.core import Technique, Unsupported
from verify.candidates.api.findings import LaunchSettings
from verify.candidates.api.optimizer import DataParallelModel
from verify.candidates.api.scope import TechniqueScope


@dataclass(frozen=True)
class PipelineCase:
    """One model on one grid, trained for ``plans`` (one entry per optimizer step).

    ``dims``: the grid's sizes (sizes only: the case is pickled into the ranks); its
    ``tp_size``/``sequence_parallel`` are the spec's, ``pp_size * vpp_size`` its stages
    (``vpp_size > 1``: the interleaved schedule, one DDP per model chunk). ``reduction``:
    ``Averaging.SUM``, ``.AVG`` (averaged in the collective) or ``.PRESCALE`` (``1/dp``
    before a SUM, production's default). ``bucket_size`` buckets pipeline rank 0's first chunk;
    every other (stage, chunk) uses ``bucket_size_elsewhere`` (production's rule; None: the
    same). ``timing``: the dedicated timing case (its timelines are compared with the
    simulator).
    """

    name: str
    dims: ParallelDims
    spec: LinearStackSpec
    plans: tuple[StepPlan, ...]
    use_distributed_optimizer: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    reduction: Averaging = Averaging.SUM
    bucket_size: int = 80
    lr: float = 0.05
    timing: bool = False
    bucket_size_elsewhere: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ParallelDims):
            raise TypeError(f"PipelineCase.dims must be a ParallelDims, got {type(self.dims).__name__}")
        if self.dims.built:
            raise ValueError("PipelineCase.dims must be sizes only (the case is pickled into "
                             "the ranks; each builds its own groups)")
        if self.dims.cp_size != 1:
            raise ValueError("PipelineCase.dims.cp_size must be 1: the pipeline model has no "
                             "context-parallel split")
        if not isinstance(self.spec, LinearStackSpec):
            raise TypeError("PipelineCase.spec must be a refgrad.pipeline.LinearStackSpec")
        if (self.dims.tp_size, self.dims.sequence_parallel) != (self.spec.tensor_parallel,
                                                                self.spec.sequence_parallel):
            raise ValueError(
                f"PipelineCase.dims (tp_size={self.dims.tp_size}, sequence_parallel="
                f"{self.dims.sequence_parallel}) must split the model as its spec does "
                f"(tensor_parallel={self.spec.tensor_parallel}, sequence_parallel="
                f"{self.spec.sequence_parallel})")
        for name in ("bucket_size",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelineCase.{name} must be an int >= 1, got {value!r}")
        if self.bucket_size_elsewhere is not None and (
                isinstance(self.bucket_size_elsewhere, bool)
                or not isinstance(self.bucket_size_elsewhere, int) or self.bucket_size_elsewhere < 1):
            raise ValueError(f"PipelineCase.bucket_size_elsewhere must be None or an int >= 1, "
                             f"got {self.bucket_size_elsewhere!r}")
        if self.spec.num_stages != self.dims.num_virtual_stages:
            raise ValueError(f"PipelineCase.spec.num_stages ({self.spec.num_stages}) must equal "
                             f"pp_size * virtual_stages ({self.dims.num_virtual_stages})")
        if not self.plans or not all(isinstance(p, StepPlan) for p in self.plans):
            raise ValueError("PipelineCase.plans must be a non-empty tuple of StepPlan")
        if self.virtual_stages > 1:
            if self.timing:
                raise ValueError("PipelineCase.virtual_stages > 1 needs pp_size >= 2 and no timing "
                                 "(the interleaved schedule has no simulator comparison)")
            bad = [p.num_microbatches for p in self.plans if p.num_microbatches % self.pp_size]
            if bad:
                raise ValueError(f"PipelineCase.plans: num_microbatches {bad} must be multiples "
                                 f"of pp_size ({self.pp_size}) when virtual_stages > 1")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) \
                or not math.isfinite(self.lr) or self.lr <= 0:
            raise ValueError(f"PipelineCase.lr must be a finite number > 0, got {self.lr!r}")
        if not isinstance(self.reduction, Averaging) or self.reduction not in REDUCTIONS:
            raise ValueError("PipelineCase.reduction must be Averaging.SUM, .AVG or .PRESCALE "
                             f"(refgrad.pipeline.REDUCTIONS), got {self.reduction!r}")

    def at(self, first_rank: int) -> PipelineCase:
        """The same case on the ranks from ``first_rank`` (grids side by side in one world)."""
        return replace(self, dims=replace(self.dims, first_rank=first_rank))

    def launch_settings(self, overlap: bool, *, params_dtype: str = "float32",
                        grad_dtype: str | None = None) -> LaunchSettings:
        """The Megatron-LM settings the case stands for when trained with ``overlap``: the
        report spells it so, and a candidate's findings are matched against it."""
        spec = self.spec
        flags = self.reduction.megatron_flags()
        return LaunchSettings(
            dims=replace(self.dims, first_rank=0), params_dtype=params_dtype,
            grad_dtype=params_dtype if grad_dtype is None else grad_dtype,
            use_distributed_optimizer=self.use_distributed_optimizer,
            overlap_grad_reduce=overlap,
            ddp_reduce_scatter_with_fp32_accumulation=self.reduce_scatter_with_fp32_accumulation,
            ddp_average_in_collective=flags.average_in_collective,
            calculate_per_token_loss=flags.calculate_per_token_loss,
            defer_embedding_wgrad_compute=spec.output_head and spec.defer_output_wgrad,
            wgrad_deferral_limit=spec.wgrad_deferral_limit,
            untie_embeddings_and_output_weights=spec.output_head and not spec.tied_embedding,
            has_output_layer=spec.output_head,
            microbatches=tuple(plan.num_microbatches for plan in self.plans))

    def bucket_size_for(self, stage: int, chunk: int) -> int:
        """The DDP bucket size of model chunk ``chunk`` on pipeline stage ``stage``."""
        if (stage, chunk) == (0, 0) or self.bucket_size_elsewhere is None:
            return self.bucket_size
        return self.bucket_size_elsewhere

    # Read-only views of ``dims`` under the names the report and the preflight twin use.
    @property
    def pp_size(self) -> int:
        return self.dims.pp_size

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def tp_size(self) -> int:
        return self.dims.tp_size

    @property
    def first_rank(self) -> int:
        return self.dims.first_rank

    @property
    def virtual_stages(self) -> int:
        return self.dims.vpp_size

    @property
    def world(self) -> int:
        """Ranks the grid occupies."""
        return self.dims.world_size


class StepProgress(Protocol):
    """Where a rank is, for a harness that reports a stalled rank
    (``verify.distributed.RankProgress``)."""

    def timeline_listener(self, prefix: str = "") -> Callable[[str, int, str], None]:
        """A listener called with ``(kind, microbatch, "start" | "end")`` around each event."""
        ...


MXFP8_BLOCK = 32  # elements per MXFP8 block along a weight's last dimension (OCP MX v1.0)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MXFP8Params:
    """Every weight of the model an MXFP8 param (E8M0 scales, E4M3 elements, blocks of
    :data:`MXFP8_BLOCK` along the last dimension, floor scales), the fp32 masters staged as
    bf16 for the param all-gather; ``reuse_grad_buffer``: that all-gather goes through the
    grad buffer's bytes (Megatron-Core's ``reuse_grad_buf_for_mxfp8_param_ag``)."""

    reuse_grad_buffer: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.reuse_grad_buffer, bool):
            raise TypeError("MXFP8Params.reuse_grad_buffer must be a bool")


@dataclass(frozen=True)
class StageSettings:
    """How :meth:`PipelineTraining.model` builds a case's stages beyond the case itself.

    ``param_dtype``: the params and the compute (fp32, or 16-bit as production's
    ``Float16Module``: the first stage's input cast to it, the last stage's output and the
    loss in fp32); ``grad_dtype``: the main-grad buffer and the DP wire (fp32 or the param
    dtype); ``overlap_grad_reduce`` / ``overlap_param_gather``: the DDP's overlaps (the
    param all-gather waited for in the forward pre-hooks); ``mxfp8``: MXFP8 params (fp32
    compute on their dequantized values).
    """

    param_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    mxfp8: MXFP8Params | None = None

    def __post_init__(self) -> None:
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"StageSettings.param_dtype must be one of {PARAM_DTYPES}, "
                             f"got {self.param_dtype!r}")
        if self.grad_dtype not in (torch.float32, self.param_dtype):
            raise ValueError(f"StageSettings.grad_dtype must be fp32 or the param dtype, "
                             f"got {self.grad_dtype!r}")
        for name in ("overlap_grad_reduce", "overlap_param_gather"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"StageSettings.{name} must be a bool")
        if self.mxfp8 is not None and (self.param_dtype, self.grad_dtype) != (torch.float32,) * 2:
            raise ValueError("StageSettings.mxfp8 computes in fp32 with fp32 grads: param_dtype "
                             "and grad_dtype must be torch.float32")


@dataclass(frozen=True)
class ModelSupport:
    """The parts of a pipeline model a candidate's :meth:`PipelineTraining.model` cannot build
    here, each with the reason (None: it can)."""

    tensor_parallel: str | None = None  # TP > 1: the vocab-parallel output layer, SP
    mxfp8_params: str | None = None  # StageSettings.mxfp8
    shared_weight_at_pp1: str | None = None  # one weight for the first and the output layer
    replicated_optimizer: str | None = None  # DDP without the distributed optimizer


class PipelineModel(DataParallelModel, Protocol):
    """One rank's model chunks of a :class:`PipelineCase`, wrapped in the candidate's DDP,
    trained step by step by its schedule; the optimizer is the caller's
    (:class:`verify.candidates.api.optimizer.DistributedOptimizerStep`, the same candidate's).

    Names are refgrad's (``refgrad.pipeline.stage_param_name``).
    """

    def train_step(self, step: int, *, loss_scale: float = 1.0) -> list[float]:
        """Zero the grad buffers and run step ``step`` of the case (its ``plans[step]``
        microbatches, this rank's data from :func:`rank_microbatches`) through the
        schedule, the loss multiplied by ``loss_scale`` before the backward; the grads are
        reduced when it returns. The step's losses (:func:`total_losses`, unscaled; the
        last stage, else empty)."""
        ...

    def reduced_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's reduced ``main_grad`` after :meth:`train_step`, whole (the
        shards other DP ranks reduced gathered), under each of its names."""
        ...

    def launch_sites(self) -> tuple[str, ...]:
        """Where each bucket's reduction was launched in the last step (:data:`LAUNCH_SITES`;
        empty: the candidate has no notion of it)."""
        ...

    def mxfp8_bits(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each MXFP8 param's ``(scale_bits, element_bits)`` by name (empty without MXFP8)."""
        ...

    @property
    def mxfp8_grad_buffer_shared(self) -> bool:
        """Whether the MXFP8 param all-gather goes through the grad buffer's bytes."""
        ...

    def close(self) -> None:
        """Remove the hooks the DDP and the model registered."""
        ...


@runtime_checkable
class PipelineTraining(TechniqueScope, Protocol):
    """A candidate's DDP grad sync under the 1F1B schedules.

    Two scopes, as every technique interface (:mod:`verify.candidates.api.scope`): a check
    uses the interface inside ``with candidate.pipeline() as training:`` (the candidate's
    per-process setup, e.g. Megatron-Core's CUDA redirects on a CPU, holds for everything
    inside, autograd's backward included), and inside it enters :meth:`grid` once per case
    (the per-grid process groups, e.g. Megatron-Core's ``parallel_state``, set up and torn
    down again) before calling :meth:`train`.

    Both methods run inside the rank processes. :class:`~verify.candidates.api.Unsupported`
    may be raised for a case the candidate cannot run; it must then be raised on every rank
    of the world (decide from the case, never from a rank's coordinates) and before any
    collective of that case.
    """

    def grid(self, dims: ParallelDims) -> AbstractContextManager[ParallelDims | None]:
        """Entered (inside the interface's own ``with``): this rank's place in ``dims``' grid
        with its process groups (None outside the grid), set up for the candidate; exited
        after the phase's training: torn down.

        Collective over the whole world: every rank enters it for every case of a phase, in
        the same order, before any case trains (several grids may share the world:
        ``dims.first_rank``; a candidate whose groups span the whole world raises
        :class:`~verify.candidates.api.Unsupported` for a grid that does not).
        """
        ...

    def train(self, case: PipelineCase, grid: ParallelDims, *, overlap: bool,
              progress: StepProgress | None = None) -> RankResult:
        """Train ``case`` on this rank of ``grid`` (entered from :meth:`grid`) with
        ``overlap_grad_reduce`` as given; ``progress`` is told each schedule event."""
        ...

    def model(self, case: PipelineCase, grid: ParallelDims, settings: StageSettings) -> PipelineModel:
        """This rank's stages of ``case`` on ``grid`` (entered from :meth:`grid`), built as
        ``settings`` says, for the caller to train step by step under the same candidate's
        optimizer (the preflight twin). Raises
        :class:`~verify.candidates.api.Unsupported` (on every rank, before any collective)
        for what :meth:`model_support` names."""
        raise Unsupported(Technique.PIPELINE, "builds no pipeline model for an optimizer")

    def model_support(self) -> ModelSupport:
        """What :meth:`model` cannot build here, with why (asked before any rank starts)."""
        reason = "builds no pipeline model for an optimizer"
        return ModelSupport(tensor_parallel=reason, mxfp8_params=reason,
                            shared_weight_at_pp1=reason, replicated_optimizer=reason)


def rank_microbatches(case: PipelineCase, grid: ParallelDims, step: int, m: int
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                 Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """This rank's ``(inputs, targets, loss_fn)`` for one step: its replica's data
    (``refgrad.pipeline.microbatch_data``), its sequence shard of the inputs under SP (its
    vocabulary columns for the vocab-parallel first layer), and the part of each target its
    (partial) loss covers."""
    spec = case.spec
    inputs, targets = microbatch_data(spec, grid.dp_rank, step, m)
    if spec.vocab_parallel_embedding:  # every row, this rank's vocabulary columns
        inputs = [vocab_block(spec, x, grid.tp_rank) for x in inputs]
    else:
        inputs = [sequence_shard(spec, x, grid.tp_rank) for x in inputs]
    targets = [loss_target(spec, t, grid.tp_rank) for t in targets]
    return inputs, targets, lambda out, target: stage_loss(spec, out, target, m)


def total_losses(case: PipelineCase, grid: ParallelDims, losses: Sequence[torch.Tensor]) -> list[float]:
    """The step's losses: partial losses summed over the TP group (production's all-reduce)."""
    if losses and splits_loss(case.spec):
        stacked = torch.stack(list(losses))
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=grid.tp_group)
        losses = list(stacked)
    return [float(v) for v in losses]


def updated_once(named: dict[str, torch.nn.Parameter], frozen: Iterable[str]
                 ) -> list[torch.nn.Parameter]:
    """The params to step after a step of ``named`` (refgrad's names): each once (a shared
    weight has two names), none of the ``frozen`` names."""
    frozen = set(frozen)
    out: list[torch.nn.Parameter] = []
    for name, param in named.items():
        if name not in frozen and all(param is not seen for seen in out):
            out.append(param)
    return out


__all__ = [
    "LAUNCH_SITES",
    "MXFP8_BLOCK",
    "MXFP8Params",
    "ModelSupport",
    "ParallelDims",
    "PipelineCase",
    "PipelineModel",
    "PipelineTraining",
    "StageSettings",
    "RankResult",
    "StepProgress",
    "rank_microbatches",
    "total_losses",
    "updated_once",
]

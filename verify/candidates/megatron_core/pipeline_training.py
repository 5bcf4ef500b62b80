"""Megatron-Core's DDP grad sync under its 1F1B schedules behind
:class:`~verify.candidates.interfaces.PipelineTraining`.

Each rank builds its model chunks of the case's ``refgrad.pipeline`` model (global stage
``chunk * P + stage``, Megatron's interleaving), the last stage's output head as Megatron's
``ColumnParallelLinear`` with ``defer_embedding_wgrad_compute``, wraps each chunk in
``DistributedDataParallel`` (``disable_bucketing`` for chunks after the first, as
Megatron-LM's ``get_model``) and trains with ``get_forward_backward_func(P, V)``
(``forward_backward_pipelining_without_interleaving`` / ``_with_interleaving``), wired as
Megatron-LM's ``megatron/training/training.py`` wires it: ``config.no_sync_func`` and (with
``align_grad_reduce``, its default) ``config.grad_sync_func`` from the chunks when
``overlap_grad_reduce``, ``config.finalize_model_grads_func = finalize_model_grads``; with
VPP ``overlap_p2p_comm`` and so ``batch_p2p_comm=False`` (Megatron-LM's defaults). The SGD
step is refgrad's (``sgd_update``): the check verifies the gradients, not an optimizer. What
Megatron raises is not caught: the harness ends the case's world and reports the crash.

Megatron's process groups: :meth:`MegatronPipeline.grid` builds the grid's groups
(``ParallelDims.build``) and hands them to Megatron as a ``ProcessGroupCollection`` (DDP,
``P2PCommunicator``, the schedules and ``finalize_model_grads`` take one in 0.16), so
several grids side by side in one world run as they do for any candidate; size-1 TP, CP and
EP groups are torch's ``FakeProcessGroup``. Megatron's global ``parallel_state`` is not used.

The check's reductions map onto Megatron's: ``"prescale"`` is its default (a
``gradient_scaling_factor`` of ``1/dp``, then SUM), ``"avg"`` is ``average_in_collective``
(``ReduceOp.AVG``), and ``"sum"`` is its per-token-loss mode (``calculate_per_token_loss``:
factor 1.0, SUM; the check's loss is already normalised per microbatch, so the loss
function reports 0 tokens and ``finalize_model_grads`` does not divide by a token count).
Without per-token loss Megatron divides each microbatch's loss by the microbatch count
itself (``forward_step_calc_loss``), so the loss function returns refgrad's
``stage_loss(..., 1)``: the same operations, the same bits.

What each rank reports (:class:`gradvocab.RankResult`): losses,
every parameter's reduced ``main_grad`` (with the distributed optimizer the other DP ranks'
shards all-gathered, for the comparison only), the params after the step, and where each
bucket group's reduction was launched, read from Megatron's own state
(:func:`reduction_launched`) at the two hooks the schedule calls: ``grad_sync_func``
(launched before: ``hook``, by it: ``dispatch``) and ``finalize_model_grads_func``
(launched before: ``hook``, else ``finish``). Megatron has no timeline, no per-chunk enable log and no
relearn count: those stay empty / None and the check skips what needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradvocab import ParallelDims, RankResult
from verify.candidates.interfaces import (
    PipelineCase,
    PipelineTraining,
    StepProgress,
    rank_microbatches,
    sgd_update,
    updated_once,
)
from verify.candidates.megatron_core.process_groups import megatron_process_groups
from verify.candidates.megatron_core.scope import MegatronScope
from verify.candidates.megatron_core.stages import StageChunk, forward_step_func, transformer_config
from verify.candidates.megatron_core.twin_pipeline import (
    StagesForOptimizer,
    require_features,
    unsupported,
)


def reduction_launched(group: Any) -> bool:
    """Whether a ``_ParamAndGradBucketGroup``'s reduction was launched in this step: in
    flight (``grad_reduce_handle`` set), or already waited for. The latter happens from 0.17
    on, where with ``reduce_scatter_with_fp32_accumulation`` and overlap each group's
    ``start_grad_sync`` first finishes its predecessor's (``previous_grad_reduce_bucket_group``)
    and ``finish_grad_sync`` records it in ``grad_reduce_finished`` (reset each step by
    ``reset``); 0.16.1 has neither, so there a launched reduction is one in flight."""
    return group.grad_reduce_handle is not None or getattr(group, "grad_reduce_finished", False)


class DrainObserver(list):
    """The output layer's activation buffer (the model's own list, given to Megatron's
    ``ColumnParallelLinear``): at the drain's first ``pop`` it notes whether the weight's bucket
    group's reduction was already launched (:func:`reduction_launched`): the drain then races
    it, or comes after it."""

    def __init__(self) -> None:
        super().__init__()
        self.bucket_group: Any = None
        self.in_flight_at_drain: bool | None = None

    def pop(self, index: Any = -1) -> Any:
        if self.bucket_group is not None and self.in_flight_at_drain is None:
            self.in_flight_at_drain = reduction_launched(self.bucket_group)
        return super().pop(index)


class LaunchSites:
    """Where each bucket group's reduction was launched in the current step, read
    (:func:`reduction_launched`) at the schedule's ``grad_sync_func`` and
    ``finalize_model_grads_func``."""

    def __init__(self, ddps: Sequence[Any]) -> None:
        self.groups = [group for ddp in ddps for group in ddp.bucket_groups]
        self.sites: dict[int, str] = {}

    def _note(self, site_if_launched: str, site_otherwise: str | None = None) -> None:
        for k, group in enumerate(self.groups):
            if k in self.sites:
                continue
            if reduction_launched(group):
                self.sites[k] = site_if_launched
            elif site_otherwise is not None:
                self.sites[k] = site_otherwise

    def grad_sync_func(self, ddp: Any) -> Callable[..., None]:
        """``ddp.start_grad_sync`` as Megatron-LM sets it, noting what it launched."""
        def grad_sync(*args: Any) -> None:
            self._note("hook")  # launched during the backward by the DDP's hooks
            ddp.start_grad_sync(*args)
            self._note("dispatch")
        return grad_sync

    def finalize_model_grads_func(self, model: list, num_tokens: Any = None, *,
                                  pg_collection: Any = None, force_all_reduce: bool = False) -> None:
        """Megatron's ``finalize_model_grads``; what is not launched yet is launched in it."""
        from megatron.core.distributed import finalize_model_grads

        self._note("hook", "finish")
        finalize_model_grads(model, num_tokens, pg_collection=pg_collection,
                             force_all_reduce=force_all_reduce)

    def step_sites(self) -> tuple[str, ...]:
        sites = tuple(self.sites.get(k, "never") for k in range(len(self.groups)))
        self.sites = {}
        return sites


@dataclass(frozen=True)
class MegatronPipeline(MegatronScope, StagesForOptimizer, PipelineTraining):
    """Megatron-Core's DDP and 1F1B schedules: :meth:`train` is the pipeline check's SGD
    training, :meth:`model` the preflight twin's stages under Megatron's own optimizer
    (:class:`~verify.candidates.megatron_core.twin_pipeline.StagesForOptimizer`). A test's
    broken variant overrides :meth:`ddp_class`."""

    @contextmanager
    def grid(self, dims: ParallelDims) -> Iterator[ParallelDims | None]:
        """The grid's groups (collective over the world; nothing to tear down: torch keeps
        them, and Megatron is given them per object, never through ``parallel_state``)."""
        if dims.tp_size > 1:
            raise unsupported("runs TP 1 grids here; the TP > 1 model (vocab-parallel head, "
                              "replicated blocks) is not wired to Megatron's tensor-parallel layers")
        yield dims.build()

    def train(self, case: PipelineCase, grid: ParallelDims, *, overlap: bool,
              progress: StepProgress | None = None) -> RankResult:
        del progress  # Megatron's schedules report no events to a listener
        if case.pp_size < 2:
            raise unsupported("is wired for the pipeline check's pipelined schedules (PP >= 2) only")
        require_features(case)
        config = transformer_config(case)
        groups = megatron_process_groups(grid)
        chunks, ddps = self._build(case, config, grid, groups, overlap)
        sites = LaunchSites(ddps)
        _wire(config, ddps, sites, overlap)
        return _train_steps(case, grid, config, groups, chunks, ddps, sites)

    def _build(self, case: PipelineCase, config: Any, grid: ParallelDims, groups: Any,
               overlap: bool) -> tuple[list[StageChunk], list[Any]]:
        from megatron.core.distributed import DistributedDataParallelConfig

        chunks, ddps = [], []
        for v in range(case.virtual_stages):
            vp_stage = v if case.virtual_stages > 1 else None
            chunk = StageChunk(case, config, v * case.pp_size + grid.stage, vp_stage,
                               activation_buffer=DrainObserver())
            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=case.use_distributed_optimizer,
                overlap_grad_reduce=overlap, bucket_size=case.bucket_size,
                reduce_scatter_with_fp32_accumulation=case.reduce_scatter_with_fp32_accumulation,
                average_in_collective=case.reduction.megatron_flags().average_in_collective)
            ddp = self.ddp_class()(config, ddp_config, chunk, disable_bucketing=v > 0,
                                   pg_collection=groups)
            if chunk.output_layer is not None and case.dp_size > 1:  # DP 1: nothing to race
                chunk.embedding_activation_buffer.bucket_group = ddp.param_to_bucket_group[
                    chunk.output_layer.weight]
            ddps.append(ddp)
            chunks.append(chunk)
        return chunks, ddps


def _wire(config: Any, ddps: Sequence[Any], sites: LaunchSites, overlap: bool) -> None:
    """Megatron-LM training.py's ``train()`` setup of the schedule's hooks (launches noted)."""
    if overlap:
        config.no_sync_func = [ddp.no_sync for ddp in ddps]
        config.grad_sync_func = [sites.grad_sync_func(ddp) for ddp in ddps]
        if len(ddps) == 1:
            config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
    config.finalize_model_grads_func = sites.finalize_model_grads_func


def _gather_reduced_grads(ddps: Sequence[Any], case: PipelineCase, dp_group: Any) -> None:
    """With the distributed optimizer each rank holds only its shard reduced: gather the
    others into every bucket (for the comparison)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    if not case.use_distributed_optimizer or case.dp_size == 1:
        return
    for ddp in ddps:
        for buffer in ddp.buffers:
            for bucket in buffer.buckets:
                own = shard_buffer(bucket.grad_data, case.dp_size)[dist.get_rank(dp_group)]
                dist.all_gather_into_tensor(bucket.grad_data, own.clone(), group=dp_group)


def _train_steps(case: PipelineCase, grid: ParallelDims, config: Any, groups: Any,
                 chunks: list[StageChunk], ddps: list[Any], sites: LaunchSites) -> RankResult:
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    spec = case.spec
    interleaved = case.virtual_stages > 1
    forward_backward = get_forward_backward_func(case.pp_size,
                                                 case.virtual_stages if interleaved else None)
    named = {n: p for chunk in chunks for n, p in chunk.named_for_refgrad().items()}
    result = RankResult(stage=grid.stage, dp_rank=grid.dp_rank, tp_rank=0, relearn_count=None)
    for step, plan in enumerate(case.plans):
        for name, p in named.items():
            p.requires_grad_(name not in plan.frozen)
        for ddp in ddps:
            ddp.zero_grad_buffer()
        m = plan.num_microbatches
        inputs, targets, _ = rank_microbatches(case.spec, grid.dp_rank, grid.tp_rank, step, m)
        data = [(x.view(spec.microbatch_size, 1, spec.hidden), t) for x, t in zip(inputs, targets)]
        iterators = [iter(data) for _ in ddps]
        for chunk in chunks:
            chunk.embedding_activation_buffer.in_flight_at_drain = None
        # What Megatron raises ends the run (the harness stops the other ranks at once and
        # reports it as the case's crash): nothing is finished on its behalf.
        store = [float(loss) for loss in forward_backward(
            forward_step_func=forward_step_func(case, m),
            data_iterator=iterators if interleaved else iterators[0],
            model=ddps if interleaved else ddps[0], num_microbatches=m,
            seq_length=spec.microbatch_size, micro_batch_size=1, forward_only=False,
            p2p_communicator=P2PCommunicator(pp_group=grid.pp_group, config=config),
            pg_collection=groups)]
        result.launch_sites.append(sites.step_sites())
        result.drained_in_flight.append(next(
            (c.embedding_activation_buffer.in_flight_at_drain for c in chunks
             if c.embedding_activation_buffer.bucket_group is not None), None))
        _gather_reduced_grads(ddps, case, groups.dp)
        result.losses.append(store if grid.is_last_stage else [])
        result.grads.append({n: p.main_grad.detach().clone() for n, p in named.items()})
        with torch.no_grad():
            for p in updated_once(named, plan.frozen):
                p.copy_(sgd_update(p, p.main_grad, case.lr))
        result.params.append({n: p.detach().clone() for n, p in named.items()})
    return result

"""1F1B pipeline schedule (no interleaving) over real torch.distributed processes.

``P`` pipeline stages times ``D`` data-parallel replicas times ``T``
tensor-parallel ranks make ``P*D*T`` ranks, laid out and grouped by one built
:class:`gradvocab.ParallelDims` (tensor parallel innermost, pipeline
outermost: production's default order). Each TP rank has its own DP group (same
stage and TP rank) and pipeline (same DP and TP rank). Activations and their
gradients travel between stages
with point-to-point ``isend``/``irecv``; gradients are reduced across the ``D``
replicas of a stage by :class:`fastgrad.ddp.DistributedDataParallel`.

Gradient sync placement (REFERENCE_NOTES section 5):

- grad sync is disabled for the whole step and enabled just before the
  backward of the last microbatch, so buckets launch their reduce as that
  backward completes them;
- non-first stages then dispatch every bucket still pending, inside their
  cooldown bubble (the first stage finishes last, so it has no bubble left);
- then the deferred embedding-wgrad drain (when given), then finalization:
  wait for every bucket, then (TP > 1) the all-reduce over the TP group of the
  grads of parameters replicated across it with sequence parallelism
  (``param.sequence_parallel = True``, as Megatron-Core marks its layernorms),
  then the tied-embedding all-reduce over the first and last stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from fastgrad.deferred_wgrad import allreduce_tied_embedding_grad
from fastgrad.timeline import Timeline
from gradvocab import LifecycleError, ParallelDims, require_place


class GradSync(Protocol):
    """What the schedule needs from the data-parallel engine (fastgrad.ddp)."""

    def disable_grad_sync(self) -> None: ...
    def enable_grad_sync(self) -> None: ...
    def start_grad_sync(self) -> None: ...
    def finish_grad_sync(self) -> None: ...
    def mark_grad_ready(self, param: nn.Parameter) -> None: ...
    def reduce_in_flight(self, param: nn.Parameter) -> bool: ...


class DeferredWgradDrain(Protocol):
    """What the schedule needs from a deferred output-layer wgrad (fastgrad.deferred_wgrad)."""

    weight: nn.Parameter

    def drain_deferred_wgrad(
        self, reduce_in_flight: Callable[[nn.Parameter], bool] | None = None
    ) -> int: ...


def num_warmup_microbatches(pp_size: int, stage: int, num_microbatches: int) -> int:
    """1F1B warmup forwards of ``stage``: ``min(P - stage - 1, M)``."""
    if not 0 <= stage < pp_size:
        raise ValueError(f"stage must be in [0, {pp_size}), got {stage}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    return min(pp_size - stage - 1, num_microbatches)


def schedule_1f1b(pp_size: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The program order of one stage: ``("F", i)`` and ``("B", i)`` in 1F1B order."""
    warmup = num_warmup_microbatches(pp_size, stage, num_microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order.append(("F", warmup + i))
        order.append(("B", i))
    order.extend(("B", i) for i in range(num_microbatches - warmup, num_microbatches))
    return order


def activation_device(modules: Sequence[nn.Module], device: torch.device | str | None) -> torch.device:
    """Where received activations and grads live: ``device`` if given, else the device of
    the first parameter of ``modules`` (CPU when they have none). NCCL needs CUDA buffers."""
    if device is not None:
        return torch.device(device)
    for module in modules:
        for param in module.parameters():
            return param.device
    return torch.device("cpu")


class _P2P:
    """Point-to-point exchange with the neighbouring stages of this rank's pipeline."""

    def __init__(
        self, parallel_dims: ParallelDims, shape: tuple[int, ...], dtype: torch.dtype,
        timeline: Timeline, device: torch.device,
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.timeline = timeline
        stage, ranks = parallel_dims.stage, parallel_dims.pp_ranks
        self.prev = ranks[stage - 1] if stage > 0 else None
        self.next = ranks[stage + 1] if stage < parallel_dims.pp_size - 1 else None

    def exchange(
        self,
        kind: str,
        microbatch: int,
        send: torch.Tensor | None,
        send_to: int | None,
        recv_from: int | None,
    ) -> torch.Tensor | None:
        """Post the send and the receive together (no ordering deadlock), then wait for both."""
        if send_to is None:
            send = None
        if send is None and recv_from is None:
            return None
        received = None
        with self.timeline.record(kind, microbatch):
            works = []
            if send is not None:
                works.append(dist.isend(send.contiguous(), dst=send_to))
            if recv_from is not None:
                received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                works.append(dist.irecv(received, src=recv_from))
            for work in works:
                work.wait()
        return received


def forward_backward_1f1b(
    stage_module: nn.Module,
    *,
    parallel_dims: ParallelDims,
    grad_sync: GradSync,
    num_microbatches: int,
    activation_shape: tuple[int, ...],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: Sequence[torch.Tensor] | None = None,
    targets: Sequence[torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    timeline: Timeline | None = None,
    deferred_wgrad: DeferredWgradDrain | None = None,
    embedding_params: Sequence[nn.Parameter] = (),
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """Run one 1F1B step; return the last stage's per-microbatch losses (else ``[]``).

    ``parallel_dims``: the built grid (this rank's stage, its pipeline, DP, TP and embedding
    groups; ``vpp_size`` 1: the interleaved schedule is
    :func:`fastgrad.pipeline_interleaved.forward_backward_interleaved`). ``inputs`` (first stage) and ``targets`` (last stage) hold one tensor per
    microbatch. ``grad_sync`` is disabled on entry and enabled before the last
    microbatch's backward; on return every bucket's reduction has finished, and
    ``embedding_params`` (tied weights on the first and last stage) have had
    their ``main_grad`` all-reduced over the embedding group. ``deferred_wgrad``
    (a ``fastgrad.deferred_wgrad.ColumnParallelOutputLayer`` on the last stage whose
    weight DDP lists in ``external_grad_params``) is drained after the cooldown,
    then its weight is marked ready; call its ``start_step()`` before this.
    Received activations and grads are allocated on ``device`` (default: the
    device of ``stage_module``'s parameters, so NCCL gets CUDA buffers).
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise TypeError(f"num_microbatches must be an int, got {type(num_microbatches).__name__}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    dims = require_place(parallel_dims, "forward_backward_1f1b")
    if dims.vpp_size != 1:
        raise ValueError(f"parallel_dims.vpp_size is {dims.vpp_size}: the non-interleaved 1F1B "
                         "runs one model chunk per stage (use forward_backward_interleaved)")
    if dims.is_first_stage and (inputs is None or len(inputs) != num_microbatches):
        raise ValueError(f"inputs must hold num_microbatches={num_microbatches} tensors on the first stage")
    if dims.is_last_stage and (targets is None or len(targets) != num_microbatches):
        raise ValueError(f"targets must hold num_microbatches={num_microbatches} tensors on the last stage")
    if embedding_params and dims.pp_size > 1 and dims.embedding_group is None:
        raise ValueError("embedding_params were given but this rank has no embedding group")
    timeline = timeline if timeline is not None else Timeline(dims.rank, enabled=False)
    p2p = _P2P(dims, tuple(activation_shape), dtype, timeline,
               activation_device([stage_module], device))
    stage = dims.stage
    warmup = num_warmup_microbatches(dims.pp_size, stage, num_microbatches)
    remaining = num_microbatches - warmup
    in_flight: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []
    losses: list[torch.Tensor] = []

    def forward(microbatch: int, received: torch.Tensor | None) -> torch.Tensor:
        with timeline.record("forward", microbatch):
            if dims.is_first_stage:
                x = inputs[microbatch]
                stage_input = None
            else:
                x = received.requires_grad_(True)
                stage_input = x
            y = stage_module(x)
            if dims.is_last_stage:
                loss = loss_fn(y, targets[microbatch])
                losses.append(loss.detach())
                in_flight.append((microbatch, stage_input, loss))
                return loss
            in_flight.append((microbatch, stage_input, y))
            return y.detach()

    def backward(output_grad: torch.Tensor | None) -> tuple[int, torch.Tensor | None]:
        microbatch, stage_input, output = in_flight.pop(0)
        with timeline.record("backward", microbatch):
            if output_grad is None:
                torch.autograd.backward(output)
            else:
                torch.autograd.backward(output, grad_tensors=output_grad)
        return microbatch, (stage_input.grad if stage_input is not None else None)

    grad_sync.disable_grad_sync()
    for i in range(warmup):
        received = p2p.exchange("recv", i, None, None, p2p.prev)
        sent = forward(i, received)
        p2p.exchange("send", i, sent, p2p.next, None)
    received = p2p.exchange("recv", warmup, None, None, p2p.prev) if remaining > 0 else None
    for i in range(remaining):
        microbatch = warmup + i
        last_iteration = i == remaining - 1
        sent = forward(microbatch, received)
        output_grad = p2p.exchange("send_recv", microbatch, sent, p2p.next, p2p.next)
        if warmup == 0 and last_iteration:
            grad_sync.enable_grad_sync()
        backward_microbatch, input_grad = backward(output_grad)
        if last_iteration:
            p2p.exchange("send", backward_microbatch, input_grad, p2p.prev, None)
            received = None
        else:
            received = p2p.exchange("send_recv", backward_microbatch, input_grad, p2p.prev, p2p.prev)
    for i in range(warmup):
        if i == warmup - 1:
            grad_sync.enable_grad_sync()
        microbatch = remaining + i
        output_grad = p2p.exchange("recv", microbatch, None, None, p2p.next)
        backward_microbatch, input_grad = backward(output_grad)
        p2p.exchange("send", backward_microbatch, input_grad, p2p.prev, None)
    if in_flight:
        raise LifecycleError(f"1F1B left {len(in_flight)} microbatches without a backward")

    if not dims.is_first_stage:
        with timeline.record("grad_sync_launch"):
            grad_sync.start_grad_sync()
    if deferred_wgrad is not None:
        # The output weight's main_grad is written outside autograd (fused or
        # deferred wgrad), so its bucket waits for this mark: it cannot launch
        # before the drain has written the last microbatch's wgrad.
        with timeline.record("wgrad_drain"):
            deferred_wgrad.drain_deferred_wgrad(grad_sync.reduce_in_flight)
        grad_sync.mark_grad_ready(deferred_wgrad.weight)
    finalize_grads(grad_sync, dims, embedding_params, timeline,
                   sequence_parallel_params(stage_module, dims))
    return losses


def finalize_grads(
    grad_sync: GradSync,
    parallel_dims: ParallelDims,
    embedding_params: Sequence[nn.Parameter],
    timeline: Timeline | None = None,
    sequence_parallel: Sequence[nn.Parameter] = (),
) -> None:
    """Wait for every bucket's reduction, all-reduce the ``sequence_parallel`` params' grads
    over the TP group, then all-reduce (SUM) tied embedding grads.

    Production's order (``finalize_model_grads``): the TP and embedding all-reduces run
    after the DP sync, so each copy is already the DP-reduced gradient:
    ``main_grad = tp_rank_0 + tp_rank_1`` and ``main_grad = first_copy + last_copy``.
    """
    timeline = timeline if timeline is not None else Timeline(parallel_dims.rank, enabled=False)
    with timeline.record("grad_sync_wait"):
        grad_sync.finish_grad_sync()
    sync_replicated_grads(parallel_dims, embedding_params, timeline, sequence_parallel)


def sync_replicated_grads(
    parallel_dims: ParallelDims,
    embedding_params: Sequence[nn.Parameter],
    timeline: Timeline,
    sequence_parallel: Sequence[nn.Parameter] = (),
) -> None:
    """After the DP sync: the ``sequence_parallel`` params' grads summed over TP, then the
    tied embedding grads summed over the embedding group (both schedules end with this)."""
    dims = parallel_dims
    if sequence_parallel and dims.tp_size > 1:
        allreduce_sequence_parallel_grads(sequence_parallel, dims.tp_group)
    if embedding_params and dims.pp_size > 1 and (dims.is_first_stage or dims.is_last_stage):
        with timeline.record("embedding_sync"):
            for param in embedding_params:
                grad = getattr(param, "main_grad", None)
                if grad is None:
                    raise LifecycleError("tied embedding parameter has no main_grad to all-reduce")
                allreduce_tied_embedding_grad(grad, dims.embedding_group)


def sequence_parallel_params(module: nn.Module, parallel_dims: ParallelDims) -> list[nn.Parameter]:
    """Parameters replicated across the TP group whose grads come from sequence shards
    (marked ``param.sequence_parallel = True``); empty at TP 1."""
    if parallel_dims.tp_size == 1:
        return []
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(params: Sequence[nn.Parameter], tp_group: Any) -> None:
    """Sum the ``main_grad`` of sequence-parallel replicated params over the TP group, coalesced
    into one collective (Megatron-Core's ``_allreduce_non_tensor_model_parallel_grads``)."""
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    if not grads or tp_group is None:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


__all__ = [
    "GradSync",
    "DeferredWgradDrain",
    "allreduce_sequence_parallel_grads",
    "forward_backward_1f1b",
    "finalize_grads",
    "num_warmup_microbatches",
    "schedule_1f1b",
    "sequence_parallel_params",
    "sync_replicated_grads",
]

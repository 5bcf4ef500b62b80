"""Interleaved 1F1B (virtual pipeline stages) over real torch.distributed processes.

Megatron-Core's ``forward_backward_pipelining_with_interleaving``: each of the
``P`` physical stages holds ``V`` model chunks; chunk ``c`` on stage ``s`` is
virtual stage ``c * P + s`` of a ``P * V``-stage model, so an activation leaving
the last physical stage wraps around to the first stage's next chunk. With
``M`` microbatches (``M % P == 0``), every rank runs ``M * V`` forwards and as
many backwards, in virtual-microbatch order ``k = 0 .. M*V - 1``:

- forward ``k`` runs chunk ``(k mod P*V) // P`` on microbatch
  ``(k // (P*V)) * P + k mod P`` (groups of ``P`` microbatches pass through
  chunk 0, then chunk 1, ...); backward ``k`` runs the chunks in reverse;
- warmup forwards per rank: ``min((P - s - 1) * 2 + (V - 1) * P, M * V)``, then
  one-forward-one-backward, then the cooldown backwards.

The bubble shrinks from ``(P-1)/(M+P-1)`` to ``(P-1)/(V*M+P-1)`` for equal costs.

Gradient sync: one data-parallel engine per model chunk (``grad_syncs[c]``,
``fastgrad.ddp.DistributedDataParallel`` in practice). All are disabled for the
whole step; chunk ``c``'s engine is enabled just before the backward of its
last microbatch (``M - 1``), so its buckets launch as that backward completes
them, while later chunks are still computing. Non-first stages then dispatch
whatever is still pending in their cooldown bubble; then every engine waits,
and (TP > 1) the grads of sequence-parallel replicated params are summed over
the TP group.

Communication: sends are asynchronous and waited for at the end of the step;
a receive is waited for only right before the op that needs it. Every message
carries a tag naming its virtual stage, microbatch and direction, so matching
cannot depend on posting order (with ``P = 2`` both neighbours are one rank).
After the cooldown, as in :func:`fastgrad.pipeline.forward_backward_1f1b`: the
deferred output-layer wgrad (on the last virtual stage, chunk ``V - 1`` of the
last stage) is drained after the cooldown dispatch and its weight marked ready
in chunk ``V - 1``'s engine; after every engine waits, the tied embedding
(chunk 0 of the first stage, the output layer on the last) is all-reduced over
the embedding group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastgrad.pipeline import (
    DeferredWgradDrain,
    GradSync,
    activation_device,
    sequence_parallel_params,
    sync_replicated_grads,
)
from fastgrad.timeline import Timeline
from gradvocab import LifecycleError, ParallelDims, require_place


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def validate_interleaving(pp_size: int, virtual_stages: int, num_microbatches: int) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``(P, V, M)`` can be interleaved."""
    _check_int("pp_size", pp_size, 2)
    _check_int("virtual_stages", virtual_stages, 1)
    _check_int("num_microbatches", num_microbatches, 1)
    if num_microbatches % pp_size != 0:
        raise ValueError(
            f"num_microbatches ({num_microbatches}) must be a multiple of pp_size ({pp_size}) "
            "for the interleaved schedule (microbatches pass through each chunk in groups of P)"
        )


def num_warmup_microbatches_interleaved(
    pp_size: int, stage: int, virtual_stages: int, num_microbatches: int
) -> int:
    """Warmup forwards of ``stage``: ``min((P - s - 1) * 2 + (V - 1) * P, M * V)``."""
    validate_interleaving(pp_size, virtual_stages, num_microbatches)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp_size:
        raise ValueError(f"stage must be an int in [0, {pp_size}), got {stage!r}")
    warmup = (pp_size - stage - 1) * 2 + (virtual_stages - 1) * pp_size
    return min(warmup, num_microbatches * virtual_stages)


def chunk_and_microbatch(
    pp_size: int, virtual_stages: int, virtual_microbatch: int, *, forward: bool
) -> tuple[int, int]:
    """The ``(model chunk, microbatch)`` of forward (or backward) number ``virtual_microbatch``."""
    group_size = pp_size * virtual_stages
    chunk = (virtual_microbatch % group_size) // pp_size
    if not forward:
        chunk = virtual_stages - 1 - chunk
    microbatch = (virtual_microbatch // group_size) * pp_size + virtual_microbatch % pp_size
    return chunk, microbatch


def schedule_interleaved(
    pp_size: int, stage: int, virtual_stages: int, num_microbatches: int
) -> list[tuple[str, int, int]]:
    """Program order of one stage: ``("F"|"B", chunk, microbatch)`` in interleaved 1F1B order."""
    warmup = num_warmup_microbatches_interleaved(pp_size, stage, virtual_stages, num_microbatches)
    total = num_microbatches * virtual_stages

    def op(kind: str, k: int) -> tuple[str, int, int]:
        return (kind, *chunk_and_microbatch(pp_size, virtual_stages, k, forward=kind == "F"))

    order = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(op("F", warmup + k))
        order.append(op("B", k))
    order.extend(op("B", k) for k in range(total - warmup, total))
    return order


class _InterleavedP2P:
    """Tagged point-to-point transfers between virtual stages of this rank's pipeline."""

    def __init__(
        self,
        parallel_dims: ParallelDims,
        num_microbatches: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        timeline: Timeline,
        device: torch.device,
    ) -> None:
        self.pp_ranks = parallel_dims.pp_ranks
        self.device = device
        self.num_virtual = parallel_dims.num_virtual_stages
        self.num_microbatches = num_microbatches
        self.shape = shape
        self.dtype = dtype
        self.timeline = timeline
        self.pending_sends: list[tuple[Any, torch.Tensor]] = []

    def rank_of(self, virtual_stage: int) -> int:
        """Global rank holding ``virtual_stage`` in this rank's pipeline (wraps to stage 0)."""
        return self.pp_ranks[virtual_stage % len(self.pp_ranks)]

    def tag(self, receiver_virtual_stage: int, microbatch: int, is_grad: bool) -> int:
        """A tag unique within the step: receiving virtual stage, microbatch, direction."""
        return (receiver_virtual_stage * self.num_microbatches + microbatch) * 2 + int(is_grad)

    def send(self, tensor: torch.Tensor, to_virtual: int, microbatch: int, is_grad: bool) -> None:
        """Post an asynchronous send; :meth:`wait_sends` completes it."""
        payload = tensor.detach().contiguous()
        with self.timeline.record("send", microbatch):
            work = dist.isend(payload, dst=self.rank_of(to_virtual),
                              tag=self.tag(to_virtual, microbatch, is_grad))
        self.pending_sends.append((work, payload))

    def recv(self, my_virtual: int, from_virtual: int, microbatch: int, is_grad: bool) -> torch.Tensor:
        """Receive the activation (or gradient) that ``from_virtual`` sends to ``my_virtual``."""
        received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        with self.timeline.record("recv", microbatch):
            dist.irecv(received, src=self.rank_of(from_virtual),
                       tag=self.tag(my_virtual, microbatch, is_grad)).wait()
        return received

    def wait_sends(self) -> None:
        """Wait for every posted send (their buffers stay alive until then)."""
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends.clear()


def forward_backward_interleaved(
    chunk_modules: Sequence[nn.Module],
    *,
    parallel_dims: ParallelDims,
    grad_syncs: Sequence[GradSync],
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
    """Run one interleaved 1F1B step; return the losses of the last virtual stage (else ``[]``).

    ``parallel_dims`` is the built grid (``vpp_size`` = ``V`` = ``len(chunk_modules)``).
    ``chunk_modules[c]`` is virtual stage ``c * P + stage``; ``grad_syncs[c]``
    reduces its gradients. ``inputs`` (first stage: they enter chunk 0) and
    ``targets`` (last stage: the loss follows its last chunk) hold one tensor
    per microbatch; losses come back in microbatch order. ``deferred_wgrad``
    (last stage: the output layer in chunk ``V - 1``, whose weight
    ``grad_syncs[V - 1]`` lists as external) is drained after the cooldown;
    ``embedding_params`` (tied weights on the first and last stage) are
    all-reduced over the embedding group after the DP sync. On return every
    chunk's reduction has finished.
    """
    virtual_stages = len(chunk_modules)
    if virtual_stages < 1:
        raise ValueError("chunk_modules must hold at least one model chunk (virtual_stages >= 1)")
    if len(grad_syncs) != virtual_stages:
        raise ValueError(
            f"grad_syncs must hold one engine per model chunk ({virtual_stages}), got {len(grad_syncs)}"
        )
    dims = require_place(parallel_dims, "forward_backward_interleaved")
    validate_interleaving(dims.pp_size, virtual_stages, num_microbatches)
    if dims.vpp_size != virtual_stages:
        raise ValueError(f"chunk_modules holds {virtual_stages} model chunks but "
                         f"parallel_dims.vpp_size is {dims.vpp_size}")
    if dims.is_first_stage and (inputs is None or len(inputs) != num_microbatches):
        raise ValueError(f"inputs must hold num_microbatches={num_microbatches} tensors on the first stage")
    if dims.is_last_stage and (targets is None or len(targets) != num_microbatches):
        raise ValueError(f"targets must hold num_microbatches={num_microbatches} tensors on the last stage")
    if deferred_wgrad is not None and not dims.is_last_stage:
        raise ValueError("deferred_wgrad belongs to the last virtual stage (the last stage's "
                         "last chunk); this rank is not on the last stage")
    if embedding_params and dims.embedding_group is None:
        raise ValueError("embedding_params were given but this rank has no embedding group")
    timeline = timeline if timeline is not None else Timeline(dims.rank, enabled=False)
    pp_size, stage = dims.pp_size, dims.stage
    num_virtual = pp_size * virtual_stages
    p2p = _InterleavedP2P(dims, num_microbatches, tuple(activation_shape),
                          dtype, timeline, activation_device(chunk_modules, device))
    # (chunk, microbatch) -> (stage input that needs its grad, output to backpropagate)
    in_flight: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    losses: dict[int, torch.Tensor] = {}

    def forward(chunk: int, microbatch: int) -> None:
        virtual = chunk * pp_size + stage
        if virtual == 0:
            x, stage_input = inputs[microbatch], None
        else:
            x = p2p.recv(virtual, virtual - 1, microbatch, is_grad=False).requires_grad_(True)
            stage_input = x
        with timeline.record("forward", microbatch):
            y = chunk_modules[chunk](x)
            if virtual == num_virtual - 1:
                y = loss_fn(y, targets[microbatch])
                losses[microbatch] = y.detach()
        in_flight[(chunk, microbatch)] = (stage_input, y)
        if virtual != num_virtual - 1:
            p2p.send(y, virtual + 1, microbatch, is_grad=False)

    def backward(chunk: int, microbatch: int) -> None:
        virtual = chunk * pp_size + stage
        stage_input, output = in_flight.pop((chunk, microbatch))
        output_grad = None
        if virtual != num_virtual - 1:
            output_grad = p2p.recv(virtual, virtual + 1, microbatch, is_grad=True)
        if microbatch == num_microbatches - 1:
            # This chunk's last backward: its buckets launch as it completes them.
            grad_syncs[chunk].enable_grad_sync()
        with timeline.record("backward", microbatch):
            torch.autograd.backward(output, grad_tensors=output_grad)
        if stage_input is not None:
            p2p.send(stage_input.grad, virtual - 1, microbatch, is_grad=True)

    for grad_sync in grad_syncs:
        grad_sync.disable_grad_sync()
    for kind, chunk, microbatch in schedule_interleaved(pp_size, stage, virtual_stages,
                                                        num_microbatches):
        (forward if kind == "F" else backward)(chunk, microbatch)
    if in_flight:
        raise LifecycleError(f"interleaved 1F1B left {len(in_flight)} forwards without a backward")
    p2p.wait_sends()

    if not dims.is_first_stage:
        with timeline.record("grad_sync_launch"):
            for grad_sync in grad_syncs:
                grad_sync.start_grad_sync()
    if deferred_wgrad is not None:
        # As in 1F1B: the output weight's bucket (last chunk) waits for this mark.
        last_chunk_sync = grad_syncs[virtual_stages - 1]
        with timeline.record("wgrad_drain"):
            deferred_wgrad.drain_deferred_wgrad(last_chunk_sync.reduce_in_flight)
        last_chunk_sync.mark_grad_ready(deferred_wgrad.weight)
    with timeline.record("grad_sync_wait"):
        for grad_sync in grad_syncs:
            grad_sync.finish_grad_sync()
    sync_replicated_grads(
        dims, embedding_params, timeline,
        [p for chunk in chunk_modules for p in sequence_parallel_params(chunk, dims)])
    return [losses[m] for m in sorted(losses)]


__all__ = [
    "chunk_and_microbatch",
    "forward_backward_interleaved",
    "num_warmup_microbatches_interleaved",
    "schedule_interleaved",
    "validate_interleaving",
]

"""Megatron-Core's bucket layout and grad buffers behind :mod:`verify.candidates.interfaces`.

* :meth:`MegatronLayout.layouts`: Megatron's ``param_and_grad_buffer._ParamAndGradBuffer``
  built for each case (:func:`build_megatron_buffer`: the DP group is torch's
  ``FakeProcessGroup`` of the case's size, so DP 1000 needs no 1000 processes) and read back
  (``param_index_map``, ``bucket_indices``, each bucket's ``numel_unpadded``). The buffer
  lays itself out in Python and then allocates its padded storage; for these inspections
  the storage is allocated on the ``meta`` device (:class:`MetaAllocation`), so a layout of
  tens of millions of padded elements costs no memory. The layout is computed before the
  allocation and does not depend on it.
* :meth:`MegatronLayout.build_buffer`: Megatron's ``DistributedDataParallel`` over the given
  parameters (one ``_ParamAndGradBuffer`` per (param dtype, grad dtype), its bucket groups
  from ``partition_buckets``), with its groups given as a ``ProcessGroupCollection`` (the DP
  group, or a ``FakeProcessGroup`` of ``dp_size`` for inspection; size-1 fake TP, PP and EP
  groups). ``averaging`` becomes Megatron's flags (``Averaging.megatron_flags``), which
  Megatron reads in ``DistributedDataParallel.__init__``: ``AVG`` is
  ``average_in_collective`` (``ReduceOp.AVG``), ``PRESCALE`` a ``gradient_scaling_factor`` of
  ``1/dp`` before a SUM, ``SUM`` its per-token-loss mode (``calculate_per_token_loss``:
  factor 1.0); ``POSTSCALE`` has no Megatron flags (ValueError).

A bucket's sync is its bucket group's (``_ParamAndGradBucketGroup.start_grad_sync`` /
``finish_grad_sync``; without fp8 params every bucket is a group of its own). With
``overlap_grad_reduce`` the reduction is in flight while the group's ``grad_reduce_handle``
is set. Without it Megatron reduces synchronously inside ``finish_grad_sync`` (its
``start_grad_sync`` is then a blocking call that ``finish_grad_sync`` repeats), so
:meth:`MegatronBucket.start_grad_sync` only marks the bucket pending and
``finish_grad_sync`` runs Megatron's.

The buffer's norm, padding and non-sharded checkpoint helpers do not exist in Megatron-Core
(its ``DistributedOptimizer`` computes the norm with ``clip_grads.get_grad_norm_fp32`` and
checkpoints parameters and optimizer state, never grads): they raise
:class:`~verify.candidates.interfaces.Unsupported`. The pieces a DP rank owns come from the
distributed optimizer's own map (``DistributedOptimizer._build_model_gbuf_range``), for the
rank's own DP rank (Megatron maps no other rank's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from gradvocab import Averaging, DDPConfig, ParallelDims, RankPlace
from verify.candidates.interfaces import (
    BucketLayout,
    GradBucket,
    GradBuffer,
    GradBufferGroup,
    GradPiece,
    Layout,
    LayoutCase,
    Technique,
    Unsupported,
)
from verify.candidates.megatron_core.process_groups import megatron_process_groups
from verify.candidates.megatron_core.scope import MegatronScope
from verify.candidates.megatron_core.version import installed, megatron_ddp_config

CANDIDATE = "megatron-core"


def unsupported(reason: str) -> Unsupported:
    """:class:`Unsupported` for the layout technique, naming this candidate."""
    return Unsupported(Technique.LAYOUT, f"{CANDIDATE} {reason}")


class MetaAllocation(TorchFunctionMode):
    """Inside the block, every torch function given a ``device`` allocates on ``meta``: no
    memory, only shapes (Megatron's buffer allocates with ``device=current_device()``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def read_layout(buffer: Any, params: Sequence[torch.nn.Parameter]) -> Layout:
    """A ``_ParamAndGradBuffer``'s bookkeeping as refgrad's record (params by registration order)."""
    index = {p: i for i, p in enumerate(params)}
    index_map: list[tuple[int, int, int]] = [(0, 0, 0)] * len(params)
    for param, (start, end, bucket_id) in buffer.param_index_map.items():
        index_map[index[param]] = (start, end, bucket_id)
    return Layout(
        param_index_map=tuple(index_map),
        bucket_indices=tuple(tuple(b) for b in buffer.bucket_indices),
        per_bucket_numel_unpadded=tuple(b.numel_unpadded for b in buffer.buckets),
        numel=buffer.numel, numel_unpadded=buffer.numel_unpadded,
        dp_size=buffer.data_parallel_world_size)


def build_megatron_buffer(case: LayoutCase, params: Sequence[torch.nn.Parameter], dp_rank: int,
                          *, takes_param_layout: bool) -> Any:
    """Megatron's ``_ParamAndGradBuffer`` for ``case`` (bf16 params, fp32 grads) as the
    installed version builds it, over a ``FakeProcessGroup`` of ``case.dp_size``.

    ``takes_param_layout`` is the installed version's feature ``buffer_param_layout``
    (:mod:`~verify.candidates.megatron_core.version`): up to 0.16 the buffer lays itself out
    from ``params``; later versions take ``params_with_names`` and, with the distributed
    optimizer, the padded layout computed by
    ``DistributedOptimizer._compute_per_buffer_param_layout`` (what
    ``compute_full_param_layout`` does per buffer, and what ``DistributedDataParallel``
    hands its buffers).
    """
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=case.use_distributed_optimizer,
        pad_buckets_for_high_nccl_busbw=case.pad_buckets_for_high_nccl_busbw,
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=case.bucket_size)
    # Laid out only: every group fake (a size and a rank), nothing communicates.
    groups = megatron_process_groups(ParallelDims(dp_size=case.dp_size, place=RankPlace(
        rank=dp_rank, dp_rank=dp_rank, distributed=False)))
    names = {p: f"param{i}" for i, p in enumerate(params)}
    indices = list(range(len(params)))
    rest = (groups.dp, case.bucket_size, names, 1.0 / case.dp_size, indices, False, groups)
    if not takes_param_layout:
        return _ParamAndGradBuffer(ddp_config, torch.bfloat16, torch.float32, params, *rest)
    layout = None
    if case.use_distributed_optimizer:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        layout = DistributedOptimizer._compute_per_buffer_param_layout(
            params, case.bucket_size, case.dp_size, ddp_config, indices)
    return _ParamAndGradBuffer(ddp_config, torch.bfloat16, torch.float32,
                               [(p, names[p]) for p in params], *rest, param_layout=layout)


class MegatronBucket(GradBucket):
    """One ``_ParamAndGradBucket`` and its bucket group (which holds only it)."""

    def __init__(self, bucket: Any, group: Any, dp_size: int, overlap: bool) -> None:
        if len(group.buckets) != 1:
            raise ValueError("a Megatron bucket group of several buckets (fp8 params) has no "
                             "per-bucket sync")
        self.bucket, self.group, self.dp_size, self.overlap = bucket, group, dp_size, overlap
        self._pending = False

    @property
    def start(self) -> int:
        return self.bucket.offset

    @property
    def end(self) -> int:
        return self.bucket.offset + self.bucket.grad_data.numel()

    def grad_shard(self, rank: int) -> torch.Tensor:
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        return shard_buffer(self.bucket.grad_data, self.dp_size)[rank]

    def start_grad_sync(self) -> None:
        if self.overlap:
            self.group.start_grad_sync()
        else:  # Megatron reduces in finish_grad_sync (see the module docstring)
            self._pending = True

    def finish_grad_sync(self) -> None:
        self._pending = False
        self.group.finish_grad_sync()

    @property
    def reduce_in_flight(self) -> bool:
        if self.overlap:
            return self.group.grad_reduce_handle is not None
        return self._pending


class MegatronBufferGroup(GradBufferGroup):
    """One ``_ParamAndGradBuffer`` and its buckets."""

    def __init__(self, buffer: Any, buckets: Sequence[GradBucket]) -> None:
        self.buffer, self._buckets = buffer, list(buckets)

    @property
    def buckets(self) -> Sequence[GradBucket]:
        return self._buckets

    @property
    def param_dtype(self) -> torch.dtype:
        return self.buffer.param_dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.buffer.grad_dtype

    @property
    def params(self) -> Sequence[torch.nn.Parameter]:
        return self.buffer.params

    @property
    def grad_data(self) -> torch.Tensor:
        return self.buffer.grad_data

    @property
    def param_data(self) -> torch.Tensor | None:
        return self.buffer.param_data

    def layout(self) -> Layout:
        return read_layout(self.buffer, self.buffer.params)


class MegatronGradBuffer(GradBuffer):
    """Megatron's ``DistributedDataParallel``'s buffers over the check's parameters."""

    def __init__(self, ddp: Any, params: Sequence[torch.nn.Parameter], dp_size: int,
                 overlap: bool) -> None:
        self.ddp, self.index = ddp, {p: i for i, p in enumerate(params)}
        self.dp_size = dp_size
        group_of = {bucket: group for group in ddp.bucket_groups for bucket in group.buckets}
        self._groups = [
            MegatronBufferGroup(buffer, [MegatronBucket(b, group_of[b], dp_size, overlap)
                                         for b in buffer.buckets])
            for buffer in ddp.buffers]

    @property
    def groups(self) -> Sequence[GradBufferGroup]:
        return self._groups

    @property
    def buckets(self) -> Sequence[GradBucket]:
        return [bucket for group in self._groups for bucket in group.buckets]

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()

    def padding_is_zero(self) -> bool:
        raise unsupported("has no padding test on its grad buffer")

    def grad_norm_sq(self) -> torch.Tensor:
        raise unsupported("computes the grad norm in its optimizer "
                          "(megatron.core.optimizer.clip_grads.get_grad_norm_fp32), not its buffer")

    def local_shard_grad_norm_sq(self, rank: int) -> torch.Tensor:
        raise unsupported("computes the grad norm in its optimizer "
                          "(megatron.core.optimizer.clip_grads.get_grad_norm_fp32), not its buffer")

    def checkpoint_grads(self) -> dict[int, torch.Tensor]:
        raise unsupported("saves no grads in its checkpoints")

    def shard_checkpoint_grads(self, rank: int) -> dict[int, list[GradPiece]]:
        """The param pieces DP rank ``rank`` owns, from the distributed optimizer's map."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        pieces: dict[int, list[GradPiece]] = {}
        for group in self._groups:
            buffer = group.buffer
            if buffer.data_parallel_group.rank() != rank:
                raise unsupported("maps only its own DP rank's pieces "
                                  "(DistributedOptimizer._build_model_gbuf_range)")
            for bucket_id in range(len(buffer.buckets)):
                ranges = DistributedOptimizer._build_model_gbuf_range(buffer, bucket_id)
                for param, r in ranges["param_map"].items():
                    lo, hi = r["param"].start, r["param"].end
                    pieces.setdefault(self.index[param], []).append(
                        GradPiece((lo, hi), param.main_grad.detach().view(-1)[lo:hi].clone()))
        return pieces


class _ParamHolder(torch.nn.Module):
    """The check's parameters as a module, in registration order (what DDP wraps)."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(params)


@dataclass(frozen=True)
class MegatronLayout(MegatronScope, BucketLayout):
    """Megatron-Core's ``_ParamAndGradBuffer`` and ``DistributedDataParallel`` (a test's
    broken variant overrides :meth:`ddp_class`)."""

    needs_default_group = True  # the buffer's logging asserts an initialised default group

    def ddp_class(self) -> type:
        """The DDP class :meth:`build_buffer` wraps the parameters in."""
        from megatron.core.distributed import DistributedDataParallel

        return DistributedDataParallel

    def layouts(self, cases: Sequence[LayoutCase]) -> list[Layout]:
        found = installed()
        if any(c.pad_buckets_for_high_nccl_busbw for c in cases):
            reason = found.skip_reason("pad_buckets_for_high_nccl_busbw")
            if reason is not None:
                raise unsupported(reason)
        takes_param_layout = found.has("buffer_param_layout")
        out = []
        for case in cases:
            params = []
            for i, n in enumerate(case.numels):
                p = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16, device="meta"))
                if i in case.shared_embedding:
                    p.shared_embedding = True  # what GPTModel sets on its tied word embeddings
                params.append(p)
            with MetaAllocation():
                buffer = build_megatron_buffer(case, params, dp_rank=0,
                                               takes_param_layout=takes_param_layout)
            out.append(read_layout(buffer, params))
        return out

    def build_buffer(self, params: Sequence[torch.nn.Parameter], config: DDPConfig, *,
                     dp_size: int, dp_group: dist.ProcessGroup | None = None,
                     averaging: Averaging = Averaging.SUM) -> GradBuffer:
        from megatron.core.transformer import TransformerConfig

        if dp_group is not None and dist.get_world_size(dp_group) != dp_size:
            raise ValueError(f"dp_size={dp_size} but dp_group has {dist.get_world_size(dp_group)} ranks")
        # a bool or a way config contradicts is refused here; POSTSCALE has no Megatron-Core flags
        flags = config.resolve_averaging(averaging).megatron_flags()
        ddp_config = megatron_ddp_config(config, installed(), unsupported)
        # Without a group the buffer only lays itself out (fake groups of dp_size).
        grid = (ParallelDims(dp_size=dp_size, place=RankPlace(rank=0, distributed=False))
                if dp_group is None else ParallelDims.data_parallel(dp_group, dp_size))
        groups = megatron_process_groups(grid)
        # The per-token-loss mode is Megatron's only plain SUM over DP (factor 1.0).
        transformer = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                        use_cpu_initialization=True,
                                        calculate_per_token_loss=flags.calculate_per_token_loss)
        ddp = self.ddp_class()(transformer, ddp_config,
                               _ParamHolder(params), pg_collection=groups)
        return MegatronGradBuffer(ddp, params, dp_size, config.overlap_grad_reduce)

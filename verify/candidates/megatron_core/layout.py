"""Driver: Megatron-Core's bucket layout and buffer bookkeeping, as plain data.

Two ways in, both Megatron's own code:

* :func:`buffer_layout` builds ``megatron.core.distributed.param_and_grad_buffer.
  _ParamAndGradBuffer`` directly for given parameter sizes, DDP config and DP size. The DP
  group is torch's fake process group (``FakeProcessGroup``: a size and a rank, no
  communication), so DP 1000 needs no 1000 processes; the buffer only asks the group for
  its size and rank while it lays itself out. Per sampled DP rank it also reads that
  rank's shard of every bucket (``shard_buffer``, what the reduce-scatter writes) and
  the parameter pieces that rank owns (``DistributedOptimizer._build_model_gbuf_range``).
* :func:`ddp_layouts` wraps a module in ``DistributedDataParallel`` on real gloo ranks of
  a TP x PP x DP grid and reads every buffer it made, with the bucket size it used
  (production changes it: a default of ``max(4e7, 1e6 * dp)``, one bucket without
  overlap, one bucket on every pipeline stage after the first).

Both run inside a process that has an initialised default process group (Megatron's
logging asserts it): :func:`buffer_layouts` spawns one gloo rank for the first.
The returned dicts use ``refgrad.layout.Layout.to_dict``'s keys, parameters indexed by
registration order, plus ``shards``/``param_pieces`` (DP rank -> ranges).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from refgrad.layout import validate_layout_arguments
from verify.candidates.megatron_core.redirect import cpu_redirects
from verify.candidates.megatron_core.runtime import ParallelGrid, megatron_world
from verify.distributed import spawn


@dataclass(frozen=True)
class LayoutCase:
    """Parameter sizes (registration order) and the DDP settings that lay them out."""

    numels: tuple[int, ...]
    dp_size: int
    bucket_size: int | None
    use_distributed_optimizer: bool
    pad_buckets_for_high_nccl_busbw: bool = False
    shared_embedding: tuple[int, ...] = ()
    param_dtype: torch.dtype = torch.bfloat16
    grad_reduce_in_fp32: bool = True
    sample_ranks: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        validate_layout_arguments(self.numels, self.dp_size, self.bucket_size, self.shared_embedding)
        for r in self.sample_ranks:
            if not 0 <= r < self.dp_size:
                raise ValueError(f"LayoutCase.sample_ranks entry {r} is not a DP rank of "
                                 f"dp_size={self.dp_size}")

    def ranks_to_read(self) -> tuple[int, ...]:
        """The DP ranks whose shards are read: ``sample_ranks``, or 0, 1 and the last."""
        if self.sample_ranks:
            return self.sample_ranks
        return tuple(sorted({0, min(1, self.dp_size - 1), self.dp_size - 1}))

    def refgrad_kwargs(self) -> dict:
        """The same case as keyword arguments of ``refgrad.layout.compute_layout``."""
        return {"dp_size": self.dp_size, "bucket_size": self.bucket_size,
                "use_distributed_optimizer": self.use_distributed_optimizer,
                "pad_buckets_for_high_nccl_busbw": self.pad_buckets_for_high_nccl_busbw,
                "shared_embedding": self.shared_embedding}


def _params(numels: Sequence[int], dtype: torch.dtype, shared: Sequence[int]) -> list:
    params = []
    for i, n in enumerate(numels):
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        if i in shared:
            p.shared_embedding = True  # what GPTModel sets on its tied word embeddings
        params.append(p)
    return params


def read_buffer(buffer, params: Sequence[torch.nn.Parameter]) -> dict:
    """A ``_ParamAndGradBuffer``'s bookkeeping as ``refgrad.layout.Layout.to_dict`` keys."""
    index = {p: i for i, p in enumerate(params)}
    index_map = [None] * len(params)
    for param, (start, end, bucket_id) in buffer.param_index_map.items():
        index_map[index[param]] = [start, end, bucket_id]
    return {
        "param_index_map": index_map,
        "bucket_indices": [list(b) for b in buffer.bucket_indices],
        "per_bucket_numel_unpadded": [b.numel_unpadded for b in buffer.buckets],
        "numel": buffer.numel,
        "numel_unpadded": buffer.numel_unpadded,
        "dp_size": buffer.data_parallel_world_size,
    }


def _rank_ownership(buffer, params: Sequence[torch.nn.Parameter], rank: int) -> tuple[list, dict]:
    """This DP rank's shard of each bucket (Megatron's ``shard_buffer``) and owned param pieces."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    base = buffer.grad_data.storage_offset()
    size = buffer.data_parallel_world_size
    shards = []
    for bucket in buffer.buckets:
        view = shard_buffer(bucket.grad_data, size)[rank]
        start = view.storage_offset() - base
        shards.append([start, start + view.numel()])
    index = {p: i for i, p in enumerate(params)}
    pieces = {}
    for bucket_id in range(len(buffer.buckets)):
        ranges = DistributedOptimizer._build_model_gbuf_range(buffer, bucket_id)["param_map"]
        for param, r in ranges.items():
            pieces[index[param]] = [r["gbuf_world"].start, r["gbuf_world"].end]
    return shards, pieces


def build_megatron_buffer(case: LayoutCase, params, dp_rank: int):
    """Megatron's ``_ParamAndGradBuffer`` as the installed version builds it.

    Up to 0.16 the buffer lays itself out from ``params``; later versions take
    ``params_with_names`` and, with the distributed optimizer, the padded layout computed
    by ``DistributedOptimizer._compute_per_buffer_param_layout`` (what
    ``compute_full_param_layout`` does per buffer). Picked by the constructor's signature.
    """
    import inspect

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch._C._distributed_c10d import FakeProcessGroup

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=case.use_distributed_optimizer,
        pad_buckets_for_high_nccl_busbw=case.pad_buckets_for_high_nccl_busbw,
        grad_reduce_in_fp32=case.grad_reduce_in_fp32, overlap_grad_reduce=True,
        bucket_size=case.bucket_size)
    dp_group = FakeProcessGroup._create_internal(dp_rank, case.dp_size)
    groups = ProcessGroupCollection()
    groups.tp = FakeProcessGroup._create_internal(0, 1)
    groups.dp_cp = dp_group
    grad_dtype = torch.float32 if case.grad_reduce_in_fp32 else case.param_dtype
    names = {p: f"param{i}" for i, p in enumerate(params)}
    indices = list(range(len(params)))
    rest = (dp_group, case.bucket_size, names, 1.0 / case.dp_size, indices, False, groups)
    signature = inspect.signature(_ParamAndGradBuffer.__init__).parameters
    if "params_with_names" not in signature:
        return _ParamAndGradBuffer(ddp_config, case.param_dtype, grad_dtype, params, *rest)
    layout = None
    if case.use_distributed_optimizer:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        layout = DistributedOptimizer._compute_per_buffer_param_layout(
            params, case.bucket_size, case.dp_size, ddp_config, indices)
    return _ParamAndGradBuffer(ddp_config, case.param_dtype, grad_dtype,
                               [(p, names[p]) for p in params], *rest, param_layout=layout)


def buffer_layout(case: LayoutCase) -> dict:
    """Megatron's ``_ParamAndGradBuffer`` for ``case`` (call inside a process with a default group)."""
    layout: dict = {}
    with cpu_redirects() as log:
        for rank in case.ranks_to_read():
            params = _params(case.numels, case.param_dtype, case.shared_embedding)
            buffer = build_megatron_buffer(case, params, rank)
            if not layout:
                layout = read_buffer(buffer, params)
                layout["shards"], layout["param_pieces"] = {}, {}
            if case.use_distributed_optimizer:
                shards, pieces = _rank_ownership(buffer, params, rank)
                layout["shards"][rank] = shards
                layout["param_pieces"][rank] = pieces
    layout["redirects"] = log.summary()
    return layout


def _buffer_layouts_rank(rank: int, world_size: int, cases: Sequence[LayoutCase]) -> list[dict]:
    return [buffer_layout(case) for case in cases]


def buffer_layouts(cases: Sequence[LayoutCase], *, timeout_s: float = 120.0) -> list[dict]:
    """:func:`buffer_layout` of every case, in one spawned gloo rank (fake DP groups)."""
    return spawn(_buffer_layouts_rank, 1, list(cases), timeout_s=timeout_s)[0]


@dataclass(frozen=True)
class DDPLayoutCase:
    """A stage module of parameters ``numels`` wrapped in Megatron's DDP on every rank of ``grid``."""

    grid: ParallelGrid
    numels: tuple[int, ...]
    bucket_size: int | None
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    param_dtype: torch.dtype = torch.bfloat16
    grad_reduce_in_fp32: bool = True

    def __post_init__(self) -> None:
        validate_layout_arguments(self.numels, self.grid.data_parallel, self.bucket_size, ())


class _ParamStack(torch.nn.Module):
    def __init__(self, numels: Sequence[int], dtype: torch.dtype) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels])


def transformer_config(**kwargs):
    """A minimal ``TransformerConfig`` for wrapping non-transformer modules (CPU initialisation)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                             use_cpu_initialization=True, **kwargs)


def _ddp_layouts_rank(rank: int, world_size: int, case: DDPLayoutCase) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    with megatron_world(case.grid) as (place, log):
        module = _ParamStack(case.numels, case.param_dtype)
        params = list(module.weights)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=case.use_distributed_optimizer,
            overlap_grad_reduce=case.overlap_grad_reduce, bucket_size=case.bucket_size,
            grad_reduce_in_fp32=case.grad_reduce_in_fp32)
        ddp = DistributedDataParallel(transformer_config(), ddp_config, module)
        return {"pp_rank": place.pp_rank, "dp_rank": place.dp_rank,
                "config_bucket_size": ddp.ddp_config.bucket_size, "bucket_size_used": ddp.bucket_size,
                "buffers": [read_buffer(b, params) for b in ddp.buffers],
                "redirects": log.summary()}


def ddp_layouts(case: DDPLayoutCase, *, timeout_s: float = 120.0) -> list[dict]:
    """Per rank of ``case.grid``: the bucket size DDP used and its buffers' layouts."""
    return spawn(_ddp_layouts_rank, case.grid.world_size, case, timeout_s=timeout_s)

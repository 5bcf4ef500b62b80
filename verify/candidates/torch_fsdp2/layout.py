"""FSDP2's parameter sharding behind :mod:`verify.candidates.interfaces`.

FSDP2 has no bucketed buffer: ``fully_shard`` shards every parameter on its own along dim 0
(``_fsdp_param.FSDPParam._init_sharded_param``), so the bucket layouts and the padded buffer
are Unsupported, and :meth:`TorchFSDP2Layout.parameter_sharding` reports each rank's shard
(its rows from the DTensor's placement, its padded rows from the ``FSDPParam``, its values).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gradvocab import Averaging, DDPConfig
from verify.candidates.interfaces import (
    BucketLayout,
    GradBuffer,
    Layout,
    LayoutCase,
    ParameterShard,
    ParameterSharding,
    Technique,
    Unsupported,
)
from verify.candidates.torch_fsdp2.sharding import Coefficients, mesh_of, padded_rows, sharded_rows

NO_BUCKETS = ("torch-fsdp2 has no bucketed buffer: fully_shard shards every parameter on its own "
              "along dim 0 (its parameter shards are checked instead)")


class TorchFSDP2Sharding(ParameterSharding):
    """``fully_shard`` over a module holding the check's parameters."""

    def shard(self, params: Sequence[torch.nn.Parameter],
              group: dist.ProcessGroup | None) -> list[ParameterShard]:
        from torch.distributed.fsdp import fully_shard

        module = fully_shard(Coefficients(params), mesh=mesh_of(group))
        return [ParameterShard(*sharded_rows(p), padded, p.to_local().detach().clone())
                for p, padded in zip(module.parameters(), padded_rows(module), strict=True)]


class TorchFSDP2Layout(BucketLayout):
    """No buckets; parameters sharded one by one."""

    def layouts(self, cases: Sequence[LayoutCase]) -> list[Layout]:
        raise Unsupported(Technique.LAYOUT, NO_BUCKETS)

    def build_buffer(self, params: Sequence[torch.nn.Parameter], config: DDPConfig, *,
                     dp_size: int, dp_group: dist.ProcessGroup | None = None,
                     averaging: Averaging = Averaging.SUM) -> GradBuffer:
        raise Unsupported(Technique.LAYOUT, NO_BUCKETS)

    def parameter_sharding(self) -> ParameterSharding:
        return TorchFSDP2Sharding()

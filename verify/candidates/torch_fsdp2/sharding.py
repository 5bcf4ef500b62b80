"""What every FSDP2 adapter here builds: a module of the check's parameters under
``fully_shard`` on the check's group (``DeviceMesh.from_group``), with a ``MixedPrecisionPolicy``.

``sum(p * c)`` over the parameters is the forward (:class:`Coefficients`), so a parameter's
grad is its coefficient: the check chooses every grad. ``sharded_rows`` reads where a
rank's shard lies from the DTensor's own placement
(``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``) and its padded
size from the ``FSDPParam`` (``padded_sharded_param_size``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def mesh_of(group: dist.ProcessGroup | None):
    """A 1-D CPU device mesh over ``group`` (None: the world)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD if group is None else group, device_type="cpu")


def dtype_named(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def policy(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
    """FSDP2's ``MixedPrecisionPolicy`` (None: the sharded params' own dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


class Coefficients(torch.nn.Module):
    """Parameters whose forward is ``sum_i sum(p_i * c_i)``: ``p_i``'s grad is ``c_i``."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(
            [p if isinstance(p, torch.nn.Parameter) else torch.nn.Parameter(p) for p in params])

    def forward(self, coefficients: Sequence[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(())
        for p, c in zip(self.params, coefficients, strict=True):
            total = total + (p * c).float().sum()
        return total


def sharded_rows(param) -> tuple[int, int]:
    """``(start, stop)``: the rows of dim 0 this rank's shard of an FSDP2 parameter holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
    return offset[0], offset[0] + shape[0]


def padded_rows(module: torch.nn.Module) -> list[int]:
    """Each parameter's padded shard rows, as FSDP2 allocated them (registration order)."""
    group = module._get_fsdp_state()._fsdp_param_group
    return [f.padded_sharded_param_size[0] for f in group.fsdp_params]

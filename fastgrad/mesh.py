"""The data-parallel group, resolved once and passed down (in the spirit of FSDP2's ``FSDPMeshInfo``).

Every fastgrad object that reduces or gathers over data-parallel replicas takes
a :class:`DPMeshInfo` instead of asking ``torch.distributed`` again, so the
size and rank it works with cannot disagree between the DDP wrapper, the
buffer and its buckets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class DPMeshInfo:
    """The data-parallel process group with its size and this process's rank.

    ``distributed`` is False when ``torch.distributed`` is not initialized:
    then ``group`` is None, ``rank`` is 0 and ``size`` may still be > 1 to lay
    out buffers and shards for inspection (nothing can be communicated).
    """

    group: Any
    size: int
    rank: int
    distributed: bool

    def __post_init__(self) -> None:
        for name in ("size", "rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")
        if not self.distributed and self.group is not None:
            raise ValueError("group was given but torch.distributed is not initialized")

    @classmethod
    def resolve(cls, dp_group: Any = None, dp_size: int | None = None) -> DPMeshInfo:
        """Ask ``torch.distributed`` once for ``dp_group``'s size and rank.

        Without torch.distributed, ``dp_size`` (default 1) is taken as given and
        the rank is 0. With it, ``dp_size`` must agree with the group's size.
        """
        if dp_size is not None and (isinstance(dp_size, bool) or not isinstance(dp_size, int)):
            raise TypeError(f"dp_size must be an int or None, got {type(dp_size).__name__}")
        if dp_size is not None and dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if dist.is_available() and dist.is_initialized():
            if dp_group is not None and dist.get_rank(dp_group) < 0:
                # torch answers size -1 and rank -1 for a group this process is not in
                raise ValueError(
                    f"dp_group does not contain this process (global rank {dist.get_rank()}): pass "
                    "the data-parallel group this rank belongs to (dist.new_group is called by "
                    "every rank with the same ranks; each rank then uses the group holding it)"
                )
            world = dist.get_world_size(dp_group)
            if dp_size is not None and dp_size != world:
                raise ValueError(
                    f"dp_size={dp_size} disagrees with the process group's size {world}"
                )
            return cls(group=dp_group, size=world, rank=dist.get_rank(dp_group), distributed=True)
        if dp_group is not None:
            raise ValueError("dp_group was given but torch.distributed is not initialized")
        return cls(group=None, size=1 if dp_size is None else dp_size, rank=0, distributed=False)


class OnMesh:
    """``dp_group``, ``dp_size``, ``dp_rank`` and ``distributed`` read from ``self.mesh``.

    For the objects that hold a :class:`DPMeshInfo` (buffer, bucket, the MXFP8
    front): one place for the names callers use, none of them stored twice.
    """

    mesh: DPMeshInfo

    @property
    def dp_group(self) -> Any:
        return self.mesh.group

    @property
    def dp_size(self) -> int:
        return self.mesh.size

    @property
    def dp_rank(self) -> int:
        return self.mesh.rank

    @property
    def distributed(self) -> bool:
        return self.mesh.distributed

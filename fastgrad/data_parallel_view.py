"""The data-parallel names of fastgrad's reducing objects, read from their ``ParallelDims``."""

from __future__ import annotations

from typing import Any

from gradvocab import ParallelDims


class DataParallelView:
    """``dp_group``, ``dp_size``, ``dp_rank`` and ``distributed`` read from ``self.parallel_dims``.

    For the objects that reduce over data-parallel replicas (buffer, bucket, the MXFP8
    front): one place for the names callers use, none of them stored twice.
    """

    parallel_dims: ParallelDims

    @property
    def dp_group(self) -> Any:
        return self.parallel_dims.dp_group

    @property
    def dp_size(self) -> int:
        return self.parallel_dims.dp_size

    @property
    def dp_rank(self) -> int:
        return self.parallel_dims.dp_rank

    @property
    def distributed(self) -> bool:
        return self.parallel_dims.distributed


__all__ = ["DataParallelView"]

"""Megatron-Core's parallel state on gloo ranks: set up a TP x PP x DP grid, tear it down.

The rank processes come from :func:`verify.distributed.spawn`, which has already
initialised the default (gloo) process group. :func:`megatron_world` wraps a rank's
body: it enters :func:`~verify.candidates.megatron_core.redirect.cpu_redirects`,
calls ``megatron.core.parallel_state.initialize_model_parallel`` (Megatron's own
process-group layout: for TP x PP x DP with ``order="tp-cp-ep-dp-pp"``, DP groups of
ranks ``tp`` apart, PP groups ``tp * dp`` apart) and on exit destroys the parallel
state again (``destroy_model_parallel``) and restores the redirects. Megatron keeps
its process groups in module globals; they are Megatron's state, set up and torn down
here once per rank body, never left behind.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from verify.candidates.megatron_core.redirect import RedirectLog, cpu_redirects


@dataclass(frozen=True)
class ParallelGrid:
    """The TP x PP x DP sizes (VPP: model chunks per pipeline rank, 1 = not interleaved)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    virtual_pipeline: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel", "virtual_pipeline"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelGrid.{name} must be an int >= 1, got {value!r}")
        if self.virtual_pipeline > 1 and self.pipeline_parallel < 2:
            raise ValueError("ParallelGrid.virtual_pipeline > 1 needs pipeline_parallel >= 2 "
                             "(Megatron-Core's interleaved schedule)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel


@dataclass(frozen=True)
class RankPlace:
    """Where this rank sits in Megatron's grid (read back from ``parallel_state``)."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int


@contextmanager
def megatron_world(grid: ParallelGrid) -> Iterator[tuple[RankPlace, RedirectLog]]:
    """Inside a spawned rank: redirects on, Megatron's parallel state for ``grid``, torn down after."""
    if not dist.is_initialized():
        raise RuntimeError("megatron_world needs an initialised default process group "
                           "(run the rank body with verify.distributed.spawn)")
    if dist.get_world_size() != grid.world_size:
        raise ValueError(f"the grid {grid} needs {grid.world_size} ranks, the world has "
                         f"{dist.get_world_size()}")
    with warnings.catch_warnings():
        # Megatron's import-time notice that it falls back to torch's optimizers (recorded in
        # the feature table) and torch's deprecation notices about the collectives Megatron
        # calls: noise in every rank's stderr, not findings.
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        with _megatron_world(grid) as world:
            yield world


@contextmanager
def _megatron_world(grid: ParallelGrid) -> Iterator[tuple[RankPlace, RedirectLog]]:
    from megatron.core import parallel_state

    with cpu_redirects() as log:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=grid.tensor_parallel,
            pipeline_model_parallel_size=grid.pipeline_parallel,
            virtual_pipeline_model_parallel_size=(grid.virtual_pipeline
                                                  if grid.virtual_pipeline > 1 else None),
        )
        try:
            place = RankPlace(
                rank=dist.get_rank(),
                tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                dp_rank=parallel_state.get_data_parallel_rank(),
            )
            yield place, log
        finally:
            parallel_state.destroy_model_parallel()

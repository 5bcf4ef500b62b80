"""How data-parallel gradients become an average (or a sum): decided here, once.

As FSDP2's ``_get_gradient_divide_factors`` (``torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py``), one function turns the settings into a small frozen plan that the
buffer, its buckets and their collectives only read:

- ``average=False``: a SUM collective, nothing scaled;
- ``average=True`` with ``config.average_in_collective``: ``ReduceOp.AVG`` (torch 2.13's gloo
  and NCCL both have it: NCCL pre-multiplies floats by ``1/dp``, gloo sums then divides; the
  fp32-accumulating reduce-scatter divides its fp32 sum by ``dp`` before rounding once);
- ``average=True`` otherwise (Megatron-Core's default): every grad is multiplied by ``1/dp``
  before a SUM collective, in the grad buffer's dtype, exact only for power-of-two ``dp``.
  Production does it in the bucket (``grad_data *= gradient_scaling_factor``); with the
  fp32-accumulating reduce-scatter fastgrad folds the same multiplication into the
  collective's local reduction instead (each received element multiplied as torch's ``mul_``
  would on the sender, same bits, one read-and-write pass less; the elements outside this
  rank's shard then stay unscaled, see ``docs/reduce_scatter.md``).

A pre-scale of exactly 1 (``dp == 1``) is no pre-scale: ``x * 1.0`` is ``x``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch.distributed as dist

from fastgrad.config import DDPConfig


class PrescaleSite(str, enum.Enum):
    """Where the ``1/dp`` pre-scale is applied (always computed in the grad buffer's dtype)."""

    # ``bucket.grad_data.mul_(factor)`` before the collective is launched (production's DDP)
    BUCKET = "bucket"
    # inside the fp32-accumulating reduce-scatter, per received element, before the fp32 sum
    COLLECTIVE = "collective"


@dataclass(frozen=True)
class GradAveraging:
    """The plan: the collective's ``op``, and the ``prescale`` factor with its ``site``
    (both None when nothing is pre-scaled). ``average`` is what was asked for."""

    average: bool
    op: dist.ReduceOp.RedOpType
    prescale: float | None = None
    site: PrescaleSite | None = None

    def __post_init__(self) -> None:
        if (self.prescale is None) != (self.site is None):
            raise ValueError("GradAveraging.prescale and .site are given together or not at all")
        if self.op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"GradAveraging.op must be ReduceOp.SUM or ReduceOp.AVG, got {self.op!r}")
        if self.prescale is not None and self.op != dist.ReduceOp.SUM:
            raise ValueError("GradAveraging: a pre-scale is followed by a SUM collective")

    def prescale_at(self, site: PrescaleSite) -> float | None:
        """The factor applied at ``site`` (None: nothing is multiplied there)."""
        return self.prescale if self.site is site else None

    def describe(self) -> str:
        """One line for reports, e.g. ``x 0.25 (grad dtype, in the bucket) then SUM``."""
        if self.op == dist.ReduceOp.AVG:
            return "AVG in the collective"
        if self.prescale is None:
            return "SUM" + (" (one replica: the average is the sum)" if self.average else "")
        where = "in the bucket" if self.site is PrescaleSite.BUCKET else "inside the collective"
        return f"x {self.prescale:g} (grad dtype, {where}) then SUM"


def grad_averaging(config: DDPConfig, dp_size: int, *, average: bool) -> GradAveraging:
    """The averaging plan for ``config`` over ``dp_size`` replicas (see the module doc).

    ``average=False`` with ``config.average_in_collective`` is refused: the two contradict.
    """
    if not isinstance(config, DDPConfig):
        raise TypeError(f"config must be a DDPConfig, got {type(config).__name__}")
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    if not isinstance(average, bool):
        raise TypeError(f"average must be a bool, got {type(average).__name__}")
    if config.average_in_collective and not average:
        raise ValueError(
            "config.average_in_collective=True averages in the collective; it cannot be "
            "combined with average=False (sum)"
        )
    if config.average_in_collective:
        return GradAveraging(average=True, op=dist.ReduceOp.AVG)
    if not average or dp_size == 1:
        return GradAveraging(average=average, op=dist.ReduceOp.SUM)
    site = (PrescaleSite.COLLECTIVE if config.reduce_scatter_with_fp32_accumulation
            else PrescaleSite.BUCKET)
    return GradAveraging(average=True, op=dist.ReduceOp.SUM, prescale=1.0 / dp_size, site=site)

"""How data-parallel gradients become an average (or a sum): decided here, once.

How is :class:`gradvocab.averaging.Averaging` (the one type refgrad, fastgrad and verify share;
its ``factors`` the op and the ``1/dp`` multiplier); this module adds only where fastgrad
applies a pre-scale. As FSDP2's ``_get_gradient_divide_factors`` (``torch/distributed/fsdp/_fully_shard/
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
from dataclasses import dataclass, field

import torch.distributed as dist

from gradvocab import Averaging, AveragingFactors, DDPConfig


class PrescaleSite(str, enum.Enum):
    """Where the ``1/dp`` pre-scale is applied (always computed in the grad buffer's dtype)."""

    # ``bucket.grad_data.mul_(factor)`` before the collective is launched (production's DDP)
    BUCKET = "bucket"
    # inside the fp32-accumulating reduce-scatter, per received element, before the fp32 sum
    COLLECTIVE = "collective"


# fastgrad's DDP never post-scales (production scales before the collective, or averages in it)
FASTGRAD_AVERAGINGS = (Averaging.SUM, Averaging.AVG, Averaging.PRESCALE)


@dataclass(frozen=True)
class GradAveraging:
    """The plan: ``averaging`` over ``dp_size`` replicas and the ``site`` of its pre-scale
    (None exactly when nothing is pre-scaled). ``op`` and ``prescale`` are read from
    ``averaging.factors(dp_size)``, never computed here."""

    averaging: Averaging
    dp_size: int
    site: PrescaleSite | None = None
    factors: AveragingFactors = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.averaging, Averaging):
            raise TypeError(f"GradAveraging.averaging must be an Averaging, got {self.averaging!r}")
        if self.averaging not in FASTGRAD_AVERAGINGS:
            raise ValueError(f"GradAveraging.averaging must be one of {[str(a) for a in FASTGRAD_AVERAGINGS]}"
                             f" (fastgrad never post-scales), got {self.averaging}")
        if self.site is not None and not isinstance(self.site, PrescaleSite):
            raise TypeError(f"GradAveraging.site must be a PrescaleSite or None, got {self.site!r}")
        factors = self.averaging.factors(self.dp_size)  # validates dp_size
        if (factors.pre_scale is None) != (self.site is None):
            raise ValueError("GradAveraging.site is given exactly when there is a pre-scale "
                             f"({self.averaging} over {self.dp_size}: "
                             f"{'none' if factors.pre_scale is None else factors.pre_scale})")
        object.__setattr__(self, "factors", factors)

    @property
    def average(self) -> bool:
        """Whether the replicas' grads are averaged (False: summed)."""
        return self.averaging.averages

    @property
    def op(self) -> dist.ReduceOp.RedOpType:
        """The collective's op (``ReduceOp.SUM`` or ``ReduceOp.AVG``)."""
        return self.factors.op

    @property
    def prescale(self) -> float | None:
        """The ``1/dp`` multiplier applied before the collective (None: nothing)."""
        return self.factors.pre_scale

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
    # Megatron-Core's flag names, converted in the one place gradvocab keeps for them
    averaging = Averaging.from_megatron(average=average,
                                        average_in_collective=config.average_in_collective)
    if averaging.factors(dp_size).pre_scale is None:
        return GradAveraging(averaging, dp_size)
    site = (PrescaleSite.COLLECTIVE if config.reduce_scatter_with_fp32_accumulation
            else PrescaleSite.BUCKET)
    return GradAveraging(averaging, dp_size, site)

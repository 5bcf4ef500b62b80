"""How data-parallel gradients become an average (or a sum): decided here, once.

What is averaged how is :class:`gradvocab.Averaging` (the one type refgrad, fastgrad and
verify share; its ``factors`` the op and the ``1/dp`` multiplier; which way a config takes when the caller
names none, ``gradvocab.DDPConfig.resolve_averaging``); this module adds only what those do
not say: where fastgrad applies a pre-scale. As FSDP2's ``_get_gradient_divide_factors`` (``torch/distributed/fsdp/
_fully_shard/_fsdp_collectives.py``), one function (:func:`grad_averaging`) turns the settings
into a small frozen plan that the buffer, its buckets and their collectives only read:

- ``averaging=None`` (``DistributedDataParallel``'s default): Megatron-Core's, read from
  ``config.average_in_collective`` (``DDPConfig.resolve_averaging``): ``AVG`` with it,
  ``PRESCALE`` without; a bool is a TypeError;
- ``Averaging.SUM``: a SUM collective, nothing scaled;
- ``Averaging.AVG`` (needs ``config.average_in_collective``): ``ReduceOp.AVG`` (torch 2.13's
  gloo and NCCL both have it: NCCL pre-multiplies floats by ``1/dp``, gloo sums then divides;
  the fp32-accumulating reduce-scatter divides its fp32 sum by ``dp`` before rounding once);
- ``Averaging.PRESCALE`` (Megatron-Core's default): every grad is multiplied by ``1/dp``
  before a SUM collective, in the grad buffer's dtype, exact only for power-of-two ``dp``.
  Production does it in the bucket (``grad_data *= gradient_scaling_factor``); with the
  fp32-accumulating reduce-scatter fastgrad folds the same multiplication into the
  collective's local reduction instead (each received element multiplied as torch's ``mul_``
  would on the sender, same bits, one read-and-write pass less; the elements outside this
  rank's shard then stay unscaled, see ``docs/reduce_scatter.md``);
- ``Averaging.POSTSCALE``: refused; fastgrad, as Megatron-Core, never scales after the
  collective.

A pre-scale of exactly 1 (``dp == 1``) is no pre-scale: ``x * 1.0`` is ``x``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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
    (None exactly when nothing is pre-scaled), all that ``averaging`` does not say itself.
    ``factors`` (the collective's op and the pre-scale) is ``averaging.factors(dp_size)``,
    never computed here."""

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

    def prescale_at(self, site: PrescaleSite) -> float | None:
        """The factor applied at ``site`` (None: nothing is multiplied there)."""
        return self.factors.pre_scale if self.site is site else None

    def describe(self) -> str:
        """One line for reports, e.g. ``x 0.25 (grad dtype, in the bucket) then SUM``."""
        if self.averaging is Averaging.AVG:
            return "AVG in the collective"
        if self.factors.pre_scale is None:
            return "SUM" + (" (one replica: the average is the sum)" if self.averaging.averages else "")
        where = "in the bucket" if self.site is PrescaleSite.BUCKET else "inside the collective"
        return f"x {self.factors.pre_scale:g} (grad dtype, {where}) then SUM"


def grad_averaging(config: DDPConfig, dp_size: int, averaging: Averaging | None = None) -> GradAveraging:
    """The averaging plan for ``config`` over ``dp_size`` replicas (see the module doc):
    :meth:`gradvocab.DDPConfig.resolve_averaging`'s way, and where its pre-scale is applied."""
    if not isinstance(config, DDPConfig):
        raise TypeError(f"config must be a DDPConfig, got {type(config).__name__}")
    resolved = config.resolve_averaging(averaging)
    if resolved.factors(dp_size).pre_scale is None:
        return GradAveraging(resolved, dp_size)
    site = (PrescaleSite.COLLECTIVE if config.reduce_scatter_with_fp32_accumulation
            else PrescaleSite.BUCKET)
    return GradAveraging(resolved, dp_size, site)

"""How data-parallel gradients are averaged over ``dp`` replicas: one type, one decision.

``Averaging`` names the four ways production forms (or does not form) the DP mean, and
``Averaging.factors(dp_size)`` is the one place where a way becomes a collective's
``torch.distributed.ReduceOp`` and the multipliers applied before and after it, as FSDP2
decides ``(predivide, postdivide, reduce_op)`` in one function
(``_get_gradient_divide_factors``, ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``)
and every later step only reads the answer:

- ``SUM``: no averaging (Megatron-Core's ``calculate_per_token_loss``; refgrad's ``"sum"``);
- ``AVG``: the collective averages (``ReduceOp.AVG``; Megatron-Core's
  ``average_in_collective``);
- ``PRESCALE``: every replica's grad multiplied by ``1/dp`` in its own dtype, then a SUM
  (Megatron-Core's default ``gradient_scaling_factor``);
- ``POSTSCALE``: a SUM, then the result multiplied by ``1/dp`` (FSDP2's post-division with
  its reduction forced to SUM; fewer elements to scale, larger partial sums).

The values are the names refgrad and the reports have always used (``"sum"``, ``"avg"``,
``"prescale"``), so an ``Averaging`` is equal to, and prints as, that string. A factor of
exactly 1 (``dp == 1``) is no factor (None): ``x * 1.0`` is ``x``, nothing to apply.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class AveragingFactors:
    """What the collective of one averaging does: ``op`` (``ReduceOp.SUM`` or ``.AVG``), and the
    multipliers applied to each replica's grad before it (``pre_scale``) and to the reduced
    result after it (``post_scale``); None where nothing is multiplied."""

    op: dist.ReduceOp.RedOpType
    pre_scale: float | None = None
    post_scale: float | None = None

    def __post_init__(self) -> None:
        if self.op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"AveragingFactors.op must be ReduceOp.SUM or ReduceOp.AVG, got {self.op!r}")
        for name in ("pre_scale", "post_scale"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value) \
                    or not 0.0 < value < 1.0:
                raise ValueError(f"AveragingFactors.{name} must be None or a float in (0, 1) "
                                 f"(1/dp for dp >= 2), got {value!r}")
            if self.op != dist.ReduceOp.SUM:
                # scaling around an averaging collective would divide twice
                raise ValueError(f"AveragingFactors.{name} goes with a SUM collective, not {self.op!r}")
        if self.pre_scale is not None and self.post_scale is not None:
            raise ValueError("AveragingFactors: pre_scale and post_scale exclude each other "
                             "(the mean is divided once)")


@dataclass(frozen=True)
class MegatronAveragingFlags:
    """Megatron-Core's two settings that together choose how DP grads are averaged
    (``DistributedDataParallel.__init__``): ``average_in_collective``
    (``DistributedDataParallelConfig``: ``ReduceOp.AVG``, no scaling factor) and
    ``calculate_per_token_loss`` (``TransformerConfig``: grads summed, no ``1/dp`` at all).
    Both False is its default ``1/dp`` gradient scaling factor before a SUM. Megatron-Core
    refuses both True ('Cannot average in collective when calculating per-token loss!'), and so
    does this record. :meth:`Averaging.megatron_flags` makes one; ``Averaging.from_megatron``
    reads one back."""

    average_in_collective: bool
    calculate_per_token_loss: bool

    def __post_init__(self) -> None:
        for name in ("average_in_collective", "calculate_per_token_loss"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MegatronAveragingFlags.{name} must be a bool, "
                                f"got {type(getattr(self, name)).__name__}")
        if self.average_in_collective and self.calculate_per_token_loss:
            raise ValueError("MegatronAveragingFlags: average_in_collective and "
                             "calculate_per_token_loss exclude each other (Megatron-Core refuses "
                             "to average in the collective when calculating per-token loss)")

    @property
    def average(self) -> bool:
        """Whether the grads are averaged over DP at all (not per-token loss): the ``average``
        that fastgrad's DDP and ``Averaging.from_megatron`` take."""
        return not self.calculate_per_token_loss


class Averaging(str, enum.Enum):
    """How DP grads are combined: ``SUM``, ``AVG`` (in the collective), ``PRESCALE`` (``1/dp``
    before a SUM) or ``POSTSCALE`` (``1/dp`` after a SUM); see the module doc."""

    SUM = "sum"
    AVG = "avg"
    PRESCALE = "prescale"
    POSTSCALE = "postscale"

    def __str__(self) -> str:
        return self.value

    # Equal to its value (a str), so hashed as its value too: a dict keyed by "sum" finds
    # Averaging.SUM (Enum's own hash is its member name's, which would break that invariant).
    __hash__ = str.__hash__

    @property
    def averages(self) -> bool:
        """True for every way that forms the mean (all but ``SUM``)."""
        return self is not Averaging.SUM

    @property
    def reduce_op(self) -> dist.ReduceOp.RedOpType:
        """The collective's torch op: ``ReduceOp.AVG`` for ``AVG``, ``ReduceOp.SUM`` otherwise."""
        return dist.ReduceOp.AVG if self is Averaging.AVG else dist.ReduceOp.SUM

    def factors(self, dp_size: int) -> AveragingFactors:
        """The op and the pre/post multipliers over ``dp_size`` replicas (the one place they are
        computed)."""
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
        scale = None if dp_size == 1 else 1.0 / dp_size
        if self is Averaging.PRESCALE:
            return AveragingFactors(dist.ReduceOp.SUM, pre_scale=scale)
        if self is Averaging.POSTSCALE:
            return AveragingFactors(dist.ReduceOp.SUM, post_scale=scale)
        return AveragingFactors(self.reduce_op)

    @classmethod
    def from_reduce_op(cls, op: dist.ReduceOp.RedOpType) -> Averaging:
        """``SUM`` for ``ReduceOp.SUM``, ``AVG`` for ``ReduceOp.AVG``; ValueError otherwise."""
        if op == dist.ReduceOp.SUM:
            return cls.SUM
        if op == dist.ReduceOp.AVG:
            return cls.AVG
        raise ValueError(f"op must be ReduceOp.SUM or ReduceOp.AVG, got {op!r}")

    def megatron_flags(self) -> MegatronAveragingFlags:
        """The inverse of :meth:`from_megatron`: the Megatron-Core settings that average DP
        grads this way. ``SUM`` is per-token loss, ``AVG`` averages in the collective,
        ``PRESCALE`` is neither (its default ``1/dp`` gradient scaling factor). ``POSTSCALE``
        has no Megatron-Core spelling (it never scales after the collective): ValueError."""
        if self is Averaging.POSTSCALE:
            raise ValueError("Averaging.POSTSCALE has no Megatron-Core flags: Megatron-Core "
                             "scales by 1/dp before the collective (PRESCALE) or averages in it (AVG)")
        return MegatronAveragingFlags(average_in_collective=self is Averaging.AVG,
                                      calculate_per_token_loss=self is Averaging.SUM)

    @classmethod
    def from_megatron(cls, *, average: bool, average_in_collective: bool) -> Averaging:
        """Megatron-Core's DDP flags as one way (``DistributedDataParallel.__init__``): no
        averaging (``average=False``, its ``calculate_per_token_loss``) is ``SUM``;
        ``average_in_collective`` is ``AVG``; otherwise its ``1/dp`` gradient scaling factor,
        ``PRESCALE``. ``average_in_collective`` without ``average`` is refused, as Megatron-Core
        refuses it ('Cannot average in collective when calculating per-token loss!')."""
        for name, value in (("average", average), ("average_in_collective", average_in_collective)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        if average_in_collective and not average:
            raise ValueError("average_in_collective=True averages in the collective; it cannot be "
                             "combined with average=False (sum)")
        if not average:
            return cls.SUM
        return cls.AVG if average_in_collective else cls.PRESCALE


__all__ = ["Averaging", "AveragingFactors", "MegatronAveragingFlags"]

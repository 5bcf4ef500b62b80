"""The data-parallel gradient reduction a candidate performs, as typed collectives.

As FSDP2's ``_fsdp_api`` (``AllGather``, ``ReduceScatter``), each collective is a small class
with one typed ``__call__``, not a callable with flags. The ``reduce_scatter`` check asks the
candidate (:class:`GradReduction`, used inside ``with``) for:

* :meth:`GradReduction.reduce_scatter`: the fp32-accumulating reduce-scatter its buckets run
  (16-bit all-to-all, fp32 sum, one rounding), for one ``op``; a candidate whose collective
  does not take that op raises :class:`~verify.candidates.api.core.Unsupported`
  (Megatron-Core's takes ``ReduceOp.SUM`` only);
* :meth:`GradReduction.scratch_reduce_scatter`: the same collective into a caller's scratch
  buffer, where the candidate has that form;
* :meth:`GradReduction.local_reduction`: the local fp32 reduction it is built on
  (``[W, n]`` received shards -> ``n``);
* :meth:`GradReduction.bucket_reduction`: one DDP bucket reduced as the candidate's DDP
  reduces it under a :class:`ReductionConfig` (Megatron-Core's field names): the averaging
  (a pre-scale of the bucket by ``1/W`` in the grad dtype before a SUM, or ``ReduceOp.AVG``
  in the collective), the collective (reduce-scatter into shards, or all-reduce) and the
  fp32 accumulation. This is production's whole DP reduction, and the check holds it to
  refgrad's DP mean;
* :meth:`GradReduction.behaviour`: how the candidate departs from that spec by design
  (:class:`ReductionBehaviour`), so the check compares it with refgrad's model of the
  behaviour and reports the distance from the spec as a documented difference naming where
  the behaviour lives, instead of a failure.

Every collective is a frozen dataclass: the check builds its plan in its own process and the
rank processes ask the candidate again; nothing here holds a process group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gradvocab import Averaging
from verify.candidates.api.core import DocumentedBehaviour, Technique, Unsupported
from verify.candidates.api.scope import TechniqueScope

SUM = Averaging.SUM.reduce_op
AVG = Averaging.AVG.reduce_op
COLLECTIVE_AVERAGINGS = (Averaging.SUM, Averaging.AVG)
"""What a collective does by its own op, asked of every candidate: a sum, or ``ReduceOp.AVG``
(``Averaging.reduce_op`` / ``Averaging.from_reduce_op`` convert; the values are refgrad's
``op`` names)."""


class Completion(Protocol):
    """What an asynchronous collective returns: ``wait()`` finishes it (``dist.Work`` or a
    candidate's own handle that does the local reduction in ``wait``)."""

    def wait(self) -> object: ...


class ReduceScatter(ABC):
    """``output`` (this rank's shard) = the reduction over ``group`` of ``input`` (the full
    bucket, ``W`` equal shards), shard ``rank`` of it, accumulated in fp32 and rounded once.
    ``output`` may be a view of ``input`` (a bucket's own shard)."""

    @abstractmethod
    def __call__(self, output: torch.Tensor, input: torch.Tensor, *,  # noqa: A002 - torch's name
                 group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType,
                 async_op: bool = False) -> Completion | None:
        """Launch (``async_op``: returns the handle whose ``wait()`` writes ``output``) or run."""


class ScratchReduceScatter(ABC):
    """:class:`ReduceScatter` whose all-to-all lands in the caller's ``scratch`` (the input's
    dtype, device and size, overlapping neither ``input`` nor ``output``)."""

    @abstractmethod
    def __call__(self, output: torch.Tensor, input: torch.Tensor, scratch: torch.Tensor, *,  # noqa: A002
                 group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType,
                 async_op: bool = False) -> Completion | None:
        """Launch or run the reduce-scatter through ``scratch``."""


class LocalReduction(ABC):
    """The local step of the fp32-accumulating reduce-scatter: ``output`` = the ``W`` rows of
    ``shards`` (``[W, n]``, 16-bit) summed in fp32 (``op`` AVG: then divided by ``W``) and
    rounded once to ``output``'s dtype."""

    @abstractmethod
    def __call__(self, shards: torch.Tensor, output: torch.Tensor, *,
                 op: dist.ReduceOp.RedOpType) -> None:
        """Write the reduction of ``shards`` into ``output`` (``n`` elements)."""


@dataclass(frozen=True)
class ReductionConfig:
    """How a DDP bucket is reduced (``DistributedDataParallelConfig``'s field names).

    ``average``: the DP mean (False: the sum, Megatron-Core's ``calculate_per_token_loss``).
    Without ``average_in_collective`` the mean is the production default: every rank
    multiplies its bucket by ``1/W`` in the grad dtype, then the collective SUMs.
    ``use_distributed_optimizer``: a reduce-scatter (rank ``r`` holds shard ``r`` of the
    result); otherwise an all-reduce (every rank the whole bucket).
    ``reduce_scatter_with_fp32_accumulation``: the reduce-scatter is the fp32-accumulating one.
    ``overlap_grad_reduce``: the bucket's collective is launched asynchronously and waited
    for in ``finish_grad_sync`` (production's setting with the distributed optimizer).
    """

    average: bool = True
    average_in_collective: bool = False
    use_distributed_optimizer: bool = True
    reduce_scatter_with_fp32_accumulation: bool = False
    overlap_grad_reduce: bool = True

    def __post_init__(self) -> None:
        for name in ("average", "average_in_collective", "use_distributed_optimizer",
                     "reduce_scatter_with_fp32_accumulation", "overlap_grad_reduce"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ReductionConfig.{name} must be a bool, "
                                f"got {type(getattr(self, name)).__name__}")
        if self.average_in_collective and not self.average:
            raise ValueError("ReductionConfig.average_in_collective averages: it needs average=True")
        if self.reduce_scatter_with_fp32_accumulation and not self.use_distributed_optimizer:
            raise ValueError("ReductionConfig.reduce_scatter_with_fp32_accumulation is a "
                             "reduce-scatter: it needs use_distributed_optimizer=True")

    @property
    def averaging(self) -> Averaging:
        """How the candidate averages (Megatron-Core's flags converted:
        :meth:`Averaging.from_megatron`)."""
        return Averaging.from_megatron(average=self.average,
                                       average_in_collective=self.average_in_collective)

    @property
    def spec_averaging(self) -> Averaging:
        """The spec's averaging the result is held to (refgrad's collective ``op``; not a torch
        ``ReduceOp``, unlike every other ``op`` here): the exact mean (``AVG``: fp32 sum / W,
        one rounding) however the candidate averages (:attr:`averaging`), or ``SUM``."""
        return Averaging.AVG if self.averaging.averages else Averaging.SUM

    @property
    def label(self) -> str:
        """How reports name the configuration."""
        averaging = _LABELS[self.averaging]
        collective = ("fp32-accumulating reduce-scatter" if self.reduce_scatter_with_fp32_accumulation
                      else "reduce-scatter" if self.use_distributed_optimizer else "all-reduce")
        return f"{collective}, {averaging}"


_LABELS = {Averaging.SUM: "sum", Averaging.AVG: "AVG in the collective",
           Averaging.PRESCALE: "pre-scale 1/W"}


class BucketReduction(ABC):
    """One DDP bucket reduced as the candidate's DDP reduces it under its :class:`ReductionConfig`.

    The candidate builds what it needs per group, dtype and size (its own buffer and bucket
    over a parameter of the bucket's size, whose grad buffer holds ``grads``) and runs its own
    grad sync on it. A bucket's size is a multiple of ``128 * W`` (no padding in any
    candidate's layout). Objects may cache what they built; use one per ``with`` block.
    """

    @abstractmethod
    def __call__(self, grads: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Reduce this rank's bucket ``grads`` (1-D, the grad dtype) over ``group``; return
        the reduced values this rank holds: its shard ``r`` of the bucket under the
        distributed optimizer, the whole bucket under an all-reduce."""


@dataclass(frozen=True)
class ReductionBehaviour:
    """How a candidate's DP reduction departs from refgrad's spec (the DP mean accumulated in
    fp32 in rank order and rounded once) by design, and where that lives (None: it does not).

    ``prescale``: the mean is a pre-scale of every rank's grads by ``1/W`` in the grad dtype
    (``refgrad.reduce_scatter.prescale_like_torch``), then a SUM: inexact unless ``W`` is a
    power of two. ``wire_collective``: the plain (not fp32-accumulating) collective sums in
    the grad dtype, in the backend's order (gloo: the reverse ring,
    ``refgrad.reduce_scatter``'s ``order="ring_reverse"``), its AVG divides that sum.
    """

    prescale: DocumentedBehaviour | None = None
    wire_collective: DocumentedBehaviour | None = None
    # torch DDP's fp16/bf16 compress hooks (:meth:`GradReduction.reduce_in` on an all-reduce):
    # ``refgrad.reduce_torch.compress_hook_all_reduce``.
    compress_hook: DocumentedBehaviour | None = None
    # FSDP2's averaging, AVG or a pre- and post-division chosen per reduce dtype, and its
    # cast to and from ``reduce_dtype``: ``refgrad.reduce_torch.fsdp2_reduce_scatter`` (and
    # ``fsdp2_accumulate`` for microbatches without grad sync).
    divide_factors: DocumentedBehaviour | None = None


_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ShardedGradCase:
    """Parameters of ``shapes`` sharded one by one (FSDP2), trained for ``microbatches``
    microbatches a step with the grad sync on the last one only. ``orig_dtype``: the sharded
    parameters' dtype (what the optimizer steps); ``param_dtype``: the unsharded parameters'
    and their grads' (mixed precision); ``reduce_dtype``: the dtype grads are reduced in
    (None: the grads'). Torch's names (``MixedPrecisionPolicy``)."""

    shapes: tuple[tuple[int, ...], ...]
    orig_dtype: str
    param_dtype: str
    reduce_dtype: str | None
    microbatches: int = 2

    def __post_init__(self) -> None:
        for name in ("orig_dtype", "param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if (value is not None or name != "reduce_dtype") and value not in _DTYPES:
                raise ValueError(f"ShardedGradCase.{name} must be one of {_DTYPES}, got {value!r}")
        if not self.shapes or any(not shape or min(shape) < 1 for shape in self.shapes):
            raise ValueError(f"ShardedGradCase.shapes must be non-empty shapes of positive sizes, "
                             f"got {self.shapes!r}")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) \
                or self.microbatches < 1:
            raise ValueError(f"ShardedGradCase.microbatches must be an int >= 1, got {self.microbatches!r}")

    @property
    def label(self) -> str:
        reduce = self.reduce_dtype or "none"
        return (f"params {self.orig_dtype}, compute {self.param_dtype}, reduce_dtype {reduce}, "
                f"{self.microbatches} microbatches, shapes {list(self.shapes)}")


class ShardedReduction(ABC):
    """One step of a :class:`ShardedGradCase` on this rank (objects may keep what they built
    across calls: a call is one training step)."""

    @abstractmethod
    def __call__(self, microbatch_grads: Sequence[Sequence[torch.Tensor]], *,
                 group: dist.ProcessGroup | None) -> list[torch.Tensor]:
        """Every microbatch's grads (per param, whole, ``param_dtype``) in; this rank's
        reduced grad of every param out (its rows, unpadded, ``orig_dtype``)."""


@runtime_checkable
class GradReduction(TechniqueScope, Protocol):
    """The candidate's DP gradient reduction (module docstring); used inside ``with``."""

    def reduce_scatter(self, op: dist.ReduceOp.RedOpType = SUM) -> ReduceScatter:
        """The fp32-accumulating reduce-scatter the candidate's buckets run, taking ``op``
        (Unsupported where it does not)."""
        ...

    def scratch_reduce_scatter(self, op: dist.ReduceOp.RedOpType = SUM) -> ScratchReduceScatter:
        """The same collective through a caller's scratch buffer (Unsupported without one)."""
        ...

    def local_reduction(self, op: dist.ReduceOp.RedOpType = SUM) -> LocalReduction:
        """The local fp32 reduction the reduce-scatter is built on, for ``op``."""
        ...

    def bucket_reduction(self, config: ReductionConfig) -> BucketReduction:
        """A DDP bucket's reduction under ``config`` (Unsupported for a configuration the
        candidate refuses up front; one it accepts and then fails in is the check's FAIL)."""
        ...

    def behaviour(self) -> ReductionBehaviour:
        """How this reduction departs from refgrad's spec by design."""
        ...

    def reduce_in(self, config: ReductionConfig, dtype: torch.dtype) -> BucketReduction:
        """A bucket's reduction under ``config`` run in ``dtype`` instead of the grads' own
        (torch DDP's fp16/bf16 compress hooks on an all-reduce, FSDP2's ``reduce_dtype`` on a
        reduce-scatter); the result comes back in the grads' dtype."""
        del config
        raise Unsupported(Technique.GRAD_REDUCTION, f"does not reduce grads in another dtype ({dtype})")

    def sharded_reduction(self, case: ShardedGradCase) -> ShardedReduction:
        """Parameters sharded one by one, their grads reduced (FSDP2's)."""
        del case
        raise Unsupported(Technique.GRAD_REDUCTION, "does not shard parameters one by one")


__all__ = [
    "AVG",
    "COLLECTIVE_AVERAGINGS",
    "SUM",
    "BucketReduction",
    "Completion",
    "GradReduction",
    "LocalReduction",
    "ReduceScatter",
    "ReductionBehaviour",
    "ReductionConfig",
    "ScratchReduceScatter",
    "ShardedGradCase",
    "ShardedReduction",
]

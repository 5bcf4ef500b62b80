"""The parallel sizes of a run and, once built, this rank's place in the grid with its groups.

As torchtitan's ``ParallelDims`` (``torchtitan/distributed/parallel_dims.py``): one frozen,
self-validating object carries the tensor (TP), context (CP), data (DP), pipeline (PP) and
virtual-pipeline (VPP) sizes and sequence parallelism. It is vocabulary (``gradvocab``): every
fastgrad object that communicates (DDP, its buffer and buckets, the MXFP8 front, the schedules,
the output layer; the optimizer through its buffer) takes it, and so do gradverify's candidate
seam, its checks and ``verify preflight``, so the sizes, ranks and groups they work with cannot
disagree.

Three ways to get one, one type:

- ``ParallelDims(tp_size=2, pp_size=2, dp_size=2)``: sizes only, for planning
  (``verify preflight``'s layouts, a case description that is pickled into ranks);
- ``dims.build()``: collectively, every process group of the grid and this rank's
  coordinates (``None`` on a rank outside the grid);
- ``dims.with_groups(tp_group=...)`` / ``ParallelDims.data_parallel(dp_group)``: the
  groups a caller already has (its own launcher's, Megatron-Core's ``parallel_state``),
  this rank's coordinate along each read from its group. ``data_parallel`` replaces
  resolving a bare DP group: without ``torch.distributed`` it is rank 0 of ``dp_size``
  (layouts and shards can be inspected; nothing can be communicated).

Rank order: Megatron-Core's ``parallel_state.initialize_model_parallel`` default
``order="tp-cp-ep-dp-pp"``: tensor parallel innermost, then context, (expert: no MoE here,
so absent), data, and pipeline outermost. The grid occupies global ranks
``[first_rank, first_rank + world_size)`` (several grids can share one world) and rank
``first_rank + ((stage * DP + dp_rank) * CP + cp_rank) * TP + tp_rank``. With CP = 1 this
is the ``tp-dp-pp`` order fastgrad has always used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from itertools import product
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from gradvocab.errors import LifecycleError
from gradvocab.validation import int_at_least

ORDER = "tp-cp-dp-pp"  # innermost first: Megatron-Core's tp-cp-ep-dp-pp without experts
_SIZES = ("tp_size", "cp_size", "dp_size", "pp_size", "vpp_size")


@dataclass(frozen=True)
class RankPlace:
    """This rank's coordinates in a grid and the process groups it belongs to.

    A coordinate is ``None`` where it is unknown (a dimension of size > 1 whose group the
    caller did not give to :meth:`ParallelDims.with_groups`). A group is ``None`` where its
    dimension has size 1, where this rank has none (the embedding group of a middle stage),
    or, for ``dp_group``, where it is torch's default group. ``distributed`` is False when
    ``torch.distributed`` is not initialized (``ParallelDims.data_parallel`` only).
    """

    rank: int
    stage: int | None = 0
    dp_rank: int | None = 0
    cp_rank: int | None = 0
    tp_rank: int | None = 0
    tp_group: Any = None
    cp_group: Any = None
    dp_group: Any = None
    pp_group: Any = None
    embedding_group: Any = None
    # Every stage and TP rank of this DP rank (what a grad norm sums over); None at TP 1,
    # where ``pp_group`` is that group.
    model_parallel_group: Any = None
    tp_ranks: tuple[int, ...] = ()
    dp_ranks: tuple[int, ...] = ()
    pp_ranks: tuple[int, ...] = ()
    embedding_ranks: tuple[int, ...] = ()
    distributed: bool = True


T = TypeVar("T")


class _FromPlace(Generic[T]):
    """A read-only attribute of :class:`ParallelDims` taken from its :class:`RankPlace`;
    a :class:`LifecycleError` on a sizes-only instance or for an unknown coordinate."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, dims: ParallelDims | None, owner: type | None = None) -> T:
        if dims is None:
            return self  # type: ignore[return-value]  # the class attribute itself
        if dims.place is None:
            raise LifecycleError(
                f"ParallelDims.{self.name}: these dims are sizes only ({dims}); build() them "
                "(collectively), or give the groups with with_groups() / data_parallel()")
        value = getattr(dims.place, self.name)
        if value is None and self.name in ("stage", "dp_rank", "cp_rank", "tp_rank"):
            raise LifecycleError(
                f"ParallelDims.{self.name} is unknown on this rank: with_groups() was given no "
                f"group for that dimension ({dims})")
        return value


@dataclass(frozen=True)
class ParallelDims:
    """TP x CP x DP x PP sizes (VPP model chunks per pipeline rank), sequence parallelism, where
    the grid starts in the world, and (``place``) this rank's coordinates and groups once built.

    Production's rules, checked on construction: every size is an int >= 1; sequence
    parallelism needs TP > 1 (Megatron-Core's ``ModelParallelConfig``); VPP > 1 needs PP >= 2.
    """

    tp_size: int = 1
    cp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    vpp_size: int = 1
    sequence_parallel: bool = False
    first_rank: int = 0
    place: RankPlace | None = None

    def __post_init__(self) -> None:
        for name in _SIZES:
            object.__setattr__(self, name, int_at_least(getattr(self, name), f"ParallelDims.{name}", 1))
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"ParallelDims.sequence_parallel must be a bool, got "
                            f"{type(self.sequence_parallel).__name__}")
        if (isinstance(self.first_rank, bool) or not isinstance(self.first_rank, int)
                or self.first_rank < 0):
            raise ValueError(f"ParallelDims.first_rank must be an int >= 0, got {self.first_rank!r}")
        if self.sequence_parallel and self.tp_size == 1:
            raise ValueError("ParallelDims.sequence_parallel needs tp_size > 1 (Megatron-Core: "
                             "cannot use sequence parallelism without tensor parallelism)")
        if self.vpp_size > 1 and self.pp_size < 2:
            raise ValueError(f"ParallelDims.vpp_size={self.vpp_size} needs pp_size >= 2 (virtual "
                             "stages interleave over a pipeline)")
        if self.place is not None:
            self._check_place(self.place)

    def _check_place(self, place: RankPlace) -> None:
        if not isinstance(place, RankPlace):
            raise TypeError(f"ParallelDims.place must be a RankPlace or None, got "
                            f"{type(place).__name__}")
        for coordinate, size in (("stage", self.pp_size), ("dp_rank", self.dp_size),
                                 ("cp_rank", self.cp_size), ("tp_rank", self.tp_size)):
            value = getattr(place, coordinate)
            if value is not None and not 0 <= value < size:
                raise ValueError(f"ParallelDims.place.{coordinate} must be in [0, {size}), "
                                 f"got {value}")
        if place.pp_ranks and len(place.pp_ranks) != self.pp_size:
            raise ValueError(f"ParallelDims.place.pp_ranks must hold pp_size={self.pp_size} "
                             f"ranks, got {place.pp_ranks}")

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        """Ranks the grid occupies: ``TP * CP * DP * PP``."""
        return self.tp_size * self.cp_size * self.dp_size * self.pp_size

    @property
    def num_virtual_stages(self) -> int:
        """Model chunks over the whole pipeline: ``PP * VPP``."""
        return self.pp_size * self.vpp_size

    @property
    def built(self) -> bool:
        """True when this rank's coordinates and groups are known (``place`` is set)."""
        return self.place is not None

    def sizes_only(self) -> ParallelDims:
        """The same sizes without this rank's place (picklable: no process groups)."""
        return replace(self, place=None)

    def __str__(self) -> str:
        text = f"TP {self.tp_size} x CP {self.cp_size} x DP {self.dp_size} x PP {self.pp_size}"
        if self.vpp_size > 1:
            text += f" (VPP {self.vpp_size})"
        if self.sequence_parallel:
            text += ", sequence parallel"
        return text + (f" from rank {self.first_rank}" if self.first_rank else "")

    def global_rank(self, stage: int, dp_rank: int, tp_rank: int = 0, cp_rank: int = 0) -> int:
        """The global rank at these coordinates (``tp-cp-dp-pp``, offset by ``first_rank``)."""
        for name, value, size in (("stage", stage, self.pp_size), ("dp_rank", dp_rank, self.dp_size),
                                  ("tp_rank", tp_rank, self.tp_size), ("cp_rank", cp_rank, self.cp_size)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(f"{name} must be an int in [0, {size}), got {value!r}")
        return self.first_rank + (((stage * self.dp_size + dp_rank) * self.cp_size + cp_rank)
                                  * self.tp_size + tp_rank)

    def coordinates(self, rank: int) -> tuple[int, int, int, int] | None:
        """``(stage, dp_rank, cp_rank, tp_rank)`` of global ``rank``; None outside the grid."""
        offset = rank - self.first_rank
        if not 0 <= offset < self.world_size:
            return None
        rest, tp_rank = divmod(offset, self.tp_size)
        rest, cp_rank = divmod(rest, self.cp_size)
        stage, dp_rank = divmod(rest, self.dp_size)
        return stage, dp_rank, cp_rank, tp_rank

    # ------------------------------------------------------------------ this rank
    rank = _FromPlace[int]()
    stage = _FromPlace[int]()
    dp_rank = _FromPlace[int]()
    cp_rank = _FromPlace[int]()
    tp_rank = _FromPlace[int]()
    tp_group = _FromPlace[Any]()
    cp_group = _FromPlace[Any]()
    dp_group = _FromPlace[Any]()
    pp_group = _FromPlace[Any]()
    embedding_group = _FromPlace[Any]()
    model_parallel_group = _FromPlace[Any]()
    tp_ranks = _FromPlace[tuple[int, ...]]()
    dp_ranks = _FromPlace[tuple[int, ...]]()
    pp_ranks = _FromPlace[tuple[int, ...]]()
    embedding_ranks = _FromPlace[tuple[int, ...]]()
    distributed = _FromPlace[bool]()

    @property
    def is_first_stage(self) -> bool:
        """True on pipeline stage 0 (it owns the inputs)."""
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (it owns the targets and the losses)."""
        return self.stage == self.pp_size - 1

    # ------------------------------------------------------------------ building
    @classmethod
    def data_parallel(cls, dp_group: Any = None, dp_size: int | None = None) -> ParallelDims:
        """Data parallelism only, over ``dp_group`` (None: torch's default group).

        Asks ``torch.distributed`` once for the group's size and this rank's rank in it;
        ``dp_size``, if given, must agree. Without ``torch.distributed``, ``dp_size``
        (default 1) is taken as given, the rank is 0 and no group may be given.
        """
        if dp_size is not None and (isinstance(dp_size, bool) or not isinstance(dp_size, int)):
            raise TypeError(f"dp_size must be an int or None, got {type(dp_size).__name__}")
        if dp_size is not None and dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if dist.is_available() and dist.is_initialized():
            _require_member(dp_group, "dp_group", "data-parallel")
            world = dist.get_world_size(dp_group)
            if dp_size is not None and dp_size != world:
                raise ValueError(
                    f"dp_size={dp_size} disagrees with the process group's size {world}")
            return cls(dp_size=world, place=RankPlace(
                rank=dist.get_rank(), dp_rank=dist.get_rank(dp_group), dp_group=dp_group))
        if dp_group is not None:
            raise ValueError("dp_group was given but torch.distributed is not initialized")
        return cls(dp_size=1 if dp_size is None else dp_size,
                   place=RankPlace(rank=0, dp_rank=0, distributed=False))

    def with_groups(self, *, tp_group: Any = None, cp_group: Any = None, dp_group: Any = None,
                    pp_group: Any = None, embedding_group: Any = None,
                    model_parallel_group: Any = None) -> ParallelDims:
        """These sizes with process groups the caller already has.

        Each of ``tp_group``, ``cp_group``, ``dp_group``, ``pp_group`` must have its
        dimension's size; this rank's coordinate along it is its rank in the group (0 along a
        dimension of size 1, unknown along a larger one given no group). Needs
        ``torch.distributed``.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise LifecycleError("ParallelDims.with_groups needs torch.distributed to be initialised")
        coordinates: dict[str, int | None] = {}
        for name, group, size, coordinate in (("tp_group", tp_group, self.tp_size, "tp_rank"),
                                              ("cp_group", cp_group, self.cp_size, "cp_rank"),
                                              ("dp_group", dp_group, self.dp_size, "dp_rank"),
                                              ("pp_group", pp_group, self.pp_size, "stage")):
            if group is None:
                coordinates[coordinate] = 0 if size == 1 else None
                continue
            _require_member(group, name, name.removesuffix("_group").upper())
            if dist.get_world_size(group) != size:
                raise ValueError(f"{name} has {dist.get_world_size(group)} ranks but "
                                 f"ParallelDims.{name.replace('group', 'size')}={size}")
            coordinates[coordinate] = dist.get_rank(group)
        pp_ranks = tuple(dist.get_process_group_ranks(pp_group)) if pp_group is not None else ()
        return replace(self, place=RankPlace(
            rank=dist.get_rank(), **coordinates, tp_group=tp_group, cp_group=cp_group,
            dp_group=dp_group, pp_group=pp_group, embedding_group=embedding_group,
            model_parallel_group=model_parallel_group, pp_ranks=pp_ranks))

    def build(self) -> ParallelDims | None:
        """Create the grid's DP, pipeline, embedding and (TP > 1) TP and model-parallel groups.

        ``dist.new_group`` is collective over the whole world, so every rank of the world
        must call this identically, in the same order; ranks outside the grid get None.
        Each TP rank has its own DP group (same stage and TP rank) and pipeline (same DP and
        TP rank) and embedding group (first and last stage); each (stage, DP rank) one TP
        group, each DP rank one model-parallel group (every stage and TP rank).
        """
        if self.cp_size > 1:
            raise ValueError(f"ParallelDims.build: cp_size={self.cp_size}: build() creates no "
                             "context-parallel groups; cp_size > 1 is for planning only")
        if not (dist.is_available() and dist.is_initialized()):
            raise LifecycleError("ParallelDims.build needs torch.distributed to be initialised")
        world = dist.get_world_size()
        if self.first_rank + self.world_size > world:
            raise ValueError(
                f"first_rank + tp_size * dp_size * pp_size = {self.first_rank} + {self.tp_size} * "
                f"{self.dp_size} * {self.pp_size} exceeds the world size {world}")
        rank = dist.get_rank()
        mine = self.coordinates(rank)
        stage, dp_rank, _, tp_rank = mine if mine is not None else (-1, -1, -1, -1)

        def new_groups(keys: Iterable[tuple[int, ...]], ranks_of: Callable[..., Iterable[int]],
                       key: tuple[int, ...]) -> tuple[Any, tuple[int, ...]]:
            """One group per key, created by every rank in the same order; this rank's group
            and its ranks (None, () if it has none)."""
            found: tuple[Any, tuple[int, ...]] = (None, ())
            for k in keys:
                ranks = tuple(ranks_of(*k))
                group = dist.new_group(list(ranks))
                if k == key:
                    found = (group, ranks)
            return found

        at, last = self.global_rank, self.pp_size - 1
        tps, pps, dps = range(self.tp_size), range(self.pp_size), range(self.dp_size)
        dp_group, dp_ranks = new_groups(product(tps, pps), lambda t, s: (at(s, d, t) for d in dps),
                                        (tp_rank, stage))
        pp_group, pp_ranks = new_groups(product(tps, dps), lambda t, d: (at(s, d, t) for s in pps),
                                        (tp_rank, dp_rank))
        embedding_group, embedding_ranks = None, ()
        if self.pp_size > 1:
            embedding_group, embedding_ranks = new_groups(
                product(tps, dps), lambda t, d: (at(0, d, t), at(last, d, t)), (tp_rank, dp_rank))
        tp_group, tp_ranks, model_parallel_group = None, (rank,), None
        if self.tp_size > 1:
            tp_group, tp_ranks = new_groups(product(pps, dps),
                                            lambda s, d: (at(s, d, t) for t in tps), (stage, dp_rank))
            model_parallel_group, _ = new_groups(
                ((d,) for d in dps), lambda d: (at(s, d, t) for s in pps for t in tps), (dp_rank,))
        if mine is None:
            return None
        return replace(self, place=RankPlace(
            rank=rank, stage=stage, dp_rank=dp_rank, cp_rank=0, tp_rank=tp_rank,
            tp_group=tp_group, dp_group=dp_group, pp_group=pp_group,
            embedding_group=embedding_group, model_parallel_group=model_parallel_group,
            tp_ranks=tp_ranks, dp_ranks=dp_ranks, pp_ranks=pp_ranks,
            embedding_ranks=embedding_ranks))



def _require_member(group: Any, name: str, what: str) -> None:
    """ValueError when ``group`` (a given process group) does not hold this process."""
    if group is not None and dist.get_rank(group) < 0:
        # torch answers size -1 and rank -1 for a group this process is not in
        raise ValueError(
            f"{name} does not contain this process (global rank {dist.get_rank()}): pass the "
            f"{what} group this rank belongs to (dist.new_group is called by every rank with the "
            "same ranks; each rank then uses the group holding it)")


def require_place(parallel_dims: object, owner: str) -> ParallelDims:
    """``parallel_dims`` if it is a :class:`ParallelDims` that knows this rank's place, else a
    TypeError/ValueError naming ``owner``."""
    if not isinstance(parallel_dims, ParallelDims):
        raise TypeError(f"{owner}: parallel_dims must be a ParallelDims, got "
                        f"{type(parallel_dims).__name__}")
    if parallel_dims.place is None:
        raise ValueError(f"{owner}: parallel_dims ({parallel_dims}) are sizes only; build() them, "
                         "or use ParallelDims.data_parallel(dp_group) / with_groups()")
    return parallel_dims


__all__ = ["ORDER", "ParallelDims", "RankPlace", "require_place"]

"""The seam between verify and an implementation under test (a *candidate*), in one module.

As FSDP2's ``_fsdp_api.py``, this is the whole contract: a :class:`Candidate` hands out one
typed interface per :class:`Technique` (a Protocol, used inside ``with``:
:class:`TechniqueScope`), each collective or step a small class with one typed ``__call__``,
and the small records they exchange. A candidate imports this module, ``gradvocab`` and its
own library, nothing else of ours (``tests/candidates/test_candidate_imports.py``); what it
needs of refgrad (its layout record, its pipeline model and spec helpers) is re-exported
here, imported below.

A candidate that cannot run a technique here raises :class:`Unsupported` with the reason and
the check records a SKIP naming it; a candidate that departs from refgrad's spec by design
names the :class:`DocumentedBehaviour` and the check holds it to refgrad's model of it. A
candidate is a frozen dataclass, pickled into the rank processes, which ask it there for
the technique they run. Deliberately broken candidates are the tests' own subclasses
(``tests/candidates/*_faults.py``); this module knows nothing of them.

The last section holds settings types that move to ``gradvocab`` (marked there).
"""

from __future__ import annotations

import enum
import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import ClassVar, Protocol, Self, runtime_checkable

import torch
import torch.distributed as dist

from gradvocab import (
    AdamWConfig,
    Averaging,
    DDPConfig,
    LossScaling,
    MegatronAveragingFlags,
    ParallelDims,
    RankResult,
    SGDConfig,
    StepOutcome,
)

# Refgrad's records and specification helpers a candidate builds from (one import path).
from refgrad.layout import Layout, validate_layout_arguments
from refgrad.mxfp8 import SCALE_MODES
from refgrad.pipeline import (
    EMBEDDING_PARAM,
    HEAD_PARAM,
    REDUCTIONS,
    LinearStackSpec,
    StageModule,
    StepPlan,
    cast_params_,
    head_shard,
    head_weight_init,
    rank_microbatches,
    sgd_update,
    splits_loss,
    stage_loss,
    stage_param_name,
    updated_once,
)

_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _require_bools(instance: object, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(instance, name)
        if not isinstance(value, bool):
            raise TypeError(f"{type(instance).__name__}.{name} must be a bool, "
                            f"got {type(value).__name__}")


def _require_int(instance: object, name: str, minimum: int, *, optional: bool = False) -> None:
    value = getattr(instance, name)
    if not (optional and value is None):
        _count(type(instance).__name__, name, value, minimum, optional=optional)


def _count(owner: str, name: str, value: object, minimum: int, *, optional: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = "None or " if optional else ""
        raise ValueError(f"{owner}.{name} must be {none}an int >= {minimum}, got {value!r}")


def _require_type(instance: object, name: str, kind: type) -> None:
    value = getattr(instance, name)
    if not isinstance(value, kind):
        raise TypeError(f"{type(instance).__name__}.{name} must be a {kind.__name__}, "
                        f"got {type(value).__name__}")


# --- The candidate, its techniques, verdicts and known findings ------------------------------------

class Technique(str, enum.Enum):
    """A technique a candidate implements; the value is its check's name."""

    LAYOUT = "layout"
    GRAD_REDUCTION = "reduce_scatter"
    DEFERRED_WGRAD = "deferred_wgrad"
    PIPELINE = "pipeline"
    OPTIMIZER = "optim"
    MXFP8 = "mxfp8"


class Unsupported(Exception):  # noqa: N818 - it is a verdict, not an error
    """This candidate cannot run ``technique`` (or a part of it) here; ``reason`` says why.
    Checks turn it into a SKIP naming the candidate and the reason."""

    def __init__(self, technique: Technique, reason: str) -> None:
        super().__init__(f"{technique.value}: {reason}")
        self.technique = technique
        self.reason = reason


@dataclass(frozen=True)
class DocumentedBehaviour:
    """A departure from refgrad's spec by design: ``summary``, and ``where`` the candidate does
    it (module and function). A check holds it to refgrad's model of the behaviour (a FAIL if
    it misses) and reports its distance from the spec as a documented difference."""

    summary: str
    where: str

    def __post_init__(self) -> None:
        for name in ("summary", "where"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"DocumentedBehaviour.{name} must be a non-empty string")


class Behaviour(str, enum.Enum):
    """A departure from refgrad's spec that a check can model; :meth:`Candidate.documented`
    says whether a candidate departs so, and where."""

    # Buffer views at 64-element offsets from the buffer's start, the start where the
    # allocator put it (layout check).
    BUFFER_ALIGNMENT_FROM_ALLOCATOR = "buffer_alignment_from_allocator"
    # Every stage and model chunk after the first puts its params in one bucket (pipeline check).
    ONE_BUCKET_AFTER_FIRST_STAGE = "one_bucket_after_first_stage"
    # torch's DDP Reducer buckets: sized in bytes, filled in grad-ready order, no padding or
    # shards (layout check: held to ``refgrad.layout_torch.ddp_layout``).
    DDP_BUCKETS = "ddp_buckets"
    # No bucketed buffer: every parameter sharded on its own along dim 0 (layout check: held to
    # ``refgrad.layout_torch.fsdp2_shards``).
    DIM0_PARAMETER_SHARDS = "dim0_parameter_shards"
    # The DP reduction (reduce_scatter and layout checks; the spec: the DP mean accumulated in
    # fp32 in rank order, rounded once). ``1/W`` in the grad dtype, then a SUM
    # (``refgrad.reduce_scatter.prescale_like_torch``);
    PRESCALE = "prescale"
    # the plain collective sums in the grad dtype in the backend's order (gloo: ``ring_reverse``);
    WIRE_COLLECTIVE = "wire_collective"
    # torch DDP's fp16/bf16 compress hooks (``refgrad.reduce_torch.compress_hook_all_reduce``);
    COMPRESS_HOOK = "compress_hook"
    # FSDP2's averaging and ``reduce_dtype`` casts (``refgrad.reduce_torch.fsdp2_reduce_scatter``).
    DIVIDE_FACTORS = "divide_factors"
    # The optimizer (optim check and the preflight twin; the spec: ``refgrad.optim``). torch's
    # order of operations (``refgrad.optim_torch``), AdamW and SGD;
    TORCH_ADAMW_ORDER = "torch_adamw_order"
    TORCH_SGD_ORDER = "torch_sgd_order"
    # no weight decay on 1-D params;
    NO_DECAY_ON_1D_PARAMS = "no_decay_on_1d_params"
    # an fp32 partial-sum grad norm, within ``γ(n + k + R + 8)`` of the exact one, clipped with its own;
    PARTIAL_SUM_GRAD_NORM = "partial_sum_grad_norm"
    # ``torch.nn.utils``' clip coefficient;
    TORCH_CLIP_COEFFICIENT = "torch_clip_coefficient"
    # under ``overlap_param_gather`` each forward pre-hook launches its bucket's all-gather.
    PARAM_GATHER_IN_FORWARD = "param_gather_in_forward"


# The departures the reduction checks and the optimizer checks ask a candidate about (the
# optimizer's in the order reports list them).
REDUCTION_BEHAVIOURS = (Behaviour.PRESCALE, Behaviour.WIRE_COLLECTIVE, Behaviour.COMPRESS_HOOK,
                        Behaviour.DIVIDE_FACTORS)
OPTIMIZER_BEHAVIOURS = (Behaviour.TORCH_ADAMW_ORDER, Behaviour.NO_DECAY_ON_1D_PARAMS,
                        Behaviour.PARTIAL_SUM_GRAD_NORM, Behaviour.TORCH_SGD_ORDER,
                        Behaviour.PARAM_GATHER_IN_FORWARD, Behaviour.TORCH_CLIP_COEFFICIENT)


@runtime_checkable
class TechniqueScope(Protocol):
    """A technique's interface is used inside ``with``: the candidate's per-process setup for
    it (Megatron-Core on a CPU: its CUDA redirects) holds for everything in the block,
    autograd's backward included. fastgrad needs none (these defaults)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        return None


@dataclass(frozen=True)
class LaunchSettings:
    """What a check's case stands for in a launch: the gradient-path settings by Megatron-LM's
    names (their defaults when not given), or, for a torch candidate, ``torch_api``'s
    ``name=value`` settings. ``verify preflight`` reads a user's launch into the same type, so
    a :class:`Finding`'s rule answers both "which cases showed it?" and "does my launch reach
    it?". ``microbatches``: M of each step (empty: not part of the case)."""

    dims: ParallelDims = field(default_factory=ParallelDims)
    params_dtype: str = "float32"
    grad_dtype: str = "float32"  # the main-grad buffer's dtype, in which grads are reduced
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_grad_reduce: bool = True
    ddp_reduce_scatter_with_fp32_accumulation: bool = False
    ddp_average_in_collective: bool = False
    calculate_per_token_loss: bool = False
    # torch FSDP2 wraps the model chunks (Megatron-LM's --use-torch-fsdp2) instead of DDP
    use_torch_fsdp2: bool = False
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    untie_embeddings_and_output_weights: bool = False
    has_output_layer: bool = True
    microbatches: tuple[int, ...] = ()
    # What no Megatron-LM launch does (direct API use; :attr:`api_only`): a DDP built where
    # one with the fp32-accumulating reduce-scatter was built before;
    after_fp32_accumulating_ddp: bool = False
    # a step abandoned by a caught exception between a backward and the drain;
    after_abandoned_step: bool = False
    # P2P batched at PP 2 with VPP (validate_args refuses it without --overlap-p2p-communication);
    batch_p2p_comm: bool = False
    # a function of the candidate called outside the training loop that wires it.
    direct_call: str | None = None
    # Flags no finding's rule reads (optimizer, clipping, loss scaling), as Megatron-LM spells them.
    other_flags: tuple[str, ...] = ()
    # A candidate without a launcher: its torch API settings and calls, as ``name=value``.
    torch_api: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _require_type(self, "dims", ParallelDims)
        for name in ("params_dtype", "grad_dtype"):
            if getattr(self, name) not in _DTYPE_NAMES:
                raise ValueError(f"LaunchSettings.{name} must be one of {_DTYPE_NAMES}, "
                                 f"got {getattr(self, name)!r}")
        _require_int(self, "wgrad_deferral_limit", 0)
        if not isinstance(self.microbatches, tuple) or not all(
                isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in self.microbatches):
            raise ValueError(f"LaunchSettings.microbatches must be a tuple of ints >= 1 (M per "
                             f"step), got {self.microbatches!r}")
        if not isinstance(self.torch_api, tuple) or not all(
                isinstance(a, str) and a for a in self.torch_api):
            raise ValueError(f"LaunchSettings.torch_api must be a tuple of non-empty strings "
                             f"(torch calls and 'name=value' settings), got {self.torch_api!r}")
        if self.direct_call is not None and not (isinstance(self.direct_call, str) and self.direct_call):
            raise ValueError("LaunchSettings.direct_call must be None or a non-empty description")

    @property
    def api_only(self) -> str | None:
        """What the case does that no Megatron-LM launch does (None: a launch can reach it)."""
        parts = []
        if self.after_fp32_accumulating_ddp:
            parts.append("built in a process where a DistributedDataParallel with the "
                         "fp32-accumulating reduce-scatter was built before")
        if self.after_abandoned_step:
            parts.append("after a step abandoned by a caught exception between a backward and "
                         "the drain")
        if self.batch_p2p_comm:
            parts.append("batch_p2p_comm=True (Megatron-LM uses overlap_p2p_comm with VPP)")
        if self.direct_call is not None:
            parts.append(self.direct_call)
        return "; ".join(parts) or None

    @property
    def deferral_drains_one_at_a_time(self) -> bool:
        """A drain finds exactly one deferred wgrad at some point of a step: deferral limit 1,
        or one microbatch a step."""
        if not (self.defer_embedding_wgrad_compute and self.has_output_layer):
            return False
        return self.wgrad_deferral_limit == 1 or 1 in self.microbatches



class Effect(str, enum.Enum):
    """What goes wrong when a finding is reached."""

    WRONG_GRADIENT = "wrong gradient"
    CRASH = "crash"
    WRONG_ACTIVATIONS = "wrong activations"
    WRONG_CHECKPOINT = "wrong checkpoint"
    # the same grads rounded differently under a setting documented as changing nothing
    # numerically (each result within an ULP of the exact one)
    INCONSISTENT_ROUNDING = "inconsistent rounding"


@dataclass(frozen=True)
class CrashSignature:
    """How a finding's crash looks: the root cause's exception type and, optionally, the
    function it was raised in."""

    exception: str
    function: str | None = None

    def matches(self, exception: str, function: str | None) -> bool:
        return exception == self.exception and (self.function is None or function == self.function)


@dataclass(frozen=True)
class Finding:
    """One known root cause in a candidate (not one failing comparison). The harness
    (``verify.attribution``) matches a failing case's :class:`LaunchSettings` (and a crash's
    exception) against ``reaches`` (and ``crash``); what no finding explains is a FAIL."""

    key: str  # stable identifier, e.g. "megatron-core-4"
    number: int  # its number in the candidate's list of findings
    title: str
    effect: Effect
    launch: str | None  # the Megatron-LM flags that reach it; None: no launch does
    api_only: str | None  # why only direct API use reaches it
    upstream: str  # the upstream issue(s) or pull request(s), or "none found"
    reproduction: str  # a standalone script, relative to the gradverify checkout
    avoid: str  # what to change to avoid it
    reaches: Callable[[LaunchSettings], bool] = field(compare=False, repr=False)
    # How its crash looks: always for Effect.CRASH; for another effect, where some of the
    # settings that reach it crash instead.
    crash: CrashSignature | None = None

    def __post_init__(self) -> None:
        if (self.launch is None) == (self.api_only is None):
            raise ValueError(f"finding {self.key}: give either the launch flags that reach it "
                             f"or why only direct API use does, not both or neither")
        if self.effect is Effect.CRASH and self.crash is None:
            raise ValueError(f"finding {self.key}: a crash finding needs its CrashSignature")
        for name in ("key", "title", "upstream", "reproduction", "avoid"):
            if not getattr(self, name):
                raise ValueError(f"finding {self.key or '?'}: {name} must not be empty")

    @property
    def reachable(self) -> bool:
        """True when a launch can reach it; False: only direct use of the candidate's API."""
        return self.launch is not None

    @property
    def classification(self) -> str:
        """Its class in reports: what goes wrong, or a hazard only direct API use reaches."""
        if not self.reachable:
            return f"hazard, direct API use only ({self.effect.value})"
        return self.effect.value

    def to_dict(self) -> dict:
        """Plain values for the JSON report."""
        return {"key": self.key, "number": self.number, "title": self.title,
                "class": self.classification, "effect": self.effect.value,
                "reachable": self.reachable, "launch": self.launch, "api_only": self.api_only,
                "upstream": self.upstream, "reproduction": self.reproduction,
                "avoid": self.avoid}


@dataclass(frozen=True)
class CandidateInfo:
    """What a report says about a candidate: ``redirects`` made for it to run on this device
    (empty: as published), ``unsupported`` techniques with the reason."""

    name: str
    version: str
    description: str
    redirects: tuple[str, ...] = ()
    unsupported: tuple[tuple[str, str], ...] = ()
    details: tuple[tuple[str, str], ...] = field(default=())

    def to_dict(self) -> dict:
        """Plain values for the JSON report."""
        return {"name": self.name, "version": self.version, "description": self.description,
                "redirects": list(self.redirects), "unsupported": dict(self.unsupported),
                "details": dict(self.details)}


class Candidate(ABC):
    """One implementation of the verified techniques (subclasses are frozen dataclasses).

    Each accessor returns that technique's interface or raises :class:`Unsupported`; it is
    called where the technique runs (inside a rank process), so it may import the
    implementation there.
    """

    name: ClassVar[str]
    # Packages its code lives in: a rank's crash rooted there (or in a library they call) is
    # the candidate's, elsewhere the harness's; the module of its class counts too.
    code_modules: ClassVar[tuple[str, ...]] = ()
    # Modules the rank launcher's fork server imports once for every fresh rank.
    preload_modules: ClassVar[tuple[str, ...]] = ()
    # True: a configuration may leave process-wide state behind, so each configuration a
    # check builds runs in fresh processes (False only for one that keeps none: fastgrad).
    isolates_configurations: ClassVar[bool] = True

    @abstractmethod
    def info(self) -> CandidateInfo:
        """Name, installed version, redirects and unsupported techniques, for the report."""

    @property
    def label(self) -> str:
        """How reports name it (a test's broken subclass: ``"<name> (fault: <bug>)"``)."""
        return self.name

    def documented(self, behaviour: Behaviour) -> DocumentedBehaviour | None:
        """How this candidate documents ``behaviour`` (None: it follows refgrad's spec there).
        Raises :class:`Unsupported` where refgrad has no model of how it departs here."""
        del behaviour
        return None

    def departures(self, behaviours: Iterable[Behaviour]) -> dict[Behaviour, DocumentedBehaviour]:
        """Those of ``behaviours`` this candidate documents (:meth:`documented`), for a check
        to hand to its reference and rank processes."""
        return {b: found for b in behaviours if (found := self.documented(b)) is not None}

    def findings(self) -> tuple[Finding, ...]:
        """The root causes this candidate is known to have (none: every failure is a FAIL)."""
        return ()

    @property
    def own_modules(self) -> tuple[str, ...]:
        """The packages whose crashes are this candidate's."""
        return (*self.code_modules, type(self).__module__)

    def unsupported(self, technique: Technique, reason: str) -> Unsupported:
        """The :class:`Unsupported` to raise for ``technique``, naming this candidate."""
        return Unsupported(technique, f"{self.label} {reason}")

    def layout(self) -> BucketLayout:
        """Bucket layout and the padded grad buffer."""
        raise self.unsupported(Technique.LAYOUT, "does not implement the bucket layout")

    def grad_reduction(self) -> GradReduction:
        """The data-parallel gradient reduction."""
        raise self.unsupported(Technique.GRAD_REDUCTION, "does not implement the grad reduction")

    def deferred_wgrad(self) -> DeferredWgrad:
        """The output layer with deferred embedding wgrad, and its drain."""
        raise self.unsupported(Technique.DEFERRED_WGRAD, "does not implement deferred wgrad")

    def pipeline(self) -> PipelineTraining:
        """DDP grad sync with the 1F1B schedules, plain and interleaved."""
        raise self.unsupported(Technique.PIPELINE, "does not implement the pipeline schedules")

    def optimizer(self) -> DistributedOptimizerStep:
        """The distributed optimizer step with the param all-gather."""
        raise self.unsupported(Technique.OPTIMIZER, "does not implement the distributed optimizer")

    def mxfp8(self) -> MXFP8:
        """MXFP8 quantization and param/grad buffer sharing."""
        raise self.unsupported(Technique.MXFP8, "does not implement MXFP8")


# --- layout: bucket layout and the padded grad buffer (the ``layout`` check) -----------------------

@dataclass(frozen=True)
class LayoutCase:
    """A parameter list (sizes in registration order) and the settings that lay it out
    (``refgrad.layout.compute_layout``'s); ``shared_embedding``: registration indices of
    params with a bucket of their own under the distributed optimizer."""

    numels: tuple[int, ...]
    dp_size: int
    bucket_size: int | None
    use_distributed_optimizer: bool
    pad_buckets_for_high_nccl_busbw: bool
    shared_embedding: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        numels, _, _, _ = validate_layout_arguments(
            self.numels, self.dp_size, self.bucket_size, self.shared_embedding)
        object.__setattr__(self, "numels", tuple(numels))
        object.__setattr__(self, "shared_embedding", tuple(self.shared_embedding))
        _require_bools(self, ("use_distributed_optimizer", "pad_buckets_for_high_nccl_busbw"))

    @property
    def ddp_bucket_cap_mb(self) -> float | None:
        """torch DDP's ``bucket_cap_mb`` for fp32 params (None: DDP's default)."""
        return None if self.bucket_size is None else self.bucket_size * 4 / 2**20

    def refgrad_kwargs(self) -> dict:
        """The settings as keyword arguments of ``refgrad.layout.compute_layout``."""
        return {"dp_size": self.dp_size, "bucket_size": self.bucket_size,
                "use_distributed_optimizer": self.use_distributed_optimizer,
                "pad_buckets_for_high_nccl_busbw": self.pad_buckets_for_high_nccl_busbw,
                "shared_embedding": self.shared_embedding}


@dataclass(frozen=True)
class GradPiece:
    """The part of one parameter's grad inside one rank's shard: ``param_offset`` ``(lo, hi)``
    into the flattened parameter, ``values`` a copy of those elements."""

    param_offset: tuple[int, int]
    values: torch.Tensor


@runtime_checkable
class GradBucket(Protocol):
    """One bucket: elements ``[start, end)`` of its group's buffers (end padding included),
    reduced as one collective (reduce-scatter, or all-reduce without the distributed
    optimizer) launched by ``start_grad_sync`` and waited for by ``finish_grad_sync``."""

    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...

    def grad_shard(self, rank: int) -> torch.Tensor:
        """A view of DP rank ``rank``'s shard of this bucket's grads."""

    def start_grad_sync(self) -> None: ...
    def finish_grad_sync(self) -> None: ...

    @property
    def reduce_in_flight(self) -> bool:
        """True between ``start_grad_sync`` and ``finish_grad_sync``."""


@runtime_checkable
class GradBufferGroup(Protocol):
    """The params of one (param dtype, grad dtype) in one contiguous, padded buffer."""

    @property
    def param_dtype(self) -> torch.dtype: ...
    @property
    def grad_dtype(self) -> torch.dtype: ...

    @property
    def params(self) -> Sequence[torch.nn.Parameter]:
        """In registration order; each has a ``main_grad`` view."""

    @property
    def grad_data(self) -> torch.Tensor:
        """The whole flat grad buffer, padding included."""

    @property
    def param_data(self) -> torch.Tensor | None:
        """The flat param buffer the params live in (distributed optimizer), else None."""

    @property
    def buckets(self) -> Sequence[GradBucket]: ...

    def layout(self) -> Layout:
        """Where the group's params and buckets are, read from the buffer's own bookkeeping."""


@runtime_checkable
class GradBuffer(Protocol):
    """A candidate's padded buffers over the params it was given. The norm and checkpoint
    helpers never see padding; a candidate without one raises :class:`Unsupported`."""

    @property
    def groups(self) -> Sequence[GradBufferGroup]:
        """One group per (param dtype, grad dtype), in first-seen order."""

    @property
    def buckets(self) -> Sequence[GradBucket]:
        """Every group's buckets, group after group."""

    def zero_grad(self) -> None:
        """Zero every grad buffer, padding included."""

    def padding_is_zero(self) -> bool: ...

    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares (float64) of every param's ``main_grad``."""

    def local_shard_grad_norm_sq(self, rank: int) -> torch.Tensor:
        """Sum of squares (float64) of the param elements in DP rank ``rank``'s shards."""

    def checkpoint_grads(self) -> dict[int, torch.Tensor]:
        """Per registration index, the ``main_grad`` a non-sharded checkpoint saves."""

    def shard_checkpoint_grads(self, rank: int) -> dict[int, list[GradPiece]]:
        """Per registration index, the pieces DP rank ``rank`` saves (distributed optimizer)."""


@dataclass(frozen=True)
class BucketTraining:
    """How the layout check trains a module in a candidate's own DDP (torch DDP's argument
    names; ``set_to_none``: how grads are zeroed before each iteration)."""

    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    set_to_none: bool = True

    def __post_init__(self) -> None:
        _require_bools(self, ("gradient_as_bucket_view", "set_to_none"))
        if self.bucket_cap_mb is not None and not (
                isinstance(self.bucket_cap_mb, (int, float)) and not isinstance(self.bucket_cap_mb, bool)
                and self.bucket_cap_mb > 0):
            raise ValueError(f"BucketTraining.bucket_cap_mb must be None or > 0, got {self.bucket_cap_mb!r}")


@dataclass(frozen=True)
class ObservedBucket:
    """One bucket as the DDP reduced it: its params (registration indices) in bucket order,
    where each starts in the bucket, and its elements."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int


@dataclass(frozen=True)
class ObservedIteration:
    """One iteration: buckets by index, whether every grad is a view into its bucket, and
    every param's grad after the backward."""

    buckets: tuple[ObservedBucket, ...]
    grads_are_bucket_views: bool
    grads: tuple[torch.Tensor, ...]


class BucketObserver(TechniqueScope):
    """Trains a module in the candidate's DDP and reports its buckets every iteration."""

    def train(self, module: torch.nn.Module, settings: BucketTraining,
              batches: Sequence[object], group: dist.ProcessGroup | None) -> list[ObservedIteration]:
        """``module(batch).backward()`` for each batch in the DDP over ``group``."""
        raise NotImplementedError


@dataclass(frozen=True)
class ParameterShard:
    """One rank's shard of one parameter: rows ``[start, stop)`` of dim 0, the rows its
    storage holds with padding, and its rows' values."""

    start: int
    stop: int
    padded_rows: int
    values: torch.Tensor


class ParameterSharding(TechniqueScope):
    """Shards parameters one by one (FSDP2's ``fully_shard``)."""

    def shard(self, params: Sequence[torch.nn.Parameter],
              group: dist.ProcessGroup | None) -> list[ParameterShard]:
        """This rank's shard of each param (registration order) over ``group``."""
        raise NotImplementedError


@runtime_checkable
class BucketLayout(TechniqueScope, Protocol):
    """The candidate's bucket layout and padded grad buffer; a watched DDP (torch's) and
    parameters sharded one by one (FSDP2's) only where a candidate has them."""

    def bucket_observer(self) -> BucketObserver:
        raise Unsupported(Technique.LAYOUT, "is not torch's DDP (no Reducer whose buckets a hook can watch)")

    def parameter_sharding(self) -> ParameterSharding:
        raise Unsupported(Technique.LAYOUT, "does not shard parameters one by one")

    def layouts(self, cases: Sequence[LayoutCase]) -> list[Layout]:
        """The layout of each case, in one call (a candidate may need a process to lay out)."""

    def build_buffer(self, params: Sequence[torch.nn.Parameter], config: DDPConfig, *,
                     dp_size: int, dp_group: dist.ProcessGroup | None = None,
                     averaging: Averaging = Averaging.SUM) -> GradBuffer:
        """``params`` (registration order; ``shared_embedding=True`` marks one) remapped into
        the candidate's buffers, values kept. Without ``dp_group``: laid out for ``dp_size``
        ranks, inspection only. ``averaging``: how the reduction combines the replicas, held
        to ``config`` by ``DDPConfig.resolve_averaging`` (a bool: TypeError; ``AVG`` exactly
        with ``average_in_collective``)."""


# --- reduce_scatter: the data-parallel gradient reduction, as typed collectives --------------------

SUM = Averaging.SUM.reduce_op
AVG = Averaging.AVG.reduce_op


class Completion(Protocol):
    """What an asynchronous collective returns: ``wait()`` finishes it."""

    def wait(self) -> object: ...


class ReduceScatter(ABC):
    """``output`` (this rank's shard) = shard ``rank`` of the reduction over ``group`` of
    ``input`` (``W`` equal shards), accumulated in fp32 and rounded once; ``output`` may be a
    view of ``input``. ``async_op``: returns the handle whose ``wait()`` writes ``output``."""

    @abstractmethod
    def __call__(self, output: torch.Tensor, input: torch.Tensor, *,  # noqa: A002 - torch's name
                 group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType,
                 async_op: bool = False) -> Completion | None: ...


class ScratchReduceScatter(ABC):
    """:class:`ReduceScatter` whose all-to-all lands in the caller's ``scratch`` (the input's
    dtype, device and size, overlapping neither ``input`` nor ``output``)."""

    @abstractmethod
    def __call__(self, output: torch.Tensor, input: torch.Tensor, scratch: torch.Tensor, *,  # noqa: A002
                 group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType,
                 async_op: bool = False) -> Completion | None: ...


class LocalReduction(ABC):
    """The reduce-scatter's local step: ``output`` = the ``W`` rows of ``shards`` (``[W, n]``,
    16-bit) summed in fp32 (AVG: divided by ``W``), rounded once to ``output``'s dtype."""

    @abstractmethod
    def __call__(self, shards: torch.Tensor, output: torch.Tensor, *,
                 op: dist.ReduceOp.RedOpType) -> None: ...


@dataclass(frozen=True)
class ReductionConfig:
    """How a DDP bucket is reduced (``DistributedDataParallelConfig``'s names, its averaging as
    one :class:`gradvocab.Averaging`). ``averaging``: ``PRESCALE`` (a ``1/W`` pre-scale in the
    grad dtype, then a SUM; Megatron-Core's default), ``AVG`` (``average_in_collective``) or
    ``SUM`` (its per-token loss); ``POSTSCALE`` has no Megatron-Core spelling and is refused.
    ``use_distributed_optimizer``: a reduce-scatter, else an all-reduce.
    ``overlap_grad_reduce``: launched asynchronously, waited for in ``finish_grad_sync``."""

    averaging: Averaging = Averaging.PRESCALE
    use_distributed_optimizer: bool = True
    reduce_scatter_with_fp32_accumulation: bool = False
    overlap_grad_reduce: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.averaging, Averaging):
            raise TypeError(f"ReductionConfig.averaging must be a gradvocab.Averaging, got "
                            f"{type(self.averaging).__name__} {self.averaging!r} (a bool does not "
                            "say how the replicas are combined)")
        self.megatron_flags()  # ValueError for POSTSCALE: these are Megatron-Core's settings
        _require_bools(self, ("use_distributed_optimizer", "reduce_scatter_with_fp32_accumulation",
                              "overlap_grad_reduce"))
        if self.reduce_scatter_with_fp32_accumulation and not self.use_distributed_optimizer:
            raise ValueError("ReductionConfig.reduce_scatter_with_fp32_accumulation is a "
                             "reduce-scatter: it needs use_distributed_optimizer=True")

    def megatron_flags(self) -> MegatronAveragingFlags:
        """``averaging`` as Megatron-Core's two flags (``Averaging.megatron_flags``)."""
        return self.averaging.megatron_flags()


class BucketReduction(ABC):
    """One DDP bucket reduced as the candidate's DDP reduces it under its
    :class:`ReductionConfig` (its own buffer and bucket, its own grad sync). A bucket's size
    is a multiple of ``128 * W``; objects may cache what they built (one per ``with``)."""

    @abstractmethod
    def __call__(self, grads: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
        """This rank's bucket ``grads`` (1-D, grad dtype) in; what this rank holds reduced
        out: its shard under the distributed optimizer, else the whole bucket."""


@dataclass(frozen=True)
class ShardedGradCase:
    """Parameters of ``shapes`` sharded one by one (FSDP2), ``microbatches`` a step with the
    grad sync on the last one. Torch's ``MixedPrecisionPolicy`` names: ``orig_dtype`` the
    sharded params', ``param_dtype`` the unsharded params' and grads', ``reduce_dtype`` the
    reduction's (None: the grads')."""

    shapes: tuple[tuple[int, ...], ...]
    orig_dtype: str
    param_dtype: str
    reduce_dtype: str | None
    microbatches: int = 2

    def __post_init__(self) -> None:
        for name in ("orig_dtype", "param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if (value is not None or name != "reduce_dtype") and value not in _DTYPE_NAMES:
                raise ValueError(f"ShardedGradCase.{name} must be one of {_DTYPE_NAMES}, got {value!r}")
        if not self.shapes or any(not shape or min(shape) < 1 for shape in self.shapes):
            raise ValueError(f"ShardedGradCase.shapes must be non-empty shapes of positive sizes, "
                             f"got {self.shapes!r}")
        _require_int(self, "microbatches", 1)



class ShardedReduction(ABC):
    """One step of a :class:`ShardedGradCase` on this rank (a call is one training step)."""

    @abstractmethod
    def __call__(self, microbatch_grads: Sequence[Sequence[torch.Tensor]], *,
                 group: dist.ProcessGroup | None) -> list[torch.Tensor]:
        """Every microbatch's grads (whole, ``param_dtype``) in; this rank's reduced rows of
        every param out (unpadded, ``orig_dtype``)."""


@runtime_checkable
class GradReduction(TechniqueScope, Protocol):
    """The candidate's DP gradient reduction; a collective whose ``op`` or form the candidate
    lacks raises :class:`Unsupported` (Megatron-Core's reduce-scatter takes SUM only)."""

    def reduce_scatter(self, op: dist.ReduceOp.RedOpType = SUM) -> ReduceScatter:
        """The fp32-accumulating reduce-scatter the candidate's buckets run."""

    def scratch_reduce_scatter(self, op: dist.ReduceOp.RedOpType = SUM) -> ScratchReduceScatter: ...
    def local_reduction(self, op: dist.ReduceOp.RedOpType = SUM) -> LocalReduction: ...

    def bucket_reduction(self, config: ReductionConfig) -> BucketReduction:
        """A bucket's reduction under ``config`` (Unsupported only for a configuration the
        candidate refuses up front)."""

    def reduce_in(self, config: ReductionConfig, dtype: torch.dtype) -> BucketReduction:
        """A bucket's reduction run in ``dtype`` (torch DDP's compress hooks, FSDP2's
        ``reduce_dtype``), the result in the grads' dtype."""
        del config
        raise Unsupported(Technique.GRAD_REDUCTION, f"does not reduce grads in another dtype ({dtype})")

    def sharded_reduction(self, case: ShardedGradCase) -> ShardedReduction:
        """Parameters sharded one by one, their grads reduced (FSDP2's)."""
        del case
        raise Unsupported(Technique.GRAD_REDUCTION, "does not shard parameters one by one")


# --- deferred_wgrad: the output layer with deferred embedding wgrad and its drain ------------------

ReduceInFlight = Callable[[torch.nn.Parameter], bool]
"""True when the DP grad bucket holding the parameter has its reduction in flight."""


class DrainRefused(RuntimeError):
    """The drain refused to write ``main_grad``: the weight's bucket has its reduction in
    flight, or the deferred inputs and grad_outputs do not pair up."""


@dataclass(frozen=True)
class OutputLayerConfig:
    """The output layer's settings (``TransformerConfig``'s names) and grid.
    ``wgrad_deferral_limit``: defer only the first N microbatches (0: all). ``dims``: its TP
    and PP sizes and SP; at TP > 1 carrying its TP group (``dims.with_groups(tp_group=...)``).
    Deferral needs PP > 1: the drain runs in the pipeline flush."""

    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    dims: ParallelDims = ParallelDims()

    def __post_init__(self) -> None:
        _require_bools(self, ("defer_embedding_wgrad_compute",))
        value = self.wgrad_deferral_limit
        if isinstance(value, bool):
            raise TypeError("OutputLayerConfig.wgrad_deferral_limit must be an int, got bool")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"OutputLayerConfig.wgrad_deferral_limit must be an int, "
                            f"got {type(value).__name__}") from None
        if value < 0:
            raise ValueError(f"OutputLayerConfig.wgrad_deferral_limit must be >= 0, got {value}")
        _require_type(self, "dims", ParallelDims)
        if self.defer_embedding_wgrad_compute and self.dims.pp_size == 1:
            raise ValueError("OutputLayerConfig.defer_embedding_wgrad_compute needs "
                             "dims.pp_size > 1 (the drain runs in the pipeline flush)")
        if self.dims.tp_size > 1 and (self.dims.place is None or self.dims.place.tp_group is None):
            raise ValueError("OutputLayerConfig.dims with tp_size > 1 must carry the layer's TP "
                             "group: dims.with_groups(tp_group=...)")

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The layer's TP group (None at TP 1)."""
        return None if self.dims.tp_size == 1 else self.dims.tp_group


@runtime_checkable
class OutputLayer(Protocol):
    """The last stage's column-parallel output layer (``logits = input · Wᵀ``): ``weight``
    this rank's ``[V / tp, H]`` shard, ``main_grad`` its accumulator; the backward of a call
    runs the dgrad (and its TP collective) and the wgrad, at once or deferred."""

    @property
    def weight(self) -> torch.nn.Parameter: ...
    @property
    def main_grad(self) -> torch.Tensor: ...

    def __call__(self, local_input: torch.Tensor) -> torch.Tensor:
        """Logits ``[S, B, V / tp]`` of an input ``[S (/ tp under SP), B, H]``."""

    def start_step(self) -> None:
        """What the schedule does at the start of a step: clear the deferral buffers."""

    def drain(self, reduce_in_flight: ReduceInFlight | None = None) -> int:
        """Run every deferred wgrad GEMM into ``main_grad``; return how many ran. With
        ``reduce_in_flight``: :class:`DrainRefused` (writing nothing) while it says True."""

    @property
    def num_deferred(self) -> int:
        """Deferred (input, grad_output) pairs waiting for the drain."""


class WgradGemm(ABC):
    """One variant of ``main_grad += grad_outputᵀ · total_input`` (fp32 accumulation), named."""

    name: str

    @abstractmethod
    def __call__(self, main_grad: torch.Tensor, grad_output: torch.Tensor,
                 total_input: torch.Tensor) -> None:
        """In place: ``grad_output`` ``[..., V]``, ``total_input`` ``[..., H]``, ``main_grad``
        ``[V, H]``."""


@runtime_checkable
class DeferredWgrad(TechniqueScope, Protocol):
    """The candidate's output layer with deferred wgrad, tied-embedding sum and wgrad GEMMs."""

    def output_layer(self, weight: torch.Tensor, config: OutputLayerConfig, *,
                     main_grad_dtype: torch.dtype = torch.float32) -> OutputLayer:
        """A layer holding a copy of ``weight`` (this rank's shard) and a zero ``main_grad``."""

    def allreduce_tied_embedding_grad(self, main_grad: torch.Tensor,
                                      embedding_group: dist.ProcessGroup) -> None:
        """Sum the tied embedding's ``main_grad`` over the first and last stage, in place."""

    def wgrad_gemms(self, device: str) -> tuple[WgradGemm, ...]:
        """The variants the candidate has on ``device`` ("cpu" or "cuda")."""


# --- mxfp8: quantization and the MXFP8 param all-gather through the grad buffer --------------------

MXFP8_BLOCK = 32  # elements per MXFP8 block along the last dimension (OCP MX v1.0)


class MXFP8Kernel(ABC):
    """One quantization kernel, named for the report."""

    name: str

    @abstractmethod
    def __call__(self, x: torch.Tensor, *, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`MXFP8.quantize`, on the kernel's device."""


@dataclass(frozen=True)
class ParamGatherRun:
    """A small MXFP8 MLP trained with the candidate's distributed optimizer (AdamW) on a DP
    group, its params all-gathered after every step. ``shapes``: weights ``[out, in]``, first
    layer first, ``in`` a multiple of 32; ``reuse_grad_buf_for_mxfp8_param_ag``: gather
    through the grad buffer (Megatron-Core's flag); ``seed``: the initial weights and, with
    the rank, the data (the same whatever the sharing flag)."""

    shapes: tuple[tuple[int, int], ...]
    bucket_size: int
    reuse_grad_buf_for_mxfp8_param_ag: bool
    grad_reduce_in_fp32: bool
    iterations: int
    seed: int = 0
    scale_mode: str = "floor"

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("ParamGatherRun.shapes must name at least one weight")
        for k, (rows, cols) in enumerate(self.shapes):
            if rows < 1 or cols < 1 or cols % MXFP8_BLOCK:
                raise ValueError(f"ParamGatherRun.shapes[{k}] = {(rows, cols)}: sizes must be >= 1 "
                                 f"and the columns a multiple of {MXFP8_BLOCK}")
            if k and cols != self.shapes[k - 1][0]:
                raise ValueError(f"ParamGatherRun.shapes[{k}] takes {cols} inputs but layer {k - 1} "
                                 f"has {self.shapes[k - 1][0]} outputs")
        _require_bools(self, ("reuse_grad_buf_for_mxfp8_param_ag", "grad_reduce_in_fp32"))
        for name, minimum in (("bucket_size", 1), ("iterations", 1), ("seed", 0)):
            _require_int(self, name, minimum)
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {self.scale_mode!r}")


@dataclass(frozen=True)
class ParamGatherStep:
    """One rank around one step: each weight's MXFP8 codes the forward used, the whole grad
    buffer after the reduce-scatter, this rank's fp32 master shards before and after."""

    scale_bits: tuple[torch.Tensor, ...]
    element_bits: tuple[torch.Tensor, ...]
    grads: torch.Tensor
    masters_before: tuple[torch.Tensor, ...]
    masters_after: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class ParamGatherResult:
    """One rank's run: its steps, the buffer's padded ``numel``, the bytes of its param and
    grad allocations, whether they were shared, this rank's shard of each bucket and each
    weight's ``(start, end)`` in the buffer."""

    steps: tuple[ParamGatherStep, ...]
    numel: int
    allocated_bytes: int
    sharing: bool
    shard_ranges: tuple[tuple[int, int], ...]
    param_ranges: tuple[tuple[int, int], ...]


@runtime_checkable
class MXFP8(TechniqueScope, Protocol):
    """The candidate's MXFP8 quantization (held to ``refgrad.mxfp8`` bit for bit) and its
    MXFP8 param all-gather."""

    def quantize(self, x: torch.Tensor, *, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale_bits, element_bits)``: uint8 on ``x``'s device, ``[..., n / 32]`` E8M0 and
        ``[..., n]`` E4M3."""

    def dequantize(self, scale_bits: torch.Tensor, element_bits: torch.Tensor, *,
                   dtype: torch.dtype) -> torch.Tensor: ...

    def gpu_kernel(self) -> MXFP8Kernel:
        """Its CUDA kernel; Unsupported when it has none or it cannot run here."""

    def train_with_param_gather(self, run: ParamGatherRun, rank: int,
                                dp_group: dist.ProcessGroup) -> ParamGatherResult:
        """Run ``run`` as DP rank ``rank`` of ``dp_group`` (on every rank of it)."""


# --- optim: the distributed optimizer step over the candidate's own DDP model ----------------------

@dataclass(frozen=True)
class AdamWState:
    """One parameter's fp32 master and AdamW moments, whole (every DP rank's shard)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


@runtime_checkable
class DataParallelModel(Protocol):
    """The model chunks a candidate's own DDP wraps, on this rank of ``grid``; a candidate's
    optimizer accepts only its own candidate's model."""

    @property
    def grid(self) -> ParallelDims: ...

    def named_parameters(self) -> Mapping[str, torch.nn.Parameter]:
        """By name as the forward uses them (a weight shared by two layers under both)."""


@runtime_checkable
class TrainingOptimizer(Protocol):
    """One rank's optimizer (AdamW or SGD, global-norm clip, loss scaler): the distributed
    one over a DDP that shards grads, else the replicated one."""

    @property
    def loss_scale(self) -> float | None:
        """The next step's loss scale (None: no loss scaling)."""

    @property
    def param_gather_in_flight(self) -> bool: ...

    def step(self) -> StepOutcome:
        """Unscale, norm, clip, step the masters, publish the params, update the loss scale."""

    def state(self) -> dict[str, AdamWState]:
        """Every param's master and moments by name, whole (collective over DP)."""

    def finish_param_sync(self) -> None:
        """Wait for the last step's param all-gather."""

    def close(self) -> None:
        """Remove what the optimizer hooked into the model."""


@dataclass(frozen=True)


@runtime_checkable
class DataParallelModule(DataParallelModel, Protocol):
    """A module wrapped in the candidate's DDP (:meth:`DistributedOptimizerStep.data_parallel`);
    the caller runs ``module(...)`` and the backward, the DDP's hooks do the rest."""

    @property
    def module(self) -> torch.nn.Module: ...
    def zero_grad_buffer(self) -> None: ...
    def finish_grad_sync(self) -> None: ...


@dataclass(frozen=True)
class LossScalerState:
    """A dynamic loss scaler's state after a step (Megatron-Core's ``DynamicGradScaler``)."""

    scale: float
    growth_tracker: int
    hysteresis_tracker: int

    def as_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}


@dataclass(frozen=True)
class OptimizerCheckpoint:
    """A whole optimizer checkpoint, reshardable across DP sizes: ``params`` by name (fp32
    ``master`` and state, whole), ``native`` the candidate's own picklable form of it."""

    params: Mapping[str, Mapping[str, torch.Tensor]]
    native: object


@runtime_checkable
class ShardedOptimizer(TrainingOptimizer, Protocol):
    """The optimizer over a :class:`DataParallelModule`, with what the ``optim`` check reads.
    ``named_state``, ``checkpoint`` and ``load_checkpoint`` are collective over DP."""

    def loss_scaler_state(self) -> LossScalerState | None: ...

    def publish_params(self) -> None:
        """Launch the masters' param all-gather without a step (a skipped rank pairs the others')."""

    def gather_in_flight(self, params: Iterable[torch.nn.Parameter]) -> bool: ...

    def named_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every param's fp32 ``master`` and state (``exp_avg``/``exp_avg_sq`` or
        ``momentum_buffer``) by name, whole."""

    def checkpoint(self) -> OptimizerCheckpoint: ...

    def load_checkpoint(self, checkpoint: OptimizerCheckpoint) -> None:
        """Resume from ``checkpoint``, taken at any DP size."""


@runtime_checkable
class MXFP8Training(Protocol):
    """MXFP8 params in a buffer with their fp32 master shards under the distributed optimizer,
    on one rank; the caller feeds grads (MXFP8 params are not autograd leaves). Ranges are
    ``(start, end)`` in the flat buffer."""

    @property
    def sharing(self) -> bool:
        """Whether the param all-gather and the grad buffer share bytes."""

    @property
    def param_ranges(self) -> list[tuple[int, int]]: ...
    @property
    def buckets(self) -> list[tuple[int, int]]: ...

    def initial(self) -> list[torch.Tensor]:
        """The params as built, dequantized to fp32."""

    def bits(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each param's scale and element bits (uint8), as the forward reads them."""

    def zero_grad(self) -> None: ...
    def accumulate_grad(self, index: int, grad: torch.Tensor) -> None: ...
    def reduce_grads(self) -> None: ...
    def local_grad_shards(self) -> list[torch.Tensor]: ...

    def step(self) -> bool:
        """One step (stage, all-gather and quantize the masters); whether it stepped."""

    def master_shards(self) -> list[torch.Tensor]: ...

    def named_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each param's state by ``params[<index>]``, whole."""


@runtime_checkable
class MXFP8ParamOptimizer(Protocol):
    """Builds :class:`MXFP8Training` runs."""

    def build(self, values: Sequence[torch.Tensor], settings: OptimizerSettings, *,
              sharing: bool, grad_fp32: bool, bucket_size: int,
              dp_group: dist.ProcessGroup | None) -> MXFP8Training:
        """MXFP8 params quantized from ``values`` in a buffer over ``dp_group`` and the
        optimizer of ``settings`` (decay on every param), its first publication done."""


@runtime_checkable
class DistributedOptimizerStep(TechniqueScope, Protocol):
    """The candidate's optimizer over its data-parallel model. ``shares_a_world``: False when
    building it runs collectives over the whole default group (Megatron-Core's), so every DP
    group a check builds one on needs a world of its own."""

    shares_a_world: bool

    def build(self, model: DataParallelModel, settings: OptimizerSettings) -> TrainingOptimizer:
        """This rank's optimizer over ``model`` (over a :class:`DataParallelModule`: a
        :class:`ShardedOptimizer`)."""

    def data_parallel(self, module: torch.nn.Module, config: DDPConfig,
                      dp_group: dist.ProcessGroup | None, *,
                      averaging: Averaging | None = None) -> DataParallelModule:
        """``module`` wrapped in the candidate's DDP under ``config`` over ``dp_group`` (None:
        the world), its grads combined by ``config.resolve_averaging(averaging)`` (None: what
        ``average_in_collective`` says; a bool: TypeError)."""

    def mxfp8(self) -> MXFP8ParamOptimizer: ...


# --- pipeline: DDP grad sync under the 1F1B schedules, plain and interleaved -----------------------

@dataclass(frozen=True)
class PipelineCase:
    """Refgrad's model ``spec`` on a grid, trained for ``plans`` (one per optimizer step) with
    SGD; the candidate trains it and the check holds each rank's :class:`RankResult` to
    ``refgrad.pipeline.reference_training``.

    ``dims``: sizes only (pickled into the ranks), ``pp_size * vpp_size`` stages.
    ``reduction``: ``Averaging.SUM``, ``.AVG`` or ``.PRESCALE``. ``bucket_size`` buckets the
    first stage's first chunk, ``bucket_size_elsewhere`` every other (None: the same).
    ``timing``: its timelines are compared with the simulator.
    """

    name: str
    dims: ParallelDims
    spec: LinearStackSpec
    plans: tuple[StepPlan, ...]
    use_distributed_optimizer: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    reduction: Averaging = Averaging.SUM
    bucket_size: int = 80
    lr: float = 0.05
    timing: bool = False
    bucket_size_elsewhere: int | None = None

    def __post_init__(self) -> None:
        _require_type(self, "dims", ParallelDims)
        if self.dims.built:
            raise ValueError("PipelineCase.dims must be sizes only (the case is pickled into "
                             "the ranks; each builds its own groups)")
        if self.dims.cp_size != 1:
            raise ValueError("PipelineCase.dims.cp_size must be 1: the pipeline model has no "
                             "context-parallel split")
        _require_type(self, "spec", LinearStackSpec)
        if (self.dims.tp_size, self.dims.sequence_parallel) != (self.spec.tensor_parallel,
                                                                self.spec.sequence_parallel):
            raise ValueError(
                f"PipelineCase.dims (tp_size={self.dims.tp_size}, sequence_parallel="
                f"{self.dims.sequence_parallel}) must split the model as its spec does "
                f"(tensor_parallel={self.spec.tensor_parallel}, sequence_parallel="
                f"{self.spec.sequence_parallel})")
        _require_int(self, "bucket_size", 1)
        _require_int(self, "bucket_size_elsewhere", 1, optional=True)
        if self.spec.num_stages != self.dims.num_virtual_stages:
            raise ValueError(f"PipelineCase.spec.num_stages ({self.spec.num_stages}) must equal "
                             f"pp_size * virtual_stages ({self.dims.num_virtual_stages})")
        if not self.plans or not all(isinstance(p, StepPlan) for p in self.plans):
            raise ValueError("PipelineCase.plans must be a non-empty tuple of StepPlan")
        if self.virtual_stages > 1:
            if self.timing:
                raise ValueError("PipelineCase.virtual_stages > 1 needs pp_size >= 2 and no timing "
                                 "(the interleaved schedule has no simulator comparison)")
            bad = [p.num_microbatches for p in self.plans if p.num_microbatches % self.pp_size]
            if bad:
                raise ValueError(f"PipelineCase.plans: num_microbatches {bad} must be multiples "
                                 f"of pp_size ({self.pp_size}) when virtual_stages > 1")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) \
                or not math.isfinite(self.lr) or self.lr <= 0:
            raise ValueError(f"PipelineCase.lr must be a finite number > 0, got {self.lr!r}")
        if not isinstance(self.reduction, Averaging) or self.reduction not in REDUCTIONS:
            raise ValueError("PipelineCase.reduction must be Averaging.SUM, .AVG or .PRESCALE "
                             f"(refgrad.pipeline.REDUCTIONS), got {self.reduction!r}")

    def at(self, first_rank: int) -> PipelineCase:
        """The same case on the ranks from ``first_rank`` (grids side by side in one world)."""
        return replace(self, dims=replace(self.dims, first_rank=first_rank))

    def bucket_size_for(self, stage: int, chunk: int) -> int:
        """The DDP bucket size of model chunk ``chunk`` on pipeline stage ``stage``."""
        if (stage, chunk) == (0, 0) or self.bucket_size_elsewhere is None:
            return self.bucket_size
        return self.bucket_size_elsewhere

    # Read-only views of ``dims`` under the names the report and the preflight twin use.
    @property
    def pp_size(self) -> int:
        return self.dims.pp_size

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def tp_size(self) -> int:
        return self.dims.tp_size

    @property
    def first_rank(self) -> int:
        return self.dims.first_rank

    @property
    def virtual_stages(self) -> int:
        return self.dims.vpp_size

    @property
    def world(self) -> int:
        """Ranks the grid occupies."""
        return self.dims.world_size


class StepProgress(Protocol):
    """Where a rank is, for a harness that reports a stalled rank."""

    def timeline_listener(self, prefix: str = "") -> Callable[[str, int, str], None]:
        """Called with ``(kind, microbatch, "start" | "end")`` around each schedule event."""


@dataclass(frozen=True)
class MXFP8Params:
    """Every weight an MXFP8 param (floor scales), the fp32 masters staged as bf16 for the
    param all-gather; ``reuse_grad_buffer``: through the grad buffer's bytes."""

    reuse_grad_buffer: bool = False

    def __post_init__(self) -> None:
        _require_bools(self, ("reuse_grad_buffer",))


_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class StageSettings:
    """How :meth:`PipelineTraining.model` builds a case's stages: ``param_dtype`` the params'
    and compute's (16-bit as production's ``Float16Module``: the loss in fp32),
    ``grad_dtype`` the main-grad buffer's and the DP wire's, the DDP's overlaps, ``mxfp8``
    params (fp32 compute on their dequantized values)."""

    param_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    mxfp8: MXFP8Params | None = None

    def __post_init__(self) -> None:
        if self.param_dtype not in _PARAM_DTYPES:
            raise ValueError(f"StageSettings.param_dtype must be one of {_PARAM_DTYPES}, "
                             f"got {self.param_dtype!r}")
        if self.grad_dtype not in (torch.float32, self.param_dtype):
            raise ValueError(f"StageSettings.grad_dtype must be fp32 or the param dtype, "
                             f"got {self.grad_dtype!r}")
        _require_bools(self, ("overlap_grad_reduce", "overlap_param_gather"))
        if self.mxfp8 is not None and (self.param_dtype, self.grad_dtype) != (torch.float32,) * 2:
            raise ValueError("StageSettings.mxfp8 computes in fp32 with fp32 grads: param_dtype "
                             "and grad_dtype must be torch.float32")


@dataclass(frozen=True)
class ModelSupport:
    """What :meth:`PipelineTraining.model` cannot build here, each with the reason (None: it can)."""

    tensor_parallel: str | None = None  # TP > 1: the vocab-parallel output layer, SP
    mxfp8_params: str | None = None  # StageSettings.mxfp8
    shared_weight_at_pp1: str | None = None  # one weight for the first and the output layer
    replicated_optimizer: str | None = None  # DDP without the distributed optimizer


class PipelineModel(DataParallelModel, Protocol):
    """One rank's chunks of a :class:`PipelineCase` in the candidate's DDP, trained step by
    step by its schedule under the same candidate's optimizer; names are refgrad's."""

    def train_step(self, step: int, *, loss_scale: float = 1.0) -> list[float]:
        """Zero the grad buffers, run ``plans[step]`` (data: :func:`rank_microbatches`) with
        the loss times ``loss_scale``; grads reduced on return. The step's TP-summed losses,
        unscaled (the last stage; else empty)."""

    def reduced_grads(self) -> dict[str, torch.Tensor]:
        """Every param's reduced ``main_grad``, whole (other DP ranks' shards gathered)."""

    def launch_sites(self) -> tuple[str, ...]:
        """Where each bucket's reduction was launched (``gradvocab.LAUNCH_SITES``; empty: no
        notion of it)."""

    def mxfp8_bits(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]: ...
    @property
    def mxfp8_grad_buffer_shared(self) -> bool: ...
    def close(self) -> None: ...


@runtime_checkable
class PipelineTraining(TechniqueScope, Protocol):
    """A candidate's DDP grad sync under the 1F1B schedules, in the rank processes.

    Inside the interface's ``with``, :meth:`grid` is entered once per case (the per-grid
    process groups set up, then torn down). :class:`Unsupported` for a case must be raised on
    every rank (decided from the case, never a rank's coordinates) before any collective.
    """

    def grid(self, dims: ParallelDims) -> AbstractContextManager[ParallelDims | None]:
        """This rank's place in ``dims``' grid with its groups (None outside it). Collective
        over the world: every rank enters it for every case of a phase, in order, before any
        case trains (grids may share the world: ``dims.first_rank``)."""

    def train(self, case: PipelineCase, grid: ParallelDims, *, overlap: bool,
              progress: StepProgress | None = None) -> RankResult:
        """Train ``case`` on this rank with ``overlap_grad_reduce`` as given."""

    def model(self, case: PipelineCase, grid: ParallelDims, settings: StageSettings) -> PipelineModel:
        """This rank's stages of ``case`` built as ``settings`` says, for the preflight twin;
        :class:`Unsupported` (on every rank) for what :meth:`model_support` names."""
        raise Unsupported(Technique.PIPELINE, "builds no pipeline model for an optimizer")

    def model_support(self) -> ModelSupport:
        """What :meth:`model` cannot build here (asked before any rank starts)."""
        reason = "builds no pipeline model for an optimizer"
        return ModelSupport(tensor_parallel=reason, mxfp8_params=reason,
                            shared_weight_at_pp1=reason, replicated_optimizer=reason)


__all__ = [
    "AVG", "EMBEDDING_PARAM", "HEAD_PARAM", "MXFP8", "MXFP8_BLOCK", "SUM", "AdamWState",
    "Behaviour", "BucketLayout", "BucketObserver", "BucketReduction", "BucketTraining",
    "Candidate", "CandidateInfo", "Completion", "CrashSignature", "DataParallelModel",
    "DataParallelModule", "DeferredWgrad", "DistributedOptimizerStep",
    "DocumentedBehaviour", "DrainRefused", "Effect", "Finding", "GradBucket", "GradBuffer",
    "GradBufferGroup", "GradPiece", "GradReduction", "LaunchSettings", "Layout", "LayoutCase",
    "LinearStackSpec", "LocalReduction", "LossScalerState", "MXFP8Kernel", "MXFP8ParamOptimizer",
    "MXFP8Params", "MXFP8Training", "ModelSupport", "OPTIMIZER_BEHAVIOURS", "REDUCTION_BEHAVIOURS", "ObservedBucket", "ObservedIteration",
    "OptimizerCheckpoint", "OutputLayer", "OutputLayerConfig",
    "ParamGatherResult", "ParamGatherRun", "ParamGatherStep", "ParameterShard",
    "ParameterSharding", "PipelineCase", "PipelineModel", "PipelineTraining", "ReduceInFlight",
    "ReduceScatter", "ReductionConfig", "ScratchReduceScatter",
    "ShardedGradCase", "ShardedOptimizer", "ShardedReduction", "StageModule", "StageSettings",
    "StepProgress", "Technique", "TechniqueScope", "TrainingOptimizer", "Unsupported",
    "WgradGemm", "cast_params_", "head_shard", "head_weight_init", "rank_microbatches",
    "sgd_update", "splits_loss", "stage_loss", "stage_param_name", "updated_once",
]


# ---------------------------------------------------------------------------------------
# Optimizer settings the optim check and the preflight twin hand a candidate (the
# hyperparameters and the loss scaling inside them are gradvocab's).
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW, the global-norm clip (``max_grad_norm``; None: none) and the loss scaler (None:
    unscaled). The norm is taken over the data-parallel and model-parallel (pipeline and
    tensor) groups, a tied embedding's second copy (``param.shared``) once.

    ``sgd``: set, the step is SGD with momentum instead (``adamw`` is then not used).
    ``decay_1d_params``: False puts no weight decay on params of one dimension (biases, norm
    weights), Megatron-Core's default grouping; True decays every param.
    ``schedule``: set, each update's learning rate and weight decay are the schedule's
    (:class:`HyperparameterSchedule`, in place of
    ``lr`` and ``weight_decay`` of ``adamw`` / ``sgd``); None: those, at every update.
    """

    adamw: AdamWConfig = AdamWConfig(lr=1e-2)
    max_grad_norm: float | None = None
    loss_scaling: LossScaling | None = None
    sgd: SGDConfig | None = None
    decay_1d_params: bool = True
    schedule: HyperparameterSchedule | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.adamw, AdamWConfig):
            raise TypeError("OptimizerSettings.adamw must be an AdamWConfig")
        if self.sgd is not None and not isinstance(self.sgd, SGDConfig):
            raise TypeError("OptimizerSettings.sgd must be an SGDConfig or None")
        if not isinstance(self.decay_1d_params, bool):
            raise TypeError("OptimizerSettings.decay_1d_params must be a bool")
        if self.max_grad_norm is not None and (
                isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm, (int, float))
                or not math.isfinite(self.max_grad_norm) or self.max_grad_norm <= 0):
            raise ValueError(f"OptimizerSettings.max_grad_norm must be None or a finite number > 0, "
                             f"got {self.max_grad_norm!r}")
        if self.loss_scaling is not None and not isinstance(self.loss_scaling, LossScaling):
            raise TypeError("OptimizerSettings.loss_scaling must be a LossScaling or None")
        if self.schedule is not None and not isinstance(self.schedule, HyperparameterSchedule):
            raise TypeError("OptimizerSettings.schedule must be a HyperparameterSchedule or None "
                            f"(per-update values, not a callable), got {type(self.schedule).__name__}")

    def lr_and_weight_decay(self, update: int) -> tuple[float, float]:
        """``(lr, weight_decay)`` of update ``update`` (0: the first; skipped steps do not
        count) for a param that takes weight decay: the schedule's, or the constant ones."""
        if self.schedule is not None:
            return self.schedule.lr(update), self.schedule.weight_decay(update)
        hyper = self.sgd if self.sgd is not None else self.adamw
        return hyper.lr, hyper.weight_decay


LR_DECAY_STYLES = ("constant", "linear", "cosine")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def _finite(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class HyperparameterSchedule:
    """Per-update learning rate and weight decay: Megatron-LM's ``OptimizerParamScheduler``
    (``megatron/core/optimizer_param_scheduler.py``) as data, its fields Megatron-LM's flags
    (:meth:`megatron_flags`). A linear warm-up from ``init_lr`` to ``max_lr`` over
    ``warmup_steps`` updates, then a decay (``cosine``, ``linear`` or ``constant``) to
    ``min_lr`` at ``decay_steps``; the weight decay from ``start_wd`` to ``end_wd`` over
    ``wd_incr_steps``. :meth:`lr` and :meth:`weight_decay` give update ``k``'s values (``k``
    = the updates before it: a step skipped on NaN/inf grads keeps its values) in
    ``get_lr``/``get_wd``'s fp64 operations. A param that takes no weight decay gets 0.
    Validated as that scheduler's ``__init__`` asserts:
    ``0 <= min_lr <= max_lr``, ``0 <= init_lr <= max_lr``, ``0 <= warmup_steps <
    decay_steps``, ``0 <= start_wd <= end_wd`` (equal for a constant increment)."""

    max_lr: float
    min_lr: float
    decay_steps: int
    start_wd: float
    end_wd: float
    wd_incr_steps: int
    init_lr: float = 0.0
    warmup_steps: int = 0
    decay_style: str = "cosine"
    wd_incr_style: str = "linear"

    def __post_init__(self) -> None:
        owner = "HyperparameterSchedule"
        for name in ("max_lr", "min_lr", "init_lr", "start_wd", "end_wd"):
            _finite(owner, name, getattr(self, name))
        _count(owner, "warmup_steps", self.warmup_steps, 0)
        _count(owner, "decay_steps", self.decay_steps, 1)
        _count(owner, "wd_incr_steps", self.wd_incr_steps, 1)
        if not 0 <= self.min_lr <= self.max_lr or self.max_lr <= 0:
            raise ValueError(f"{owner}: need 0 <= min_lr <= max_lr and max_lr > 0, got min_lr "
                             f"{self.min_lr}, max_lr {self.max_lr}")
        if not 0 <= self.init_lr <= self.max_lr:
            raise ValueError(f"{owner}.init_lr must be in [0, max_lr = {self.max_lr}], got {self.init_lr}")
        if self.warmup_steps >= self.decay_steps:
            raise ValueError(f"{owner}.warmup_steps ({self.warmup_steps}) must be < decay_steps "
                             f"({self.decay_steps})")
        if not 0 <= self.start_wd <= self.end_wd:
            raise ValueError(f"{owner}: need 0 <= start_wd <= end_wd, got {self.start_wd}, {self.end_wd}")
        if self.decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"{owner}.decay_style must be one of {LR_DECAY_STYLES}, got "
                             f"{self.decay_style!r}")
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"{owner}.wd_incr_style must be one of {WD_INCR_STYLES}, got "
                             f"{self.wd_incr_style!r}")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(f"{owner}: a constant weight decay needs start_wd == end_wd, got "
                             f"{self.start_wd} and {self.end_wd}")

    @classmethod
    def constant(cls, lr: float, weight_decay: float) -> HyperparameterSchedule:
        """The same ``lr`` and ``weight_decay`` at every update."""
        return cls(max_lr=lr, min_lr=lr, init_lr=lr, decay_steps=1, decay_style="constant",
                   start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=1,
                   wd_incr_style="constant")

    def lr(self, update: int) -> float:
        """The learning rate of update ``update`` (0: the first), as ``get_lr`` computes it."""
        _count("HyperparameterSchedule.lr", "update", update, 0)
        if self.warmup_steps > 0 and update <= self.warmup_steps:
            return self.init_lr + ((self.max_lr - self.init_lr) * float(update)
                                   / float(self.warmup_steps))
        if self.decay_style == "constant":
            return self.max_lr
        if update > self.decay_steps:
            return self.min_lr
        ratio = float(update - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def weight_decay(self, update: int) -> float:
        """The weight decay of update ``update``, as ``get_wd`` computes it."""
        _count("HyperparameterSchedule.weight_decay", "update", update, 0)
        if update > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(update) / float(self.wd_incr_steps)
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def values(self, updates: int) -> tuple[tuple[float, float], ...]:
        """``(lr, weight_decay)`` of updates ``0 .. updates - 1``."""
        return tuple((self.lr(k), self.weight_decay(k)) for k in range(updates))

    def megatron_flags(self) -> tuple[str, ...]:
        """The Megatron-LM flags of this schedule (``--train-iters``: the weight decay's
        increment horizon, which Megatron-LM takes from the run's length)."""
        return (f"--lr {self.max_lr:g}", f"--min-lr {self.min_lr:g}",
                f"--lr-warmup-init {self.init_lr:g}", f"--lr-warmup-iters {self.warmup_steps}",
                f"--lr-decay-iters {self.decay_steps}", f"--lr-decay-style {self.decay_style}",
                f"--start-weight-decay {self.start_wd:g}", f"--end-weight-decay {self.end_wd:g}",
                f"--weight-decay-incr-style {self.wd_incr_style}",
                f"--train-iters {self.wd_incr_steps}")

__all__ += [
    "LR_DECAY_STYLES", "WD_INCR_STYLES", "HyperparameterSchedule", "OptimizerSettings",
]

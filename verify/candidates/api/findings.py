"""What a case of a check stands for in a Megatron-LM launch, and a candidate's known findings.

A check's case (a bucket reduction, a pipeline configuration, an output layer) is described
once as :class:`LaunchSettings`: the gradient-path settings a Megatron-LM launch would give
Megatron-Core to reach it (its parallel grid, DDP and deferral settings, microbatches per
step), or, where no launch does what the case does, ``api_only`` saying what it does. The
report spells a case as the Megatron-LM flags it stands for, and ``verify preflight`` reads a
user's launch into the same type, so a finding's rule answers both "which cases showed it?"
and "does my launch reach it?".

A :class:`Finding` is one root cause a candidate is known to have (Megatron-Core's are in
``verify.candidates.megatron_core.findings``): what goes wrong (:class:`Effect`), the launch
flags that reach it or why only direct API use does, the upstream report, the standalone
reproduction and what to change to avoid it. The checks never decide that a failure is a
known finding by its label: the harness's ``verify.attribution.explaining`` matches a failing
case's settings (and a crash's exception) against each finding's rule, and whatever no
finding explains is a FAIL of its own.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from gradvocab import ParallelDims

_GRAD_DTYPES = ("float32", "bfloat16", "float16")
_PARAM_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LaunchSettings:
    """The gradient-path settings of one case, by Megatron-LM's names (their defaults when
    not given). ``dims`` holds the parallel sizes (DP included: Megatron-LM derives it from
    the world size); ``microbatches`` is M of each step (Megatron-LM derives it from the
    batch sizes); the last four fields say what the case does that no launch does
    (:attr:`api_only`)."""

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
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    untie_embeddings_and_output_weights: bool = False
    has_output_layer: bool = True
    # M of each step (one entry per optimizer step; empty: not part of the case). Megatron-LM
    # keeps M constant except during a batch-size ramp-up.
    microbatches: tuple[int, ...] = ()
    # What the case does that no Megatron-LM launch does (each a use of the API directly):
    # a DistributedDataParallel built in a process where one with the fp32-accumulating
    # reduce-scatter was built before (Megatron-LM builds every chunk's DDP from one config);
    after_fp32_accumulating_ddp: bool = False
    # a step abandoned by a caught exception between a backward and the drain (Megatron-LM
    # dies on the exception; its in-process restart rebuilds the model);
    after_abandoned_step: bool = False
    # the P2P transfers batched at PP 2 with VPP (Megatron-LM's validate_args refuses VPP at
    # PP 2 without --overlap-p2p-communication);
    batch_p2p_comm: bool = False
    # a function of the candidate called directly, outside the training loop that wires it.
    direct_call: str | None = None
    # Launch flags that no finding's rule reads but that the case stands for (the optimizer,
    # clipping, loss scaling), spelled as Megatron-LM spells them.
    other_flags: tuple[str, ...] = ()
    # A candidate without a launcher (torch's DDP and FSDP2): the torch API settings the case
    # stands for, as ``name=value`` (``DistributedDataParallel(...)``'s and ``fully_shard``'s
    # argument names, ``zero_grad(set_to_none=...)``, the calls made); its findings' rules read them, and the
    # report spells the case with them instead of Megatron-LM flags.
    torch_api: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ParallelDims):
            raise TypeError(f"LaunchSettings.dims must be a ParallelDims, got {type(self.dims).__name__}")
        if self.params_dtype not in _PARAM_DTYPES:
            raise ValueError(f"LaunchSettings.params_dtype must be one of {_PARAM_DTYPES}, "
                             f"got {self.params_dtype!r}")
        if self.grad_dtype not in _GRAD_DTYPES:
            raise ValueError(f"LaunchSettings.grad_dtype must be one of {_GRAD_DTYPES}, "
                             f"got {self.grad_dtype!r}")
        if isinstance(self.wgrad_deferral_limit, bool) or not isinstance(self.wgrad_deferral_limit, int) \
                or self.wgrad_deferral_limit < 0:
            raise ValueError(f"LaunchSettings.wgrad_deferral_limit must be an int >= 0, "
                             f"got {self.wgrad_deferral_limit!r}")
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
        or one microbatch a step (the drain then holds that one)."""
        if not (self.defer_embedding_wgrad_compute and self.has_output_layer):
            return False
        return self.wgrad_deferral_limit == 1 or 1 in self.microbatches

    def flags(self) -> str:
        """The Megatron-LM launch flags that give these settings (non-default ones only),
        with DP and M as the world and batch sizes that give them; for a torch candidate's
        case, its torch API settings and DP."""
        d = self.dims
        if self.torch_api:
            text = f"{', '.join(self.torch_api)} (DP {d.dp_size})"
            return text if self.api_only is None else f"{text}; {self.api_only}"
        parts = []
        if d.tp_size > 1:
            parts.append(f"--tensor-model-parallel-size {d.tp_size}")
            if d.sequence_parallel:
                parts.append("--sequence-parallel")
        if d.pp_size > 1:
            parts.append(f"--pipeline-model-parallel-size {d.pp_size}")
        if d.vpp_size > 1:
            parts.append(f"--num-virtual-stages-per-pipeline-rank {d.vpp_size}")
        if self.params_dtype == "bfloat16":
            parts.append("--bf16")
            if self.grad_dtype == "bfloat16":
                parts.append("--grad-reduce-in-bf16")
        elif self.params_dtype == "float16":
            parts.append("--fp16")
            if self.grad_dtype == "float32":
                parts.append("--accumulate-allreduce-grads-in-fp32")
        for name in ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                     "ddp_reduce_scatter_with_fp32_accumulation", "ddp_average_in_collective",
                     "calculate_per_token_loss", "defer_embedding_wgrad_compute"):
            if getattr(self, name):
                parts.append("--" + name.replace("_", "-"))
        if self.overlap_grad_reduce and not self.align_grad_reduce:
            parts.append("--no-align-grad-reduce")
        if self.defer_embedding_wgrad_compute:
            parts.append(f"--wgrad-deferral-limit {self.wgrad_deferral_limit}")
        if self.untie_embeddings_and_output_weights:
            parts.append("--untie-embeddings-and-output-weights")
        parts.extend(self.other_flags)
        scale = [f"DP {d.dp_size}"]
        if len(set(self.microbatches)) == 1:
            m = self.microbatches[0]
            scale.append(f"{m} microbatch{'es' if m != 1 else ''} a step")
        elif self.microbatches:
            scale.append(f"M = {', '.join(map(str, self.microbatches))} over its steps")
        text = " ".join(parts) if parts else "(Megatron-LM's defaults)"
        text = f"{text} ({', '.join(scale)})"
        if self.api_only is not None:
            text += f"; direct API use: {self.api_only}"
        return text


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
    """One known root cause in a candidate (not one failing comparison)."""

    key: str  # stable identifier, e.g. "megatron-core-4"
    number: int  # its number in the candidate's list of findings
    title: str
    effect: Effect
    # The Megatron-LM flags that reach it; None: no launch does (``api_only`` says why).
    launch: str | None
    api_only: str | None
    upstream: str  # the upstream issue(s) or pull request(s), or "none found"
    reproduction: str  # a standalone script, relative to the gradverify checkout
    avoid: str  # what to change to avoid it
    # The rule: does a case (or a launch) with these settings reach it?
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


__all__ = ["CrashSignature", "Effect", "Finding", "LaunchSettings"]

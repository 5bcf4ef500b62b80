"""Bucketed data parallelism on the padded buffers of :mod:`fastgrad.buffer`.

Mechanics (REFERENCE_NOTES section 5, production's DDP with its failure modes fixed):

- A post-accumulate-grad hook on every trainable parameter adds ``param.grad``
  into ``param.main_grad`` (a view of the bucket's contiguous buffer) and
  clears ``param.grad``. Grads written straight into ``main_grad`` outside
  autograd (fused or deferred wgrad) are announced with :meth:`mark_grad_ready`.
- ``no_sync()`` (or ``disable_grad_sync``/``enable_grad_sync``) marks the
  microbatches that are *not* the last; ready parameters are counted only while
  sync is enabled, i.e. during the last microbatch's backward.
- With ``overlap_grad_reduce`` a bucket launches its asynchronous reduction
  (``Bucket.start_grad_sync``: all-reduce, or reduce-scatter with the
  distributed optimizer, optionally fp32-accumulating; SUM, or an average via
  ``1/dp`` pre-scaling or ``ReduceOp.AVG``) the moment its last expected
  parameter is ready (the op and pre-scale: :mod:`fastgrad.averaging`, decided once).
  ``finish_grad_sync()`` waits for them all. Without
  overlap, ``finish_grad_sync()`` runs the same reductions synchronously.
  Whether a bucket's reduce was launched is the bucket's own
  ``reduce_in_flight`` (recorded in one place).
- The data-parallel group comes from one :class:`gradvocab.ParallelDims`
  (a built grid, or ``ParallelDims.data_parallel(dp_group)``) handed to the buffer and
  its buckets.
- ``DistributedDataParallel`` is a ``torch.nn.Module`` wrapping the user's
  module as submodule ``module``: ``forward`` calls it; ``parameters()``,
  ``named_parameters()``, ``state_dict()`` and ``load_state_dict()`` are the
  wrapped module's, under its own names (no ``module.`` prefix), unpadded.
- After ``finish_grad_sync()`` a plain ``torch.optim`` optimizer on
  ``ddp.parameters()`` either steps on the reduced gradient (all-reduce:
  ``param.grad`` is ``main_grad``, or a cast copy when dtypes differ) or fails
  at its first step with a LifecycleError (distributed optimizer: only a shard
  is reduced); until then it refuses to be read; see :mod:`fastgrad.exposed_grads`.
  ``zero_grad_buffer()`` (also ``zero_grad()``) zeroes the buffer and resets
  ``param.grad`` to None; torch's ``zero_grad()`` habits work, no zeroing raises.
- A wrapped param cast or moved after wrapping is refused (:mod:`fastgrad.param_guard`).

Expected counts. On the first batch (and again whenever the set of trainable
parameters changes) the engine *learns* which parameters of each bucket really
produce a gradient on the last microbatch: a bucket launches as soon as all of
its trainable parameters are ready, and a bucket that is still incomplete at
``finish_grad_sync`` (an unused parameter) is launched there and its observed
count becomes the expectation. Later batches launch each bucket when its
learned count is reached; a bucket that never launches is an error naming the
bucket and its ready/total counts. The counts are per *last microbatch*, so a
change in the number of microbatches cannot invalidate them (production learns
counts that silently depend on it), and a parameter frozen or unfrozen between
steps triggers relearning instead of a hang.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fastgrad.buffer import Bucket, ParamAndGradBuffer
from fastgrad.exposed_grads import ParamGrads
from fastgrad.param_guard import ParamPlacement
from gradvocab import Averaging, DDPConfig, LifecycleError, ParallelDims


@dataclass
class _BucketState:
    """Per-step bookkeeping of one bucket."""

    bucket: Bucket
    index: int
    ready: set[nn.Parameter] = field(default_factory=set)
    learned: frozenset[nn.Parameter] | None = None

    @property
    def launched(self) -> bool:
        """The bucket's reduce was launched this step (the bucket's own record)."""
        return self.bucket.reduce_in_flight


@dataclass(frozen=True)
class BucketReadiness:
    """A snapshot of one bucket's readiness (for reports and tests)."""

    index: int
    ready: int
    expected: int
    total: int
    launched: bool
    learned: bool


class DistributedDataParallel(nn.Module):
    """Wrap ``module``; reduce its gradients across the data-parallel group bucket by bucket.

    An ``nn.Module``: ``ddp(x)`` runs ``module``; ``parameters()``,
    ``named_parameters()``, ``state_dict()``/``load_state_dict()`` are the
    wrapped module's (its own names, unpadded tensors); ``train()``/``eval()``
    reach it as submodule ``module``.

    The data-parallel group is ``parallel_dims``' (a :class:`ParallelDims` with this
    rank's place: ``build()`` of the whole grid, or ``ParallelDims.data_parallel``), or
    ``dp_group``'s (default: torch's default group).
    ``averaging`` (a :class:`gradvocab.Averaging`) says how the replicas' grads are
    combined: None (the default, Megatron-Core's) averages through ``ReduceOp.AVG`` when
    ``config.average_in_collective`` is set, otherwise by pre-scaling each bucket by ``1/dp``
    before a SUM (``Averaging.PRESCALE``); ``Averaging.SUM`` sums (Megatron-Core's per-token
    loss). The plan is ``self.averaging``, decided once by
    :func:`fastgrad.averaging.grad_averaging`.
    ``external_grad_params`` are parameters whose ``main_grad`` is written
    outside autograd; they count as ready only through :meth:`mark_grad_ready`.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        config: DDPConfig,
        parallel_dims: ParallelDims | None = None,
        dp_group: Any = None,
        averaging: Averaging | None = None,
        external_grad_params: Iterable[nn.Parameter] = (),
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(config, DDPConfig):
            raise TypeError(f"config must be a DDPConfig, got {type(config).__name__}")
        if parallel_dims is not None and dp_group is not None:
            raise ValueError("pass either parallel_dims or dp_group, not both")
        super().__init__()
        self.module = module
        self.config = config
        self._names = {p: n for n, p in module.named_parameters()}
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("module has no parameter with requires_grad=True")
        self._frozen_at_build = frozenset(p for p in module.parameters() if not p.requires_grad)
        self.external_grad_params = frozenset(external_grad_params)
        trainable = set(params)
        unknown = [p for p in self.external_grad_params if p not in trainable]
        if unknown:
            raise ValueError("external_grad_params must be trainable parameters of module")
        self.parallel_dims = (ParallelDims.data_parallel(dp_group) if parallel_dims is None
                              else parallel_dims)
        self.buffer = ParamAndGradBuffer(
            params, config=config, parallel_dims=self.parallel_dims, averaging=averaging
        )
        self.averaging = self.buffer.averaging
        self.dp_size = self.parallel_dims.dp_size
        self.placement = ParamPlacement(params, self.buffer)
        self._grads = ParamGrads()  # what param.grad holds (fastgrad.exposed_grads)
        self._states = [_BucketState(b, i) for i, b in enumerate(self.buffer.buckets)]
        self._state_of = {p: s for s in self._states for p in s.bucket.params}
        self._sync_enabled = True
        self._step_open = False
        self._launch_sites: dict[int, str] = {}
        self.last_launch_sites: tuple[str, ...] = ()
        self._trainable: frozenset[nn.Parameter] = frozenset(params)
        self._learning = True
        self.relearn_count = 0
        self._grad_hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_accumulated)
            for p in params
            if p not in self.external_grad_params
        ]

    # -- nn.Module: the wrapped module, under its own names
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module's forward."""
        return self.module(*args, **kwargs)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters under its own names (``parameters()`` uses this)."""
        return self.module.named_parameters(
            prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate
        )

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's state dict (its names, unpadded tensors; no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Copy ``state_dict`` into the wrapped module's tensors (which stay buffer views)."""
        if assign:
            raise ValueError(
                "assign=True would replace the parameters with new tensors outside the grad "
                "buffer; load with assign=False (the default)"
            )
        return self.module.load_state_dict(state_dict, strict=strict)

    def name_of(self, param: nn.Parameter) -> str:
        """The parameter's name in the wrapped module (for error messages)."""
        return self._names.get(param, "<unnamed>")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``: zeroes what the optimizers read, i.e. :meth:`zero_grad_buffer`
        (``set_to_none`` is accepted for torch's signature; ``param.grad`` is reset to None)."""
        self.zero_grad_buffer()

    def check_param_placement(self) -> None:
        """Raise LifecycleError if a wrapped param changed dtype, device or storage since
        wrapping (``model.to(torch.bfloat16)`` after wrapping; see :mod:`fastgrad.param_guard`)."""
        self.placement.check(self.name_of)

    # -- step lifecycle
    def _open_step(self) -> None:
        if self._step_open:
            return
        self.check_param_placement()
        current = frozenset(p for p in self._state_of if p.requires_grad)
        unfrozen = [p for p in self._frozen_at_build if p.requires_grad]
        if unfrozen:
            raise LifecycleError(
                f"parameter {self.name_of(unfrozen[0])!r} was frozen when DDP was built and has "
                "no slot in the grad buffer; unfreezing it needs a new DistributedDataParallel"
            )
        if current != self._trainable:
            # Frozen set changed: what each bucket waits for must be learned again.
            self._trainable = current
            self._learning = True
            self.relearn_count += 1
            for state in self._states:
                state.learned = None
        self._step_open = True

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` (start of a step); refused while a reduce is pending."""
        pending = [s for s in self._states if s.launched]
        if pending:
            raise LifecycleError(
                f"zero_grad_buffer while bucket {pending[0].index}'s reduce is launched and not "
                "finished; call finish_grad_sync first"
            )
        self._grads.drop()
        self.buffer.zero_grad()
        self._open_step()

    @property
    def grad_sync_enabled(self) -> bool:
        """False inside ``no_sync()``: backwards only accumulate, nothing is counted."""
        return self._sync_enabled

    def disable_grad_sync(self) -> None:
        """Mark the following backwards as not the last microbatch (no counting, no launch)."""
        if not self._sync_enabled:
            raise LifecycleError("grad sync is already disabled (no_sync() is not reentrant)")
        launched = [s.index for s in self._states if s.launched]
        if launched:
            raise LifecycleError(
                f"no_sync() entered after bucket(s) {launched} launched their reduce this step; "
                "finish_grad_sync must come first"
            )
        self._open_step()
        self._sync_enabled = False

    def enable_grad_sync(self) -> None:
        """Mark the next backward as the last microbatch's (idempotent)."""
        self._sync_enabled = True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager: backwards inside it only accumulate into ``main_grad``."""
        self.disable_grad_sync()
        try:
            yield
        finally:
            self.enable_grad_sync()

    # -- readiness
    def _expected(self, state: _BucketState) -> frozenset[nn.Parameter]:
        if state.learned is not None:
            return state.learned
        return frozenset(p for p in state.bucket.params if p in self._trainable)

    def _complete(self, state: _BucketState) -> bool:
        return self._expected(state) <= state.ready

    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        # Runs once per parameter per microbatch: kept to plain attribute reads on the
        # common path (torch's DDP does this part in C++).
        grad = param.grad
        if grad is None:
            return
        grads = self._grads
        if grads.out:
            # The first grad since finish_grad_sync, and zero_grad_buffer was not called:
            # honour torch's zero_grad() habits, or refuse (fastgrad.exposed_grads).
            grads.settle(param, self.buffer, self.name_of)
        if not self._step_open:
            self._open_step()
        sync = self._sync_enabled
        if sync:
            state = self._state_of[param]
            self._check_can_become_ready(param, state)
        exposed = grads.take_exposed(param)
        if exposed is None or grad is not exposed:
            param.main_grad.add_(grad)
        # else: param.grad is main_grad itself (torch's zero_grad(set_to_none=False) zeroed it
        # in place, settle_unzeroed_grads checked): autograd accumulated into main_grad already.
        if sync:
            # Until finish_grad_sync reduces it, param.grad refuses to be read (a torch
            # optimizer would otherwise skip the param: a step that silently does nothing).
            param.grad = grads.unreduced(param)
            self._register_ready(param, state)
        else:
            param.grad = None

    def _check_can_become_ready(self, param: nn.Parameter, state: _BucketState) -> None:
        if state.launched:
            raise LifecycleError(
                f"grad of {self.name_of(param)!r} arrived after bucket {state.index}'s reduce "
                "was launched: grad sync must be enabled only for the last microbatch's backward"
            )
        if param in state.ready:
            raise LifecycleError(
                f"{self.name_of(param)!r} became ready twice with grad sync enabled: grad sync "
                "must be enabled only for the last microbatch's backward"
            )

    def _register_ready(self, param: nn.Parameter, state: _BucketState) -> None:
        state.ready.add(param)
        if self.config.overlap_grad_reduce and self._complete(state):
            self._launch(state, "hook")

    def mark_grad_ready(self, param: nn.Parameter) -> None:
        """Announce that ``param.main_grad`` was written outside autograd for this microbatch."""
        if param not in self._state_of:
            raise ValueError("param is not a trainable parameter of this DDP module")
        if self._grads.out:
            raise LifecycleError(
                f"mark_grad_ready({self.name_of(param)!r}) after finish_grad_sync without "
                "zero_grad_buffer(): main_grad still holds the last step's reduced gradient; "
                "call ddp.zero_grad_buffer() before writing main_grad"
            )
        self._open_step()
        if not self._sync_enabled:
            return
        state = self._state_of[param]
        self._check_can_become_ready(param, state)
        self._register_ready(param, state)

    def reduce_in_flight(self, param: nn.Parameter) -> bool:
        """True when ``param``'s bucket has launched its reduce this step (writes would race)."""
        state = self._state_of.get(param)
        return state is not None and state.launched

    @property
    def any_reduce_in_flight(self) -> bool:
        """True when any bucket has launched its reduce this step."""
        return any(s.launched for s in self._states)

    def readiness(self) -> list[BucketReadiness]:
        """Per bucket: ready / expected / total params, launched, expectation learned."""
        return [
            BucketReadiness(
                index=s.index,
                ready=len(s.ready),
                expected=len(self._expected(s)),
                total=len(s.bucket.params),
                launched=s.launched,
                learned=s.learned is not None,
            )
            for s in self._states
        ]

    # -- reduction
    def _launch(self, state: _BucketState, site: str) -> None:
        state.bucket.start_grad_sync()
        self._launch_sites[state.index] = site

    def start_grad_sync(self) -> None:
        """Dispatch every complete bucket not yet launched (overlap only; no-op otherwise)."""
        if not self._sync_enabled:
            raise LifecycleError("start_grad_sync inside no_sync(): enable grad sync first")
        if not self.config.overlap_grad_reduce:
            return
        for state in self._states:
            if not state.launched and self._complete(state):
                self._launch(state, "dispatch")

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's reduction (running it now without overlap); end the step."""
        if not self._sync_enabled:
            raise LifecycleError(
                "finish_grad_sync inside no_sync(): the last microbatch's grads were never "
                "counted; call enable_grad_sync (leave no_sync) first"
            )
        if not self._step_open:
            # Nothing since the last finish: reducing again would reduce the
            # already-reduced grads a second time (or wait on nothing).
            raise LifecycleError(
                "finish_grad_sync without a step in progress: no zero_grad_buffer, backward, "
                "no_sync or mark_grad_ready since the last finish_grad_sync"
            )
        missing: _BucketState | None = None
        for state in self._states:
            if state.launched:
                continue
            if (
                self.config.overlap_grad_reduce
                and not self._learning
                and not self._complete(state)
                and missing is None
            ):
                missing = state
                continue
            if missing is None:
                self._launch(state, "finish")
        for state in self._states:
            if state.launched:
                state.bucket.finish_grad_sync()
        if missing is not None:
            expected = self._expected(missing)
            absent = sorted(self.name_of(p) for p in expected - missing.ready)
            error = LifecycleError(
                f"finish_grad_sync: communication call has not been issued for bucket "
                f"{missing.index} ({len(missing.ready)}/{len(expected)} params have grad "
                f"available; waiting for {absent}); learned on the first batch, so the "
                "graph changed (a parameter unused this step?)"
            )
            self._end_step(learn=False)
            raise error
        self._end_step(learn=self._learning)
        self._grads.expose(self.buffer.params, sharded=self.config.use_distributed_optimizer)

    def _end_step(self, *, learn: bool) -> None:
        for state in self._states:
            if learn:
                state.learned = frozenset(state.ready)
            state.ready.clear()
        if learn:
            self._learning = False
        self.last_launch_sites = tuple(
            self._launch_sites.get(s.index, "never") for s in self._states
        )
        self._launch_sites = {}
        self._step_open = False

    @property
    def learning(self) -> bool:
        """True until the expected ready counts have been learned (first batch, or after a change)."""
        return self._learning

    def remove_hooks(self) -> None:
        """Detach the grad hooks (the buffer views stay)."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()


__all__ = ["BucketReadiness", "DistributedDataParallel"]

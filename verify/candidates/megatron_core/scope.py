"""The ``with`` scope of Megatron-Core's technique interfaces: its per-process setup, undone on exit.

A check uses a technique's interface inside ``with`` (:class:`verify.candidates.interfaces.TechniqueScope`).
For Megatron-Core the block holds what its own code assumes of the process:

* the CPU redirects (:func:`verify.candidates.megatron_core.redirect.cpu_redirects`;
  nothing is redirected on a machine with CUDA);
* where the interface asks for it, an initialised default process group: Megatron's
  buffers log through ``megatron.core.utils.log_on_each_pipeline_stage``, which asserts
  ``torch.distributed.is_initialized()`` even when it is given its groups. In a process
  without one (the check's own process, which lays out buffers for inspection) the scope
  makes a one-rank gloo group on an in-memory store and destroys it on exit; a rank
  process keeps the group it has;
* where the interface asks for it, Megatron's global memory buffer
  (``parallel_state._set_global_memory_buffer``, which ``initialize_model_parallel``
  would make), into which the sequence-parallel drain all-gathers its inputs; destroyed
  on exit when the scope made it;
* Megatron's import-time notice that it falls back to torch's optimizers (the candidate's
  feature table records it), torch's deprecation notices about the collectives Megatron
  calls, and Megatron's CUDA performance hints, filtered (noise, not findings); so is the
  log line of ``DistributedDataParallel.__init__`` (0.17 on) that it computes the
  distributed optimizer's param layout itself when none is handed in: it computes it from
  the same params, bucket size and DP size as Megatron-LM's ``get_model``
  (``training.py`` ``wrap_model_chunks_with_ddp``), so the layout is the same.

All of this is process-wide state (``torch.cuda``'s functions, ``sys.modules``, torch's
default group, a Megatron module global), so scopes in one process take turns on one lock:
two checks run in threads never see each other's half-made setup. A scope may be entered
again inside itself (the lock is re-entrant; the inner scope finds everything made).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import ClassVar, Self

import torch.distributed as dist

from verify.candidates.megatron_core.redirect import RedirectLog, cpu_redirects

# Guards the process-wide state listed in the module docstring (a lock, not configuration).
_PROCESS_SETUP_LOCK = threading.RLock()


@contextmanager
def default_process_group() -> Iterator[bool]:
    """The block runs with an initialised default process group; yields True when this
    made one (a one-rank gloo group on a ``HashStore``, destroyed on exit)."""
    if dist.is_initialized():
        yield False
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield True
    finally:
        dist.destroy_process_group()


@contextmanager
def global_memory_buffer() -> Iterator[None]:
    """Megatron's global memory buffer exists inside the block (made and destroyed here
    unless it already existed)."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is not None:  # made by initialize_model_parallel
        yield
        return
    parallel_state._set_global_memory_buffer()
    try:
        yield
    finally:
        parallel_state.destroy_global_memory_buffer()


DDP_LOGGER = "megatron.core.distributed.distributed_data_parallel"
SELF_COMPUTED_LAYOUT = "DistributedDataParallel: full_param_layout not provided"


def _not_self_computed_layout(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(SELF_COMPUTED_LAYOUT)


@contextmanager
def quiet_self_computed_layout() -> Iterator[None]:
    """Inside the block, DDP's log line that it computed its param layout itself is dropped
    (the module docstring says why it is noise)."""
    logger = logging.getLogger(DDP_LOGGER)
    added = _not_self_computed_layout not in logger.filters  # an outer scope's stays its own
    if added:
        logger.addFilter(_not_self_computed_layout)
    try:
        yield
    finally:
        if added:
            logger.removeFilter(_not_self_computed_layout)


@contextmanager
def process_setup(*, needs_default_group: bool = False,
                  needs_memory_buffer: bool = False) -> Iterator[RedirectLog]:
    """Everything the module docstring lists, for one block; yields the redirect log."""
    with _PROCESS_SETUP_LOCK, warnings.catch_warnings(), ExitStack() as stack:
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        warnings.filterwarnings("ignore", message="Apex is not installed")
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        # TransformerConfig's notice about its own default cuda_graph_scope (no CUDA graphs here)
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        # Performance hints, not numerical findings: CUDA_DEVICE_MAX_CONNECTIONS (a CUDA stream
        # setting) for the async TP all-reduce, and the param all-gather's dispatch order over
        # a test model's few buckets (overlap, which the checks do not measure).
        warnings.filterwarnings("ignore", message="When using async grad allreduce it is recommended")
        warnings.filterwarnings("ignore", message="When using sequence parallelism it is recommended")
        warnings.filterwarnings("ignore", message="The next bucket's parameter all-gather operation")
        # schedules.backward_step reads ``x.grad`` of each input tensor, and torch notes when
        # one is not a leaf (its .grad is None). Reported from redirect.py because the CPU
        # redirect's TorchFunctionMode is on the stack. Not a finding by itself: the checks
        # and the twin compare every gradient with refgrad, so a grad lost there fails them.
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        stack.enter_context(quiet_self_computed_layout())
        log = stack.enter_context(cpu_redirects())
        if needs_default_group:
            stack.enter_context(default_process_group())
        if needs_memory_buffer:
            stack.enter_context(global_memory_buffer())
        yield log


@dataclass(frozen=True)
class MegatronScope:
    """Base of Megatron-Core's technique interfaces: ``with`` holds :func:`process_setup`.

    Subclasses say what their interface needs (``needs_default_group``,
    ``needs_memory_buffer``). The interface object is frozen; the open blocks are kept in a
    list it owns (one entry per nesting level).
    """

    needs_default_group: ClassVar[bool] = False
    needs_memory_buffer: ClassVar[bool] = False
    _open: list[ExitStack] = field(default_factory=list, init=False, repr=False, compare=False)

    def __enter__(self) -> Self:
        stack = ExitStack()
        stack.enter_context(process_setup(needs_default_group=self.needs_default_group,
                                          needs_memory_buffer=self.needs_memory_buffer))
        self._open.append(stack)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._open.pop().close()

"""The ``with`` scope of Megatron-Core's technique interfaces for the preflight twin: its CUDA
assumptions redirected to the CPU (:func:`verify.candidates.megatron_core.redirect.cpu_redirects`;
nothing is redirected where CUDA is available) and its import-time notices filtered, for
everything inside the block (autograd's backward included), undone on exit."""

from __future__ import annotations

import warnings
from contextlib import ExitStack
from types import TracebackType
from typing import Self

from verify.candidates.megatron_core.redirect import cpu_redirects


class CpuRedirectScope:
    """Mixin for an interface's ``__enter__``/``__exit__`` (frozen dataclasses: the open stack
    lives outside the dataclass fields). Scopes nest: an inner one finds the redirects made."""

    def __enter__(self) -> Self:
        stack = ExitStack()
        stack.enter_context(warnings.catch_warnings())
        # Megatron's import-time notice that it falls back to torch's optimizers (recorded in
        # the feature table) and torch's deprecation notices about the collectives Megatron
        # calls: noise in every rank's stderr, not findings.
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        warnings.filterwarnings("ignore", message="Apex is not installed")
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        # TransformerConfig's notice about its own default cuda_graph_scope (no CUDA graphs here)
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        stack.enter_context(cpu_redirects())
        stacks = self.__dict__.setdefault("_open_scopes", [])
        stacks.append(stack)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.__dict__["_open_scopes"].pop().close()

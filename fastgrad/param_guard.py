"""Wrapped parameters that left the grad buffer behind the wrapper's back.

``DistributedDataParallel`` lays its buffers out for each parameter's dtype and
device, and under the distributed optimizer every parameter *is* a view of the
bucket's param buffer (the optimizer writes the buffer and all-gathers it). A
``model.to(torch.bfloat16)``, ``.half()``, ``.cuda()`` or ``param.data = ...``
after wrapping swaps the parameter's storage: the grads still land in
``main_grad``, but the buffer no longer aliases the parameter, so the
optimizer's updates never reach it -- every step "steps" and the model never
changes. :class:`ParamPlacement` records what each parameter was when the buffer
was built and :meth:`ParamPlacement.check` refuses a step once any has changed.

Cost: three attribute reads per parameter per step (dtype, device and, under the
distributed optimizer, the data pointer); no pass over the data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from gradvocab import LifecycleError

CAST_BEFORE_WRAPPING = (
    "cast or move the model before wrapping it in DistributedDataParallel "
    "(and build the optimizer after that); the grad buffer was laid out for the old "
    "dtype and device"
)


class ParamPlacement:
    """Each wrapped parameter's dtype, device and (when it is a buffer view) data pointer."""

    def __init__(self, params: Iterable[torch.Tensor], buffer: Any) -> None:
        self._records: list[tuple[torch.Tensor, torch.dtype, torch.device, int | None]] = []
        for p in params:
            group = buffer.group_of(p)
            is_view = group.param_data is not None
            self._records.append((p, p.dtype, p.device, p.data_ptr() if is_view else None))

    def check(self, name_of: Callable[[Any], str]) -> None:
        """Raise :class:`LifecycleError` naming the first parameter whose dtype, device or
        storage changed since the buffer was built."""
        for p, dtype, device, pointer in self._records:
            if p.dtype is not dtype:
                raise LifecycleError(
                    f"parameter {name_of(p)!r} changed dtype from {_short(dtype)} to "
                    f"{_short(p.dtype)} after DistributedDataParallel was built (model.to(), "
                    f".half(), .bfloat16() after wrapping?): its params and grads no longer live "
                    f"in the grad buffer, so the optimizer's updates would never reach it; "
                    + CAST_BEFORE_WRAPPING
                )
            if p.device != device:
                raise LifecycleError(
                    f"parameter {name_of(p)!r} moved from {device} to {p.device} after "
                    "DistributedDataParallel was built (model.to(device) or .cuda() after "
                    "wrapping?): " + CAST_BEFORE_WRAPPING
                )
            if pointer is not None and p.data_ptr() != pointer:
                raise LifecycleError(
                    f"parameter {name_of(p)!r} no longer is a view of the grad buffer's param "
                    "buffer (param.data was replaced after DistributedDataParallel was built): "
                    "the distributed optimizer's updates would never reach it; write new values "
                    "in place (ddp.load_state_dict, or param.copy_() under torch.no_grad())"
                )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

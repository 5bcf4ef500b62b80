"""The tied embedding on one pipeline stage (production's PP 1): one weight, two uses.

Megatron-Core at PP 1 gives the output layer the word embedding's own parameter
(``shared_embedding_or_output_weight()``, ``zero_out_wgrad = True``): per
microbatch the backward reaches the output layer first, whose wgrad GEMM adds
into the weight's ``main_grad`` (gradient-accumulation fusion), then the
embedding's grad arrives in ``param.grad`` (plus the output layer's zeros) and
the DDP hook adds it; no embedding-group all-reduce, the param counted once in
the grad norm. The twin's rank side does the same: the first layer's weight is
the output layer's (:func:`share_head_weight`), DDP holds it once, readiness
comes from its autograd hook (not ``mark_grad_ready``), and nothing is drained
(deferral needs PP > 1). The reference is ``refgrad.pipeline``'s
``LinearStackSpec.shares_one_weight``.

Two deliberately broken output layers for the twin's tests (faults of the case,
applied by each rank to its own instance): ``"embedding_grad_first"`` adds each
microbatch's output-layer wgrad after the first layer's grad, ``"dropped_head_wgrad"``
never adds it.
"""

from __future__ import annotations

from typing import Any

from refgrad.pipeline import LinearStackSpec

SHARED_WEIGHT_FAULTS = ("embedding_grad_first", "dropped_head_wgrad")


def share_head_weight(spec: LinearStackSpec, body: Any, head: Any) -> None:
    """Tied on one stage: make the output layer compute with the first layer's weight (one
    Parameter, its ``main_grad`` the DDP buffer's view); otherwise leave both alone."""
    if spec.shares_one_weight:
        head.weight = body.layers[0].weight


def external_grad_params(spec: LinearStackSpec, head: Any) -> list[Any]:
    """The params whose ``main_grad`` only the output layer writes (made ready by the schedule's
    ``mark_grad_ready``): its weight, unless the first layer shares it (then autograd's hook
    makes it ready, after the output layer's wgrad)."""
    return [] if head is None or spec.shares_one_weight else [head.weight]


def drained_head(spec: LinearStackSpec, head: Any) -> Any:
    """What the schedule drains and marks ready: the output layer, or None when its weight is
    the first layer's (PP 1: nothing is deferred; the first layer's hook marks it ready)."""
    return None if spec.shares_one_weight else head


def updated_once(named: dict[str, Any], frozen: Any) -> list[Any]:
    """The params to step, each once (the shared weight has two names), none frozen."""
    out: list[Any] = []
    for name, param in named.items():
        if name not in frozen and all(param is not seen for seen in out):
            out.append(param)
    return out


def faulty_output_layer(base: type, fault: str) -> type:
    """``base`` (fastgrad's output layer) broken as ``fault`` says, for one rank's instance."""
    if fault == "dropped_head_wgrad":
        class DroppedWgradOutputLayer(base):
            """A wrong output layer: its wgrad never reaches ``main_grad``."""

            def _accumulate(self, grad_output: Any, total_input: Any, guard: Any) -> None:
                del grad_output, total_input, guard

        return DroppedWgradOutputLayer

    class EmbeddingFirstOutputLayer(base):
        """A wrong order: each microbatch's wgrad is held back and added by a post-accumulate
        hook registered at the first forward, i.e. after DDP's, so after the first layer's
        grad."""

        def forward(self, local_input: Any) -> Any:
            if not hasattr(self, "_late_hook"):
                self._pending: list[tuple[Any, Any, Any]] = []
                self._late_hook = self.weight.register_post_accumulate_grad_hook(self._add_pending)
            return super().forward(local_input)

        def _accumulate(self, grad_output: Any, total_input: Any, guard: Any) -> None:
            self._pending.append((grad_output, total_input, guard))

        def _add_pending(self, param: Any) -> None:
            del param
            while self._pending:
                super()._accumulate(*self._pending.pop(0))

    return EmbeddingFirstOutputLayer

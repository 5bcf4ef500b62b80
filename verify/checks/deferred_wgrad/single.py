"""The deferred_wgrad check's single-process parts, run inside a rank of the check's world (so
a candidate's process-wide setup never touches the check's own process): the in-flight guard
and the step abandoned after a backward. Each returns plain facts; the parent records them."""

from __future__ import annotations

import torch

from gradvocab import ParallelDims
from verify.candidates.interfaces import DeferredWgrad, DrainRefused, OutputLayerConfig
from verify.checks.deferred_wgrad.cases import BATCH, HIDDEN, SEQ, VOCAB
from verify.metrics import bitwise_equal


def _generator(seed: int, offset: int) -> torch.Generator:
    """``CheckContext.generator(offset)``'s stream, rebuilt from the seed inside a rank."""
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + offset)
    return g


def guard_facts(seed: int, wgrad: DeferredWgrad) -> dict[str, bool]:
    """Draining into a bucket whose reduce is in flight must raise and write nothing."""
    config = OutputLayerConfig(defer_embedding_wgrad_compute=True, dims=ParallelDims(pp_size=2))
    g = _generator(seed, 3)
    layer = wgrad.output_layer(torch.randn(VOCAB, HIDDEN, generator=g).bfloat16(), config)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).bfloat16().requires_grad_(True)
    layer(x).backward(torch.randn(SEQ, BATCH, VOCAB, generator=g).bfloat16())
    before = layer.main_grad.clone()
    raised = False
    try:
        layer.drain(reduce_in_flight=lambda p: p is layer.weight)
    except DrainRefused:
        raised = True
    return {"raised": raised, "untouched": bitwise_equal(before, layer.main_grad),
            "kept": layer.num_deferred == 1}


STALE_LIMIT = 2  # the stale step's deferral limit (production asserts at limit 0)


def stale_step_facts(seed: int, wgrad: DeferredWgrad) -> dict[str, object]:
    """A step abandoned after a backward leaves entries in both buffers; the next step must
    not see them. Production clears only the activation buffer at step start, so a stale
    grad_output would be paired with the next step's first input."""
    config = OutputLayerConfig(defer_embedding_wgrad_compute=True,
                               wgrad_deferral_limit=STALE_LIMIT, dims=ParallelDims(pp_size=2))
    g = _generator(seed, 11)
    weight = torch.randn(VOCAB, HIDDEN, generator=g).bfloat16()
    xs = [torch.randn(SEQ, BATCH, HIDDEN, generator=g).bfloat16() for _ in range(3)]
    gos = [torch.randn(SEQ, BATCH, VOCAB, generator=g).bfloat16() for _ in range(3)]

    def full_step(layer) -> None:
        layer.start_step()
        for x, go in zip(xs[1:], gos[1:]):
            layer(x.clone().requires_grad_(True)).backward(go)
        layer.drain()

    fresh = wgrad.output_layer(weight, config)
    full_step(fresh)
    reused = wgrad.output_layer(weight, config)
    reused.start_step()
    reused(xs[0].clone().requires_grad_(True)).backward(gos[0])  # abandoned: no drain
    reused.main_grad.zero_()
    try:
        full_step(reused)
    except DrainRefused as refusal:
        return {"same": False, "detail": str(refusal)}
    same = bitwise_equal(fresh.main_grad, reused.main_grad)
    return {"same": same, "detail": "" if same else "main_grad differs from a fresh layer's"}

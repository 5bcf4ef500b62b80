"""Check ``pipeline``: grad sync in the 1F1B cooldown bubble, bitwise against refgrad.

Real gloo processes run a ``P``-stage 1F1B pipeline times ``D`` data-parallel
replicas (the candidate's :class:`~verify.candidates.interfaces.PipelineTraining`:
fastgrad's ``fastgrad.pipeline`` + ``fastgrad.ddp`` by default) for several optimizer
steps with rank-specific data, microbatch counts ``M`` in ``{1, P-1, P, 2P+1}``
(so ``M`` changes from step to step) and a parameter frozen for one step. Each
case runs with ``overlap_grad_reduce`` on and off. Losses, reduced gradients
and updated parameters must be bitwise equal between overlap on, overlap off
and ``refgrad.pipeline`` (one process, microbatches in order, the reference DP
reduction). That is a fixed-order claim for ``D <= 2``: a sum of two fp32
values has one rounding whatever algorithm the all-reduce uses.

All grids share one spawned world: ``(4, 2)`` uses all 8 ranks, ``(2, 2)`` and
``(4, 1)`` run side by side on ranks 0-3 and 4-7, ``(2, 1)`` on ranks 0-1. A
timing phase records per-rank timelines (overlap on vs off) and holds the
discrete-event simulator (``verify.studies.pipeline``) against them.

One interleaved case (``vpp_size = 2``: one DDP engine per model chunk, ``M`` a
changing multiple of ``P``) runs the same comparisons against refgrad on the
``P * V``-stage model, and checks that the chunks enable their sync in reverse order
with chunk ``V - 1`` already reducing (overlap on) when chunk 0 starts its last backward.

A case the candidate cannot run is a SKIP naming the reason; the rest still run.

Package layout: ``cases`` (grids, step plans, phases), ``worker`` (the spawned entry
point: the candidate's grids and training on each rank), ``report`` (collecting results,
tables, the simulator comparison), ``entry`` (the run function and the registration).
The case and result types are the candidate API's (``verify.candidates.interfaces``);
fastgrad's training is ``verify.candidates.fastgrad.pipeline``.
"""

from verify.checks.pipeline.cases import build_phases, default_plans
from verify.checks.pipeline.entry import CHECK, run
from verify.checks.pipeline.worker import pipeline_worker

__all__ = [
    "CHECK",
    "build_phases",
    "default_plans",
    "pipeline_worker",
    "run",
]

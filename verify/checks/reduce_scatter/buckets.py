"""The reduce_scatter check's DDP bucket part: the candidate's whole DP reduction vs refgrad's DP mean.

Each :class:`~verify.checks.reduce_scatter.cases.BucketCase` fills one bucket per rank with
rank-specific grads (bf16 and fp16, two iterations) and reduces it with the candidate's own
DDP under the case's :class:`~verify.candidates.api.grad_reduction.ReductionConfig`
(:meth:`GradReduction.bucket_reduction`). The spec is refgrad's DP mean (or sum) accumulated in
fp32 in rank order and rounded once (``refgrad.reduce_scatter``, ``accumulate="fp32"``,
``order="rank"``). A candidate that departs from it by design says how
(:class:`~verify.candidates.api.grad_reduction.ReductionBehaviour`): the check then holds it
bitwise to refgrad's model of that behaviour (a mismatch FAILs) and records the distance from
the spec as a documented difference naming where the behaviour lives:

* the mean as a pre-scale: ``refgrad.reduce_scatter.prescale_like_torch(inputs, 1/W)``, then
  a SUM (exact only at power-of-two W);
* the plain collective: gloo's reduce-scatter and all-reduce sum in the grad dtype in reverse
  ring order (``accumulate="wire"``, ``order="ring_reverse"``; at W <= 2 one addition, in any
  order), ``ReduceOp.AVG`` divides that sum by W.

A case the candidate raises in (on every rank alike) fails as ``<case>: runs`` with the
error and where it was raised; one it refuses up front (Unsupported) is a skip; the other
cases go on.
"""

from __future__ import annotations

import traceback

import torch

from refgrad import reduce_scatter as refc
from verify.candidates.api.core import DocumentedBehaviour, Unsupported
from verify.candidates.api.grad_reduction import GradReduction, ReductionBehaviour
from verify.check import CheckRecorder
from verify.checks.reduce_scatter.cases import (
    BUCKET_SHARD,
    DTYPE_NAMES,
    INPUTS,
    ITERATIONS,
    BucketCase,
)


def _raised_at(error: BaseException) -> str:
    """Where ``error`` was raised: the innermost frame, its path from the package root."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    path = frame.filename.split("site-packages/")[-1]
    return f"{path}:{frame.lineno} {frame.name}"


def run_bucket_cases(reduction: GradReduction, rank: int, groups: dict, cases: list[BucketCase],
                     seed: int) -> list[dict | None]:
    """In a rank: each case this rank takes part in, in order; per case the reduced values
    this rank holds per (dtype, iteration), or the error it raised (None: not a member)."""
    out: list[dict | None] = []
    for case in cases:
        if rank >= case.size:
            out.append(None)
            continue
        held: dict = {}
        try:
            reduce = reduction.bucket_reduction(case.config)  # built now: after the cases before it
            for dtype_name in DTYPE_NAMES:
                for it in range(ITERATIONS):
                    grads = INPUTS[case.inputs](rank, case.size, case.size * BUCKET_SHARD,
                                                getattr(torch, dtype_name), it, seed)
                    held[(dtype_name, it)] = reduce(grads, group=groups[case.size])
        except Unsupported as unsupported:  # refused up front: a skip, not a failure
            out.append({"skip": str(unsupported)})
            continue
        except Exception as error:  # noqa: BLE001 - the case fails with it; the others go on
            message = str(error) or "(no message)"
            out.append({"error": f"{type(error).__name__}: {message}",
                        "raised_at": _raised_at(error)})
            continue
        out.append({"held": held})
    return out


def _documented(behaviour: ReductionBehaviour, case: BucketCase
                ) -> tuple[DocumentedBehaviour | None, bool, bool]:
    """The candidate's documented behaviours that apply to ``case``, joined into one, and
    which of them apply (pre-scale, plain collective)."""
    config = case.config
    prescale = (behaviour.prescale if config.average and not config.average_in_collective
                else None)
    wire = behaviour.wire_collective if not config.reduce_scatter_with_fp32_accumulation else None
    parts = [b for b in (prescale, wire) if b is not None]
    if not parts:
        return None, False, False
    joined = DocumentedBehaviour("; then ".join(b.summary for b in parts),
                                 "; ".join(b.where for b in parts))
    return joined, prescale is not None, wire is not None


def _expected(case: BucketCase, inputs: list[torch.Tensor], *, prescale: bool, wire: bool
              ) -> list[torch.Tensor]:
    """Per rank, the values refgrad gives it: the spec (both flags False) or the model of the
    documented behaviours the flags name."""
    config, size = case.config, case.size
    reduce = refc.reduce_scatter if config.use_distributed_optimizer else refc.all_reduce
    op = config.op
    if prescale:
        inputs, op = refc.prescale_like_torch(inputs, 1.0 / size), "sum"
    accumulate, order = (("wire", "rank" if size <= 2 else "ring_reverse") if wire
                         else ("fp32", "rank"))
    return reduce(inputs, accumulate=accumulate, order=order, op=op)


def bucket_references(cases: list[BucketCase], behaviour: ReductionBehaviour, seed: int
                      ) -> dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor | None]]:
    """refgrad's spec and (where the candidate documents a behaviour) its model, per
    (case index, dtype, iteration); cases with the same inputs and arithmetic share one
    computation."""
    done: dict[tuple, torch.Tensor] = {}
    out = {}
    for index, case in enumerate(cases):
        documented, prescale, wire = _documented(behaviour, case)
        for dtype_name in DTYPE_NAMES:
            for it in range(ITERATIONS):
                inputs = None
                values = []
                for flags in ((False, False), (prescale, wire)) if documented else ((False, False),):
                    key = (case.size, case.inputs, case.config.op,
                           case.config.use_distributed_optimizer, dtype_name, it, flags)
                    if key not in done:
                        if inputs is None:
                            inputs = [INPUTS[case.inputs](r, case.size, case.size * BUCKET_SHARD,
                                                          getattr(torch, dtype_name), it, seed)
                                      for r in range(case.size)]
                        done[key] = torch.cat(_expected(case, inputs, prescale=flags[0],
                                                        wire=flags[1]))
                    values.append(done[key])
                out[(index, dtype_name, it)] = (values[0], values[1] if documented else None)
    return out


def bucket_references_process(rank: int, world: int, cases: list[BucketCase],
                              behaviour: ReductionBehaviour, seed: int) -> dict:
    """:func:`bucket_references` in a process of its own (``spawn`` with one rank)."""
    return bucket_references(cases, behaviour, seed)


def check_bucket_cases(rec: CheckRecorder, per_rank: list[dict], cases: list[BucketCase],
                       behaviour: ReductionBehaviour, expected: dict) -> None:
    """Every bucket case vs refgrad (``expected``: :func:`bucket_references`), documented
    behaviours classified (module docstring)."""
    for index, case in enumerate(cases):
        runs = [per_rank[r]["buckets"][index] for r in range(case.size)]
        if "skip" in runs[0]:
            rec.skip(f"{case.label}: {runs[0]['skip']}")
            continue
        errors = sorted({f"{run['error']} (raised at {run['raised_at']})"
                         for run in runs if "error" in run})
        if errors:
            rec.expect(f"{case.label}: runs", False, "; ".join(errors)[:400])
            continue
        documented = _documented(behaviour, case)[0]
        for dtype_name in DTYPE_NAMES:
            for it in range(ITERATIONS):
                spec, model = expected[(index, dtype_name, it)]
                got = torch.cat([run["held"][(dtype_name, it)] for run in runs])
                rec.compare_documented(
                    f"{case.label} vs refgrad's DP {case.config.op}: {dtype_name} it={it}",
                    spec, got, documented=documented, documented_reference=model)

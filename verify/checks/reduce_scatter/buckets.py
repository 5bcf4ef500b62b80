"""The reduce_scatter check's DDP bucket part: the candidate's whole DP reduction vs refgrad's DP mean.

Each :class:`~verify.checks.reduce_scatter.cases.BucketCase` fills one bucket per rank with
rank-specific grads (bf16 and fp16, two iterations) and reduces it with the candidate's own
DDP under the case's :class:`~verify.candidates.interfaces.ReductionConfig`
(:meth:`GradReduction.bucket_reduction`). The spec is refgrad's DP mean (or sum) accumulated in
fp32 in rank order and rounded once (``refgrad.reduce_scatter``, ``accumulate="fp32"``,
``order="rank"``). A candidate that departs from it by design says how
(:data:`~verify.candidates.interfaces.REDUCTION_BEHAVIOURS`): the check then holds it
bitwise to refgrad's model of that behaviour (a mismatch FAILs) and records the distance from
the spec as a documented difference naming where the behaviour lives:

* the mean as a pre-scale: ``refgrad.reduce_scatter.prescale_like_torch(inputs, 1/W)``, then
  a SUM (exact only at power-of-two W);
* the plain collective: gloo's reduce-scatter and all-reduce sum in the grad dtype in reverse
  ring order on its segments (``accumulate="wire"``, ``order="gloo_ring"``; at W <= 2 one addition, in any
  order), ``ReduceOp.AVG`` divides that sum by W.

Each case runs in a world of its own size (fresh processes for a candidate that keeps
process-wide state, so no case sees what an earlier one left). A case the candidate raises in
is the case's crash, with the root cause and where it was raised; one it refuses up front
(Unsupported) is a skip; the other cases go on. One case deliberately reduces after a DDP with
the fp32-accumulating reduce-scatter in the same process (``after_fp32``): a direct use of the
API that no Megatron-LM launch makes, where a process-wide setting leaking from one DDP into
the next shows.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gradvocab import Averaging, ParallelDims
from refgrad import reduce_scatter as refc
from refgrad import reduce_torch
from verify.candidates import Candidate, LaunchSettings
from verify.candidates.interfaces import Behaviour, DocumentedBehaviour, Unsupported
from verify.check import CheckRecorder
from verify.checks.reduce_scatter.cases import (
    BUCKET_SHARD,
    FP32_PRESCALED,
    INPUTS,
    ITERATIONS,
    BucketCase,
    spec_averaging,
)
from verify.distributed import ItemOutcome


def case_settings(case: BucketCase) -> LaunchSettings:
    """The Megatron-LM settings a bucket case stands for (its grads are 16-bit, reduced in
    their own dtype); a case reduced in another dtype stands for that torch setting."""
    config = case.config
    torch_api = () if case.reduce_dtype is None else (f"reduce_dtype={case.reduce_dtype}",)
    return LaunchSettings(
        dims=ParallelDims(dp_size=case.size), params_dtype="bfloat16", grad_dtype="bfloat16",
        torch_api=torch_api,
        use_distributed_optimizer=config.use_distributed_optimizer,
        overlap_grad_reduce=config.overlap_grad_reduce,
        ddp_reduce_scatter_with_fp32_accumulation=config.reduce_scatter_with_fp32_accumulation,
        ddp_average_in_collective=config.megatron_flags().average_in_collective,
        calculate_per_token_loss=config.megatron_flags().calculate_per_token_loss,
        has_output_layer=False, after_fp32_accumulating_ddp=case.after_fp32)


def bucket_worker(rank: int, world_size: int, case: BucketCase, candidate: Candidate,
                  seed: int) -> dict:
    """In a rank of a world of ``case.size`` ranks: the reduced values this rank holds per
    (dtype, iteration), or why the candidate refuses the case up front. A case ``after_fp32``
    first reduces once through a DDP with the fp32-accumulating reduce-scatter in this same
    process (a direct use of the API no launch makes). What the candidate raises is not
    caught: it ends the world and is the case's crash."""
    del world_size
    held: dict = {}
    with candidate.grad_reduction() as reduction:
        try:
            if case.after_fp32:
                grads = INPUTS["rank"](rank, case.size, case.size * BUCKET_SHARD, torch.bfloat16,
                                       0, seed)
                reduction.bucket_reduction(FP32_PRESCALED)(grads, group=None)
            reduce = (reduction.bucket_reduction(case.config) if case.reduce_dtype is None else
                      reduction.reduce_in(case.config, getattr(torch, case.reduce_dtype)))
        except Unsupported as unsupported:  # refused up front: a skip, not a failure
            return {"skip": str(unsupported)}
        for dtype_name in case.dtypes:
            for it in range(ITERATIONS):
                grads = INPUTS[case.inputs](rank, case.size, case.size * BUCKET_SHARD,
                                            getattr(torch, dtype_name), it, seed)
                held[(dtype_name, it)] = reduce(grads, group=None)
    return {"held": held}


def _documented(behaviour: Mapping[Behaviour, DocumentedBehaviour], case: BucketCase
                ) -> tuple[DocumentedBehaviour | None, tuple[str, ...]]:
    """The candidate's documented behaviours that apply to ``case``, joined into one, and the
    names of the models they call for (``prescale``, ``wire``, ``compress_hook``,
    ``divide_factors``; empty: the spec)."""
    config = case.config
    if case.reduce_dtype is not None and not config.use_distributed_optimizer:
        applying = {"compress_hook": behaviour.get(Behaviour.COMPRESS_HOOK)}
    elif Behaviour.DIVIDE_FACTORS in behaviour and config.averaging.averages:
        applying = {"divide_factors": behaviour[Behaviour.DIVIDE_FACTORS],
                    "wire": behaviour.get(Behaviour.WIRE_COLLECTIVE)}
    else:
        applying = {"prescale": behaviour.get(Behaviour.PRESCALE) if config.averaging is Averaging.PRESCALE
                    else None,
                    "wire": None if config.reduce_scatter_with_fp32_accumulation
                    else behaviour.get(Behaviour.WIRE_COLLECTIVE)}
    applying = {name: b for name, b in applying.items() if b is not None}
    if not applying:
        return None, ()
    parts = list(applying.values())
    joined = DocumentedBehaviour("; then ".join(b.summary for b in parts),
                                 "; ".join(b.where for b in parts))
    return joined, tuple(applying)


def _expected(case: BucketCase, inputs: list[torch.Tensor], models: tuple[str, ...]
              ) -> list[torch.Tensor]:
    """Per rank, the values refgrad gives it: the spec (no models) or refgrad's model of the
    documented behaviours ``models`` names (gloo's order: the reverse ring)."""
    config, size = case.config, case.size
    order = "rank" if size <= 2 else "gloo_ring"
    if "compress_hook" in models:
        return reduce_torch.compress_hook_all_reduce(inputs, getattr(torch, case.reduce_dtype),
                                                     order=order)
    if "divide_factors" in models:
        return reduce_torch.fsdp2_reduce_scatter(
            inputs, reduce_dtype=None if case.reduce_dtype is None else getattr(torch, case.reduce_dtype),
            orig_dtype=inputs[0].dtype, order=order)
    reduce = refc.reduce_scatter if config.use_distributed_optimizer else refc.all_reduce
    op = spec_averaging(config)
    pre_scale = config.averaging.factors(size).pre_scale
    if "prescale" in models and pre_scale is not None:
        inputs, op = refc.prescale_like_torch(inputs, pre_scale), Averaging.SUM
    accumulate, order = ("wire", order) if "wire" in models else ("fp32", "rank")
    return reduce(inputs, accumulate=accumulate, order=order, op=op)


def bucket_references(cases: list[BucketCase], behaviour: Mapping[Behaviour, DocumentedBehaviour], seed: int
                      ) -> dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor | None]]:
    """refgrad's spec and (where the candidate documents a behaviour) its model, per
    (case index, dtype, iteration); cases with the same inputs and arithmetic share one
    computation."""
    done: dict[tuple, torch.Tensor] = {}
    out = {}
    for index, case in enumerate(cases):
        documented, models = _documented(behaviour, case)
        for dtype_name in case.dtypes:
            for it in range(ITERATIONS):
                inputs = None
                values = []
                for chosen in ((), models) if documented else ((),):
                    key = (case.size, case.inputs, spec_averaging(case.config),
                           case.config.use_distributed_optimizer, dtype_name, it, chosen,
                           case.reduce_dtype if chosen else None)
                    if key not in done:
                        if inputs is None:
                            inputs = [INPUTS[case.inputs](r, case.size, case.size * BUCKET_SHARD,
                                                          getattr(torch, dtype_name), it, seed)
                                      for r in range(case.size)]
                        done[key] = torch.cat(_expected(case, inputs, chosen))
                    values.append(done[key])
                out[(index, dtype_name, it)] = (values[0], values[1] if documented else None)
    return out


def bucket_references_process(rank: int, world: int, cases: list[BucketCase],
                              behaviour: Mapping[Behaviour, DocumentedBehaviour], seed: int) -> dict:
    """:func:`bucket_references` in a process of its own (``spawn`` with one rank)."""
    return bucket_references(cases, behaviour, seed)


def check_bucket_cases(rec: CheckRecorder, outcomes: list[ItemOutcome], cases: list[BucketCase],
                       behaviour: Mapping[Behaviour, DocumentedBehaviour], expected: dict,
                       candidate: Candidate) -> None:
    """Every bucket case vs refgrad (``expected``: :func:`bucket_references`), documented
    behaviours classified (module docstring); each case is one case of the report, a crash
    of its world its crash."""
    for index, (case, outcome) in enumerate(zip(cases, outcomes, strict=True)):
        if outcome.crash is None and "skip" in outcome.results[0]:
            rec.skip(f"{case.label}: {outcome.results[0]['skip']}")
            continue
        with rec.case(case.label, case_settings(case)):
            if outcome.crash is not None:
                rec.crash(case.label, outcome.crash, candidate)
                continue
            documented = _documented(behaviour, case)[0]
            for dtype_name in case.dtypes:
                for it in range(ITERATIONS):
                    spec, model = expected[(index, dtype_name, it)]
                    got = torch.cat([run["held"][(dtype_name, it)] for run in outcome.results])
                    rec.compare_documented(
                        f"{case.label} vs refgrad's DP {spec_averaging(case.config)}: {dtype_name} it={it}",
                        spec, got, documented=documented, documented_reference=model)

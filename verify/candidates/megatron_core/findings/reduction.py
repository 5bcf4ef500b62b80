"""Megatron-Core's DP gradient reduction (``reduction`` driver) held to refgrad.

The spec is the DP mean of the ranks' gradients as ``refgrad.reduce_scatter`` computes
it with ``op="avg"``: an fp32 sum in rank order, one division by W, one rounding to
the grad dtype. Megatron-Core computes something else by design, and each documented
way is a :class:`~verify.candidates.megatron_core.findings.Model`:

* ``average_in_collective=False`` (default): every rank multiplies its bucket by
  ``gradient_scaling_factor = 1/W`` in the grad dtype (``refgrad.reduce_scatter.
  prescale_like_torch``), then the collective SUMs;
* ``average_in_collective=True``: ``ReduceOp.AVG`` in the collective;
* the collective sums in the wire dtype in its own order: gloo's reduce-scatter and
  all-reduce as a ring run backwards (``order="ring_reverse"``, docs/reduce_scatter.md),
  Megatron's ``reduce_scatter_with_fp32_accumulation`` in fp32 in rank order.

At W = 2 with these inputs all of them coincide with the spec (1/2 is exact, one
addition commutes); at W = 3 they do not, so the cases run at both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refgrad import reduce_scatter as refrs
from verify.candidates.megatron_core.findings import Finding, Model, Verdict, classify
from verify.candidates.megatron_core.reduction import ReductionCase, run_reductions

TECHNIQUE = "reduction"
BUFFER = "megatron/core/distributed/param_and_grad_buffer.py"
PRESCALE_WHERE = (f"{BUFFER} _ParamAndGradBucketGroup.start_grad_sync (bucket.grad_data *= "
                  "gradient_scaling_factor, 1/dp from distributed_data_parallel.py "
                  "DistributedDataParallel.__init__), then a SUM collective")
AVG_WHERE = f"{BUFFER} _ParamAndGradBucketGroup.start_grad_sync (ReduceOp.AVG)"
FP32_RS = "megatron.core.distributed.reduce_scatter_with_fp32_accumulation.reduce_scatter_with_fp32_accumulation"
GLOBAL_REBIND_WHERE = (f"{BUFFER} _ParamAndGradBucketGroup.__init__ (`global dist_reduce_scatter_func`"
                       " rebound when reduce_scatter_with_fp32_accumulation is set)")


def bucket_inputs(case: ReductionCase, ranks: Sequence[dict], iteration: int) -> list[list[torch.Tensor]]:
    """Per bucket, each rank's bucket before the reduction: its grads added into a zeroed
    buffer at the index map's places (the hook's ``main_grad.add_(grad)``: exact, except
    that IEEE gives ``+0 + -0 = +0``, so a -0 gradient arrives as +0)."""
    buckets = []
    for b, (start, end, _, _) in enumerate(ranks[0]["shards"]):
        per_rank = []
        for result in ranks:
            x = torch.zeros(end - start, dtype=result["grad_dtype"])
            for i, (p_start, p_end, bucket_id) in enumerate(result["param_index_map"]):
                if bucket_id == b:
                    grad = result["iterations"][iteration]["grads"][i]
                    x[p_start - start:p_end - start] += grad.to(result["grad_dtype"])
            per_rank.append(x)
        buckets.append(per_rank)
    return buckets


def _gloo_order(world: int) -> str:
    return "rank" if world <= 2 else "ring_reverse"


def expectations(case: ReductionCase, inputs: list[torch.Tensor], fp32_rs_in_use: bool
                 ) -> tuple[list[torch.Tensor], list[tuple[str, list[torch.Tensor], str]]]:
    """The spec (per-rank outputs) and the documented production models for one bucket."""
    scatter = case.use_distributed_optimizer
    reduce = refrs.reduce_scatter if scatter else refrs.all_reduce
    spec = reduce(inputs, accumulate="fp32", order="rank", op="avg")
    world = len(inputs)
    if fp32_rs_in_use and scatter:
        accumulate, order, how = "fp32", "rank", f"{FP32_RS} (fp32 sum in rank order)"
    else:
        accumulate, order = "wire", _gloo_order(world)
        how = f"gloo's collective in the grad dtype ({order} order)"
    models = []
    if case.average_in_collective:
        models.append((f"ReduceOp.AVG through {how}",
                       reduce(inputs, accumulate=accumulate, order=order, op="avg"), AVG_WHERE))
    else:
        prescaled = refrs.prescale_like_torch(inputs, 1.0 / world)
        models.append((f"pre-scale by 1/{world} in {str(case.grad_dtype).removeprefix('torch.')}, "
                       f"then SUM through {how}",
                       reduce(prescaled, accumulate=accumulate, order=order, op="sum"),
                       PRESCALE_WHERE))
    return spec, models


def case_findings(case: ReductionCase, ranks: Sequence[dict]) -> list[Finding]:
    """Every (iteration, bucket) of one case, classified; an error is a finding of its own."""
    if "error" in ranks[0]:
        return [error_finding(case, ranks[0])]
    fp32_rs_in_use = ranks[0]["reduce_scatter_function"] == FP32_RS
    findings = []
    for it in range(case.iterations):
        for b, inputs in enumerate(bucket_inputs(case, ranks, it)):
            spec, models = expectations(case, inputs, fp32_rs_in_use)
            observed, expected_spec, documented = [], [], [[] for _ in models]
            for r, result in enumerate(ranks):
                _, _, first, last = result["shards"][b]
                start = result["shards"][b][0]
                observed.append(result["iterations"][it]["after"][first:last])
                rank_slice = slice(first - start, last - start)
                expected_spec.append(spec[r] if case.use_distributed_optimizer else spec[r][rank_slice])
                for m, (_, outputs, _) in enumerate(models):
                    documented[m].append(outputs[r] if case.use_distributed_optimizer
                                         else outputs[r][rank_slice])
            findings.append(classify(
                TECHNIQUE, f"{case.label()} iteration {it} bucket {b}",
                torch.cat(observed), torch.cat(expected_spec),
                [Model(name, torch.cat(outs), where)
                 for (name, _, where), outs in zip(models, documented)]))
    return findings


def error_finding(case: ReductionCase, result: dict) -> Finding:
    """A configuration Megatron-Core accepted and then refused at the first grad sync."""
    error, at = result["error"], result["raised_at"]
    if case.reduce_scatter_with_fp32_accumulation and "Only 1 bucket" in error:
        return Finding(TECHNIQUE, case.label(), Verdict.PRODUCTION,
                       f"documented limitation, raised at the first grad sync: {error}", at)
    if (case.reduce_scatter_with_fp32_accumulation and case.average_in_collective
            and error.startswith("AssertionError")):
        return Finding(TECHNIQUE, case.label(), Verdict.BUG,
                       "DistributedDataParallelConfig accepts reduce_scatter_with_fp32_accumulation "
                       "with average_in_collective, then the first grad sync fails a bare "
                       f"`assert op == ReduceOp.SUM` ({error or 'AssertionError'})", at)
    return Finding(TECHNIQUE, case.label(), Verdict.BUG, f"raised {error}", at)


def rebind_finding(case: ReductionCase, ranks: Sequence[dict]) -> Finding:
    """Whether a plain DDP built after a fp32-accumulating one still reduces with gloo's
    reduce-scatter, and if not, whether it reduced at all."""
    used = ranks[0].get("reduce_scatter_function", "?")
    name = f"{case.label()} built after a reduce_scatter_with_fp32_accumulation DDP in one process"
    if used != FP32_RS:
        return Finding(TECHNIQUE, name, Verdict.MATCH)
    detail = (f"its buckets reduce-scatter with {FP32_RS} although its config says False: the "
              "first DDP rebound a module global for the rest of the process")
    if "error" not in ranks[0] and case.overlap_grad_reduce and _left_unreduced(case, ranks):
        detail += ("; with overlap_grad_reduce every rank's shard is left holding its OWN "
                   "pre-scaled grads, nothing reduced: start_grad_sync keeps the coalescing "
                   "manager's handle (this config's flag is False), so the fp32 function's "
                   "handle, whose wait() sums and writes the shard, is never waited on")
    return Finding(TECHNIQUE, name, Verdict.BUG, detail, GLOBAL_REBIND_WHERE)


def _left_unreduced(case: ReductionCase, ranks: Sequence[dict]) -> bool:
    """Every rank's shard equals its own input pre-scaled by 1/W, in every iteration."""
    for it in range(case.iterations):
        for b, inputs in enumerate(bucket_inputs(case, ranks, it)):
            prescaled = refrs.prescale_like_torch(inputs, 1.0 / len(inputs))
            for r, result in enumerate(ranks):
                start, _, first, last = result["shards"][b]
                own = prescaled[r][first - start:last - start]
                if not torch.equal(result["iterations"][it]["after"][first:last].view(torch.int16
                                   if own.element_size() == 2 else torch.int32),
                                   own.view(torch.int16 if own.element_size() == 2 else torch.int32)):
                    return False
    return True


def default_cases(quick: bool = False) -> dict[int, list[ReductionCase]]:
    """The cases per DP size, in run order (fp32-accumulating ones last: see ``rebind_finding``)."""
    one_bucket = None
    cases = {
        2: [ReductionCase(2),
            ReductionCase(2, average_in_collective=True),
            ReductionCase(2, grad_reduce_in_fp32=True),
            ReductionCase(2, use_distributed_optimizer=False, bucket_size=100),
            ReductionCase(2, overlap_grad_reduce=False)],
        3: [ReductionCase(3),
            ReductionCase(3, average_in_collective=True),
            ReductionCase(3, grad_reduce_in_fp32=True),
            ReductionCase(3, reduce_scatter_with_fp32_accumulation=True, bucket_size=one_bucket),
            ReductionCase(3, reduce_scatter_with_fp32_accumulation=True, bucket_size=100),
            ReductionCase(3, reduce_scatter_with_fp32_accumulation=True, average_in_collective=True),
            ReductionCase(3)],
    }
    if quick:
        cases[2] = cases[2][:2]
    return cases


def run(quick: bool = False, *, timeout_s: float = 240.0) -> list[Finding]:
    """Every default case through Megatron-Core on gloo ranks, classified."""
    findings = []
    for _, cases in default_cases(quick).items():
        results = run_reductions(cases, timeout_s=timeout_s)
        after_fp32 = False
        for case, ranks in zip(cases, results):
            if case.reduce_scatter_with_fp32_accumulation:
                after_fp32 = True
            elif after_fp32:
                findings.append(rebind_finding(case, ranks))
            findings.extend(case_findings(case, ranks))
    return findings

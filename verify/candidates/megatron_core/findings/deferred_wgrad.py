"""Megatron-Core's deferred output-layer wgrad and drain (``deferred_wgrad`` driver) vs refgrad.

The spec is ``refgrad.deferred_wgrad.reference_main_grad``: per microbatch the exact
``Gᵀ·X`` rounded to fp32 and one fp32 add into ``main_grad``, in production's order
(the immediately computed microbatches ``limit..M-1`` in their backward passes, then
the deferred ``0..limit-1`` at the drain: ``deferred_accumulation_order``). With
small-integer inputs every partial sum is exact and the comparison is bitwise; with
normal inputs the CPU GEMM's summation order is not refgrad's, and the two may differ
by at most ``fastgrad_error_factor(T, M) · Σ|G||X|`` per element (Higham's bound for
the inner products and the adds; docstring of refgrad.deferred_wgrad).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import torch

from refgrad.deferred_wgrad import (
    deferred_accumulation_order,
    fastgrad_error_factor,
    reference_main_grad,
)
from verify.candidates.megatron_core.deferred_wgrad import DeferredWgradCase, run_deferred_wgrad
from verify.candidates.megatron_core.findings import Finding, Verdict, classify

TECHNIQUE = "deferred_wgrad"
DRAIN = "megatron/core/utils.py drain_embedding_wgrad_compute"


def total_inputs(case: DeferredWgradCase, ranks: Sequence[dict], step: int) -> list[torch.Tensor]:
    """Microbatch k's full layer input: the TP ranks' sequence shards concatenated under SP."""
    per_rank = [r["steps"][step]["inputs"] for r in ranks]
    if not case.sequence_parallel:
        return per_rank[0]
    return [torch.cat([inputs[k] for inputs in per_rank], dim=0) for k in range(case.num_microbatches)]


def order(case: DeferredWgradCase) -> list[int]:
    if not case.defer:
        return list(range(case.num_microbatches))
    return deferred_accumulation_order(case.num_microbatches, case.wgrad_deferral_limit)


def _within_bound(case, observed, expected, grads, inputs) -> tuple[bool, str]:
    """``|observed - expected| <= c · Σ_k |G_k|ᵀ|X_k|`` elementwise (c: fastgrad_error_factor)."""
    tokens = case.sequence * case.batch
    c = fastgrad_error_factor(tokens, case.num_microbatches)
    mass = sum(torch.mm(g.double().abs().reshape(tokens, -1).t(), x.double().abs().reshape(tokens, -1))
               for g, x in zip(grads, inputs))
    bound = mass * float(Fraction(c))
    err = (observed.double() - expected.double()).abs()
    worst = float((err - bound).max())
    return worst <= 0, f"max |diff| {float(err.max()):.3g} within the bound (c = {float(c):.3g})" \
        if worst <= 0 else f"max |diff| {float(err.max()):.3g} exceeds the bound by {worst:.3g}"


def case_findings(case: DeferredWgradCase, ranks: Sequence[dict]) -> list[Finding]:
    findings = []
    for step in range(case.steps):
        inputs = total_inputs(case, ranks, step)
        for result in ranks:
            record = result["steps"][step]
            name = f"{case.label()} step {step} tp_rank {result['tp_rank']}"
            if "error" in record:
                findings.append(error_finding(case, name, record, inputs))
                continue
            expected = reference_main_grad(record["grads"], inputs, order=order(case))
            if case.inputs == "integers":
                findings.append(classify(TECHNIQUE, name, record["main_grad"], expected))
                continue
            ok, detail = _within_bound(case, record["main_grad"], expected, record["grads"], inputs)
            findings.append(Finding(TECHNIQUE, name, Verdict.MATCH if ok else Verdict.BUG, detail))
    return findings


def error_finding(case: DeferredWgradCase, name: str, record: dict, inputs: list[torch.Tensor]
                  ) -> Finding:
    """The drain raised: say so, and whether the deferred microbatches' wgrads were lost
    (``main_grad`` holds exactly refgrad's sum over the immediately computed ones)."""
    deferred = record["deferred"]
    what = f"the drain raised {record['error']} with {deferred} deferred microbatch(es)"
    immediate = order(case)[:case.num_microbatches - deferred]
    kept = reference_main_grad([record["grads"][k] for k in immediate],
                               [inputs[k] for k in immediate],
                               main_grad_init=torch.zeros_like(record["main_grad"]))
    if torch.equal(kept, record["main_grad"]) and record["left_in_buffers"] == (0, 0):
        what += ("; main_grad holds only the immediately computed microbatches: the deferred "
                 "wgrads are lost and both buffers emptied (a caller that catches the error "
                 "trains on them silently)")
    return Finding(TECHNIQUE, name, Verdict.BUG, what, record.get("raised_at", DRAIN))


def default_cases(quick: bool = False) -> dict[int, list[DeferredWgradCase]]:
    cases = {
        1: [DeferredWgradCase(4), DeferredWgradCase(4, wgrad_deferral_limit=2),
            DeferredWgradCase(3, defer=False), DeferredWgradCase(4, inputs="normal"),
            DeferredWgradCase(4, wgrad_deferral_limit=1), DeferredWgradCase(1)],
        2: [DeferredWgradCase(4, tensor_parallel=2, sequence_parallel=True),
            DeferredWgradCase(4, tensor_parallel=2, sequence_parallel=True, wgrad_deferral_limit=3),
            DeferredWgradCase(3, tensor_parallel=2)],
    }
    if quick:
        cases[2] = cases[2][:1]
    return cases


def run(quick: bool = False, *, timeout_s: float = 180.0) -> list[Finding]:
    findings = []
    for _, cases in default_cases(quick).items():
        for case, ranks in zip(cases, run_deferred_wgrad(cases, timeout_s=timeout_s)):
            findings.extend(case_findings(case, ranks))
    return findings

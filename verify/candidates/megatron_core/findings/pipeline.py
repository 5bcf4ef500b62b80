"""Megatron-Core's 1F1B schedules with DDP grad sync (``pipeline`` driver) vs refgrad.

Per step, refgrad's reference starts from the params Megatron-Core holds at the start of
that step (so each step's gradients are judged on their own, whatever the optimizer did
before), and runs ``refgrad.pipeline_mixed``: the whole ``P * V``-stage model in one
process in bf16, each replica's grads added microbatch by microbatch into an fp32 buffer
(the deferred head's wgrads at the flush, in ``deferred_accumulation_order``), the DP
reduction pre-scaled by ``1/D`` in the grad dtype and summed (``reduction="prescale"``,
Megatron's default: at D = 2 the correctly rounded mean). Every parameter's reduced
``main_grad``, assembled from the DP ranks' owned shards, is compared bitwise, and so
are the losses and the params (equal on every DP rank after the optimizer's all-gather).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refgrad.pipeline import StageModule, stage_param_name
from refgrad.pipeline_mixed import mixed_reduce_and_tie, mixed_replica_grad_sums
from verify.candidates.megatron_core.findings import Finding, Verdict, classify, expect_equal
from verify.candidates.megatron_core.pipeline import PipelineCase, run_pipeline

TECHNIQUE = "pipeline"
DRAIN_AFTER_SYNC = ("megatron/core/pipeline_parallel/schedules.py "
                    "forward_backward_pipelining_without_interleaving / _with_interleaving: "
                    "config.grad_sync_func (or the hooks' bucket launch) before "
                    "finish_embedding_wgrad_compute (the drain)")


def _stage_params(ranks: Sequence[dict], step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    for r in ranks:
        if r["dp_rank"] == dp_rank:
            params.update(r["steps"][step]["params"])
    return params


def reference_step(case: PipelineCase, params: dict[str, torch.Tensor], step: int
                   ) -> tuple[dict[str, torch.Tensor], list[list[float]], list[dict]]:
    """refgrad's reduced grads, losses and per-replica grad sums for ``step``, starting from
    ``params`` (bf16)."""
    spec = case.spec
    stages = [StageModule(spec, s) for s in range(spec.num_stages)]
    named = {stage_param_name(s, n): p for s, st in enumerate(stages) for n, p in st.named_parameters()}
    head = None
    with torch.no_grad():
        for name, p in named.items():
            p.data = params[name].clone()
    if spec.output_head:
        head_name = next(n for n in params if n.endswith("head.weight"))
        head = params[head_name].clone().requires_grad_(True)
        named[head_name] = head
    per_replica, losses = mixed_replica_grad_sums(
        spec, stages, named, head, step, case.num_microbatches, case.data_parallel,
        grad_dtype=torch.float32 if case.grad_reduce_in_fp32 else torch.bfloat16)
    return mixed_reduce_and_tie(spec, per_replica, "prescale"), losses, per_replica


def _assembled(ranks: Sequence[dict], step: int, name: str, pp_rank: int) -> torch.Tensor:
    """One param's reduced grad from the DP ranks' owned pieces (NaN where none owns it)."""
    full = None
    for r in ranks:
        if r["pp_rank"] != pp_rank or name not in r["steps"][step]["grads"]:
            continue
        grad, (lo, hi) = r["steps"][step]["grads"][name]
        if full is None:
            full = torch.full((grad.numel(),), float("nan"), dtype=grad.dtype)
        full[lo:hi] = grad.flatten()[lo:hi]
    return full


def case_findings(case: PipelineCase, ranks: Sequence[dict]) -> list[Finding]:
    findings = []
    for step in range(case.steps):
        params0 = _stage_params(ranks, step, 0)
        for d in range(1, case.data_parallel):
            findings.append(expect_equal(
                TECHNIQUE, f"{case.label()} step {step}: params equal on DP rank 0 and {d}",
                {k: v.view(torch.int16).tolist() for k, v in _stage_params(ranks, step, d).items()},
                {k: v.view(torch.int16).tolist() for k, v in params0.items()}))
        reduced, losses, per_replica = reference_step(case, params0, step)
        for r in ranks:
            if r["pp_rank"] == case.pipeline_parallel - 1 and r["steps"][step]["losses"]:
                got = [float(torch.tensor(x, dtype=torch.float32) / case.num_microbatches)
                       for x in r["steps"][step]["losses"]]
                findings.append(expect_equal(
                    TECHNIQUE, f"{case.label()} step {step}: losses of DP rank {r['dp_rank']}",
                    got, losses[r["dp_rank"]]))
        owner = {name: r["pp_rank"] for r in ranks for name in r["steps"][step]["grads"]}
        for name in sorted(reduced):
            observed = _assembled(ranks, step, name, owner[name])
            finding = classify(TECHNIQUE, f"{case.label()} step {step}: reduced grad {name}",
                               observed, reduced[name].flatten())
            if finding.verdict is Verdict.BUG and name.endswith("head.weight"):
                finding = Finding(TECHNIQUE, finding.name, Verdict.BUG,
                                  finding.detail + "; the deferred head wgrads are drained into "
                                  "main_grad after its bucket's reduce-scatter was launched: "
                                  + _head_diagnosis(ranks, step, name, per_replica),
                                  DRAIN_AFTER_SYNC)
            findings.append(finding)
    if case.virtual_pipeline > 1 and case.pipeline_parallel == 2 and not case.overlap_p2p_comm:
        findings = [f if f.verdict is not Verdict.BUG else
                    Finding(TECHNIQUE, f.name, Verdict.BUG, f.detail + "; a stage received another "
                            "transfer's tensor (an input gradient in place of an activation)",
                            BATCHED_P2P_WHERE) for f in findings]
    return findings


BATCHED_P2P_WHERE = ("megatron/core/pipeline_parallel/p2p_communication.py _batched_p2p_ops: at "
                     "PP 2 the previous and the next rank are the same rank, so send_prev/send_next "
                     "(and recv_prev/recv_next) are matched in posting order and swap; known: "
                     "NVIDIA/Megatron-LM issues 1450 (open) and 750")


def _head_diagnosis(ranks: Sequence[dict], step: int, name: str, per_replica: list[dict]) -> str:
    """What each DP rank's owned piece of the head grad holds instead of the reduced value."""
    what = []
    for r in ranks:
        if name not in r["steps"][step]["grads"]:
            continue
        grad, (lo, hi) = r["steps"][step]["grads"][name]
        piece = grad.flatten()[lo:hi]
        own = per_replica[r["dp_rank"]][name].flatten()[lo:hi]
        if torch.equal(piece, own):
            what.append(f"DP rank {r['dp_rank']} holds its OWN unreduced wgrads")
        elif not bool(piece.any()):
            what.append(f"DP rank {r['dp_rank']} holds zeros (the wgrads never reached the reduction)")
        else:
            what.append(f"DP rank {r['dp_rank']} holds neither its own wgrads nor zeros")
    return "; ".join(what)


def default_cases(quick: bool = False) -> list[PipelineCase]:
    cases = [PipelineCase(), PipelineCase(virtual_pipeline=2),
             PipelineCase(virtual_pipeline=2, overlap_p2p_comm=False),
             PipelineCase(output_head=True), PipelineCase(output_head=True, align_grad_reduce=False)]
    return cases[:2] if quick else cases


def run(quick: bool = False, *, timeout_s: float = 300.0) -> list[Finding]:
    findings = []
    for case in default_cases(quick):
        findings.extend(case_findings(case, run_pipeline(case, timeout_s=timeout_s)))
    return findings

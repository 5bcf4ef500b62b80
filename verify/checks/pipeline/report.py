"""The pipeline check's report glue: collecting rank results, the large-D ULP report, timelines and the simulator comparison."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch

from gradvocab import Averaging, RankResult, summarize_step
from refgrad.exact import correctly_rounded_sum, exact_sum
from refgrad.formats import FLOAT32, decode_tensor, gamma
from refgrad.layout import compute_layout as reference_layout
from refgrad.pipeline import (
    StageModule,
    reference_training,
)
from verify.candidates.interfaces import DocumentedBehaviour, PipelineCase
from verify.check import CheckRecorder
from verify.metrics import compare
from verify.studies.pipeline import PipelineCosts, simulate

# ---------------------------------------------------------------- parent side


def concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def collect(case: PipelineCase, ranks: list[dict], overlap: bool) -> dict[str, Any]:
    """Reassemble per-step losses [dp][mb], grads and params (per replica) from the ranks."""
    results = [r[case.name][overlap] for r in ranks if case.name in r]
    steps = len(case.plans)
    losses = [[[] for _ in range(case.dp_size)] for _ in range(steps)]
    grads = [[{} for _ in range(case.dp_size)] for _ in range(steps)]
    params = [[{} for _ in range(case.dp_size)] for _ in range(steps)]
    for res in results:
        for step in range(steps):
            if res.stage == case.pp_size - 1:
                losses[step][res.dp_rank] = res.losses[step]
            grads[step][res.dp_rank].update(res.grads[step])
            params[step][res.dp_rank].update(res.params[step])
    return {"losses": losses, "grads": grads, "params": params, "ranks": results}


def site_counts(sites: list[list[tuple[str, ...]]]) -> str:
    """'where buckets launched' summed over ranks, per step: e.g. step 1: hook=6 dispatch=2."""
    parts = []
    for step in range(len(sites[0]) if sites else 0):
        counts: dict[str, int] = {}
        for per_rank in sites:
            for site in per_rank[step]:
                counts[site] = counts.get(site, 0) + 1
        parts.append(f"step {step}: " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return "; ".join(parts)


def flatten_losses(losses: list[list[list[float]]]) -> torch.Tensor:
    return torch.tensor([v for step in losses for replica in step for v in replica], dtype=torch.float32)


def flatten_named(per_step: list[list[dict[str, torch.Tensor]]], names: list[str]) -> torch.Tensor:
    return concat([replica[n] for step in per_step for replica in step for n in names])


def large_dp_report(rec: CheckRecorder, case: PipelineCase, ranks: list[dict]) -> None:
    """D > 2: the all-reduce's summation order is gloo's choice, so no bitwise claim.

    Step 0 starts from identical weights, so its per-replica grad sums are
    exactly refgrad's. Any order of fp32 recursive summation of D values lies
    within ``gamma(D-1) * sum|x_d|`` of the exact sum (Higham, Accuracy and
    Stability, eq. 4.4); every element must meet that bound. The ULP distance to
    the correctly rounded sum is reported, not bounded: under cancellation the
    bound above is many ULPs of a small result. Later steps start from weights
    that already differ in the last bits, so they are only checked for overlap
    on vs off.
    """
    ref = reference_training(case.spec, case.plans[:1], case.dp_size, lr=case.lr, reduction=Averaging.SUM)
    names = sorted(ref.grads[0])
    replicas = [concat([sums[n] for n in names]) for sums in ref.replica_sums[0]]
    rounded = correctly_rounded_sum(replicas, torch.float32)
    decoded = [decode_tensor(r) for r in replicas]
    exact = [exact_sum(vals) for vals in zip(*decoded)]
    relative_bound = gamma(case.dp_size - 1, FLOAT32.unit_roundoff)
    bound = [relative_bound * exact_sum(abs(v) for v in vals) for vals in zip(*decoded)]
    rows = []
    results = {}
    for overlap in (True, False):
        got = collect(case, ranks, overlap)
        results[overlap] = got
        for replica in range(case.dp_size):
            cand = concat([got["grads"][0][replica][n] for n in names])
            errors = [abs(Fraction(c) - e) for c, e in zip(decode_tensor(cand), exact)]
            within = all(err <= b for err, b in zip(errors, bound))
            worst = max((err / b for err, b in zip(errors, bound) if b > 0), default=Fraction(0))
            tag = f"{case.name}, overlap {'on' if overlap else 'off'}, replica {replica}"
            rec.expect(f"{tag}: step-0 grads within gamma(D-1)*sum|x| of the exact sum",
                       within, f"largest error / bound = {float(worst):.3g}")
            cmp = compare(rounded, cand)
            rows.append([tag, cmp.max_ulp, cmp.n_mismatch, cmp.n, cmp.bitwise_equal])
        rec.compare(f"{case.name}, overlap {'on' if overlap else 'off'}: step-0 losses vs refgrad",
                    flatten_losses(ref.losses), flatten_losses(got["losses"][:1]))
    on, off = results[True], results[False]
    step0 = compare(concat([off["grads"][0][0][n] for n in names]),
                    concat([on["grads"][0][0][n] for n in names]))
    every = compare(flatten_named(off["grads"], names), flatten_named(on["grads"], names))
    rows.append(["overlap on vs off, step 0", step0.max_ulp, step0.n_mismatch, step0.n,
                 step0.bitwise_equal])
    rows.append(["overlap on vs off, all steps", every.max_ulp, every.n_mismatch, every.n,
                 every.bitwise_equal])
    if not every.bitwise_equal:
        rec.note(
            f"{case.name}: overlap on and off give different grads (max {every.max_ulp} ULP over "
            f"{len(case.plans)} steps). gloo's all-reduce splits each message into per-rank "
            "chunks, so an element's summation order depends on its offset inside its bucket, "
            "and overlap off uses one bucket while overlap on uses several: production's "
            "'loss differs with overlap on vs off' for D > 2. An order-fixed reduction "
            "(the fp32-accumulating reduce-scatter, rank order) is bitwise in both modes."
        )
    rec.table(f"{case.name}: step-0 reduced grads vs the correctly rounded sum",
              ["candidate", "max ULP", "mismatches", "elements", "bitwise"], rows,
              notes=["gloo picks the all-reduce algorithm (and so the summation order) for D > 2"])


def has_timelines(case: PipelineCase, ranks: list[dict]) -> bool:
    """Every rank of ``case`` recorded a timeline for every step (a candidate may record none)."""
    return all(len(res.events) == len(case.plans) and all(res.events)
               for r in ranks if case.name in r for res in r[case.name].values())


def timeline_rows(case: PipelineCase, ranks: list[dict], step: int = 2) -> list[list[Any]]:
    """Step ``step``'s timeline summary per overlap setting (none without timelines)."""
    if not has_timelines(case, ranks):
        return []
    step = min(step, len(case.plans) - 1)  # a case with fewer steps reports its last one
    rows = []
    for overlap in (True, False):
        events = [e for r in ranks if case.name in r for e in r[case.name][overlap].events[step]]
        report = summarize_step(events)
        rows.append([case.name, "on" if overlap else "off", case.plans[step].num_microbatches,
                     round(report.step_time * 1e3, 3), round(report.bubble_fraction, 3),
                     round(report.exposed_grad_sync * 1e3, 3), round(report.grad_sync_wait * 1e3, 3)])
    return rows


def timing_report(rec: CheckRecorder, case: PipelineCase, ranks: list[dict]) -> None:
    rows = []
    reports = {}
    for overlap in (True, False):
        per_rank = [r[case.name][overlap] for r in ranks if case.name in r]
        # Step 0 warms up allocators and gloo connections; report the later steps.
        for step in range(1, len(case.plans)):
            events = [e for res in per_rank for e in res.events[step]]
            report = summarize_step(events)
            reports.setdefault(overlap, []).append(report)
    for overlap, reps in reports.items():
        best = min(reps, key=lambda r: r.step_time)
        rows.append([
            "on" if overlap else "off",
            round(best.step_time * 1e3, 3),
            round(best.bubble_fraction, 4),
            round(best.exposed_grad_sync * 1e3, 3),
            round(best.grad_sync_wait * 1e3, 3),
            round(best.mean_forward * 1e3, 3),
            round(best.mean_backward * 1e3, 3),
        ])
    on = min(reports[True], key=lambda r: r.step_time)
    off = min(reports[False], key=lambda r: r.step_time)
    rec.table(
        f"measured 1F1B timelines, {case.name}, M={case.plans[1].num_microbatches} (best of "
        f"{len(reports[True])} steps, ms)",
        ["overlap", "step", "bubble", "exposed sync", "sync wait", "mean fwd", "mean bwd"],
        rows,
        notes=[
            "exposed sync = step end - end of the last compute on any rank (what the sync adds "
            "to the critical path); sync wait = longest finish_grad_sync on one rank",
            "gloo on a shared 2-core machine: absolute times are noisy, compare within the table",
        ],
    )
    costs = PipelineCosts(
        forward=on.mean_forward,
        backward=on.mean_backward,
        grad_sync=off.grad_sync_wait,
        num_buckets=4,
    )
    m = case.plans[1].num_microbatches
    predicted_on = simulate(case.pp_size, m, costs, "overlap")
    predicted_off = simulate(case.pp_size, m, costs, "after-compute")
    rec.table(
        "simulator vs measured (same costs: measured mean fwd/bwd, overlap-off sync time)",
        ["overlap", "measured step ms", "simulated step ms", "ratio", "measured bubble",
         "simulated bubble"],
        [
            ["on", round(on.step_time * 1e3, 3), round(predicted_on.step_time * 1e3, 3),
             round(on.step_time / predicted_on.step_time, 3), round(on.bubble_fraction, 4),
             round(predicted_on.bubble_fraction, 4)],
            ["off", round(off.step_time * 1e3, 3), round(predicted_off.step_time * 1e3, 3),
             round(off.step_time / predicted_off.step_time, 3), round(off.bubble_fraction, 4),
             round(predicted_off.bubble_fraction, 4)],
        ],
        notes=["the simulator ignores point-to-point latency and Python overhead between ops, "
               "so a measured/simulated ratio above 1 is expected"],
    )
    rec.expect(
        "timelines recorded forward, backward and communication events on every rank",
        all(
            {e.kind for e in res.events[1]} >= {"forward", "backward", "grad_sync_wait"}
            for r in ranks if case.name in r for res in r[case.name].values()
        ),
    )


def interleaved_enable_report(rec: CheckRecorder, tag: str, case: PipelineCase,
                               results: list[RankResult], overlap: bool) -> None:
    """Chunks enable their sync once each, in reverse order; with overlap, chunk V-1 is
    already reducing when chunk 0 starts its last backward (its sync hides behind it)."""
    V = case.virtual_stages
    logs = [log for res in results for log in res.chunk_enables]
    if not logs:
        rec.skip(f"{tag}: the candidate recorded no per-chunk grad-sync enables")
        return
    order_ok = all([c for c, _ in log] == list(range(V - 1, -1, -1)) for log in logs)
    rec.expect(f"{tag}: chunks enabled their grad sync once each, last chunk first", order_ok,
               f"enable orders: {sorted({tuple(c for c, _ in log) for log in logs})}")
    in_flight = {log[-1][1][V - 1] for log in logs}
    rec.expect(f"{tag}: chunk {V - 1} {'was' if overlap else 'was not'} reducing when chunk 0 "
               "started its last backward", in_flight == {overlap},
               f"chunk {V - 1} in flight at chunk 0's enable: {sorted(in_flight)}")


def differing_steps(reference_grads: list[dict[str, torch.Tensor]], got: dict[str, Any]) -> str:
    """Which steps' reduced grads differ from refgrad, and in which params (for the report
    of a failed comparison: a step that raised, or one wrong param, shows here)."""
    parts = []
    for step, reference in enumerate(reference_grads):
        names = sorted(n for n, value in reference.items()
                       if any(not compare(value, replica[n]).bitwise_equal
                              for replica in got["grads"][step]))
        if names:
            parts.append(f"step {step}: {', '.join(names)}")
    return "reduced grads differ from refgrad at " + ("; ".join(parts) or "no step")


def chunk_param_numels(case: PipelineCase, stage: int, chunk: int) -> tuple[list[int], list[int]]:
    """One model chunk's param sizes in registration order (refgrad's stage module, then the
    output head) and the registration indices of the tied embedding's copy (TP 1)."""
    spec = case.spec
    virtual = chunk * case.pp_size + stage
    numels = [p.numel() for p in StageModule(spec, virtual).parameters()]
    shared = [0] if spec.tied_embedding and virtual == 0 else []  # layers.0.weight comes first
    if spec.output_head and virtual == spec.num_stages - 1:
        numels.append(spec.hidden * spec.hidden)
        if spec.tied_embedding:
            shared.append(len(numels) - 1)
    return numels, shared


def _bucket_count(case: PipelineCase, stage: int, overlap: bool, one_after_first: bool) -> int:
    """Buckets refgrad's layout gives one pipeline rank (all its chunks): each chunk at the
    case's bucket size (with ``one_after_first``: only pipeline rank 0's first chunk; every
    other chunk one bucket), without overlap one bucket (DDP's rule)."""
    count = 0
    for chunk in range(case.virtual_stages):
        numels, shared = chunk_param_numels(case, stage, chunk)
        bucket_size = case.bucket_size_for(stage, chunk) if overlap else None
        if one_after_first and (stage, chunk) != (0, 0):
            bucket_size = None
        count += len(reference_layout(numels, dp_size=case.dp_size, bucket_size=bucket_size,
                                      use_distributed_optimizer=case.use_distributed_optimizer,
                                      pad_buckets_for_high_nccl_busbw=False,
                                      shared_embedding=shared).bucket_indices)
    return count


def bucket_count_expectation(rec: CheckRecorder, tag: str, case: PipelineCase,
                             results: list[RankResult], overlap: bool,
                             documented: DocumentedBehaviour) -> None:
    """Each rank's bucket count (one launch site per bucket) against refgrad's layout of its
    chunks, for a candidate that documents one bucket on every stage and chunk after the
    first: held to that model, the departure from the case's bucket size recorded."""
    if case.tp_size > 1 or any(not res.launch_sites for res in results):
        rec.skip(f"{tag}: no bucket count to hold to refgrad's layout (TP > 1, or no launch sites)")
        return
    rows = [(res.stage, res.dp_rank, len(res.launch_sites[0]),
             _bucket_count(case, res.stage, overlap, False),
             _bucket_count(case, res.stage, overlap, True)) for res in results]
    rec.expect_documented(
        f"{tag}: buckets per rank vs refgrad's layout", all(r[2] == r[3] for r in rows),
        documented=documented, documented_holds=all(r[2] == r[4] for r in rows),
        detail="(stage, DP rank): buckets, refgrad at the case's bucket size, one bucket after "
               "the first stage: " + ", ".join(f"({s}, {d}): {n}, {spec}, {model}"
                                               for s, d, n, spec, model in sorted(rows)))

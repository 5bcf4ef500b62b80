"""The ``optim`` check's run function and report glue (see the package docstring)."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from gradvocab import ParallelDims
from refgrad import optim as R
from refgrad.formats import tensor_bit_patterns
from verify.candidates import Candidate, LaunchSettings, Technique, Unsupported
from verify.candidates.interfaces import (
    OPTIMIZER_BEHAVIOURS,
    Behaviour,
    DistributedOptimizerStep,
    DocumentedBehaviour,
)
from verify.check import Check, CheckContext, CheckRecorder, launcher_for, run_part
from verify.checks.optim.cases import CHECKPOINT_CASE, MIXED, NAMES, OptimCase, case_matrix
from verify.checks.optim.compare import (
    Documented,
    check_case,
    compare_snapshot,
    flat,
    same_on_every_rank,
)
from verify.checks.optim.expectations import ProductionModel, case_trajectory
from verify.checks.optim.mxfp8 import compare_runs, refgrad_trajectory
from verify.checks.optim.records import CaseResult, CaseRun, RankRuns, Refused
from verify.checks.optim.worker import (
    MXFP8_LABEL,
    RESUME_AFTER,
    WorldPlan,
    as_four_ranks,
    rank_worker,
    resumed_label,
    world_checkpoint,
    world_plans,
)
from verify.distributed import RankCrashed, spawn, spawn_each
from verify.metrics import bitwise_equal

CHECK_NAME = "optim"


def _reported_norms(runs: list[CaseResult] | None) -> tuple[float | None, ...] | None:
    """The grad norm of each step as the first rank reported it (None: no run, or refused)."""
    if not runs or not isinstance(runs[0], CaseRun):
        return None
    return tuple(r.outcome.grad_norm for r in runs[0].steps)


def _references(cases: list[OptimCase], seed: int, norms: dict | None = None) -> dict:
    """refgrad's trajectory of every case, and of the DP=3 run resumed from the DP=2 checkpoint.

    ``norms`` (``{"cases": [each case's reported norms], "dp3": the resumed run's,
    "torch_clip": torch.nn.utils' clip coefficient}``): the trajectories of refgrad's model of
    the candidate's documented optimizer instead, clipped with the norms it reported."""
    out: dict = {"cases": []}
    for index, case in enumerate(cases):
        torch_clip = bool(norms and norms.get("torch_clip"))
        model = None if norms is None else ProductionModel(norms["cases"][index], torch_clip)
        if case == CHECKPOINT_CASE:
            head = None if model is None else ProductionModel(model.norms and model.norms[:RESUME_AFTER],
                                                              torch_clip)
            tail = None if model is None else ProductionModel(model.norms and model.norms[RESUME_AFTER:],
                                                              torch_clip)
            first, after = case_trajectory(case, seed, worlds=[case.dp] * RESUME_AFTER, production=head)
            after = copy.deepcopy(after)
            rest, _ = case_trajectory(case, seed, start=copy.deepcopy(after), first_step_id=RESUME_AFTER,
                                      production=tail)
            out["cases"].append(first + rest)
            dp3_case = dataclasses.replace(CHECKPOINT_CASE, ranks=(0, 1, 2))
            dp3_model = None if norms is None else ProductionModel(norms["dp3"], torch_clip)
            out["dp3"] = (dp3_case, case_trajectory(dp3_case, seed, start=copy.deepcopy(after),
                                                    first_step_id=RESUME_AFTER, production=dp3_model)[0])
        else:
            out["cases"].append(case_trajectory(case, seed, production=model)[0])
    return out


def _references_process(rank: int, world: int, cases: list[OptimCase], seed: int,
                        norms: dict | None = None) -> dict:
    """:func:`_references` in a process of its own (``spawn`` with one rank, no candidate code)."""
    return _references(cases, seed, norms)


def _check_resumes(rec: CheckRecorder, per_rank: list[RankRuns], cases: list[OptimCase], expected: dict,
                   documented: Documented) -> None:
    """The DP=2 checkpoint resumed at DP=2 (== the uninterrupted run) and at DP=3 (== refgrad)."""
    taken = per_rank[0].cases.get(cases.index(CHECKPOINT_CASE))
    if taken is None:
        return  # its world crashed: recorded as the crash
    if isinstance(taken, Refused):
        return  # the case itself is a SKIP
    if isinstance(taken.checkpoint, Refused):
        rec.skip(f"{CHECKPOINT_CASE.label}: resuming its checkpoint at DP=2 and DP=3: "
                 f"{taken.checkpoint.reason}")
        return
    uninterrupted, checkpoint = taken.snapshots, taken.checkpoint
    rec.expect(f"{CHECKPOINT_CASE.label}: a checkpoint after step {RESUME_AFTER}", checkpoint is not None)
    for rank in (2, 3):
        dp2 = per_rank[rank].dp2_resumed
        # a resume that did not run (or was refused) shows as one step no run reached
        for k, snap in enumerate(dp2.snapshots if isinstance(dp2, CaseRun) else (None,)):
            step = RESUME_AFTER + k + 1
            label = f"{CHECKPOINT_CASE.label} resumed after step {RESUME_AFTER} (rank {rank}) step {step}"
            before = uninterrupted[step - 1]
            if not rec.expect(f"{label}: both runs reached it", snap is not None and before is not None):
                continue
            rec.compare(f"{label} params == uninterrupted", flat(before.params), flat(snap.params))
            for key in before.state[NAMES[0]]:
                rec.compare(f"{label} {key} == uninterrupted",
                            flat({n: before.state[n][key] for n in NAMES}),
                            flat({n: snap.state[n][key] for n in NAMES}))
    resharded = [per_rank[r].dp3_resumed for r in range(3)]
    all_loaded = all(isinstance(run, CaseRun) and run.loaded is not None for run in resharded)
    if checkpoint is None or not all_loaded:
        rec.expect(f"{CHECKPOINT_CASE.label}: its checkpoint loaded at DP=3 on every rank",
                   checkpoint is not None and all_loaded)
        return
    whole = checkpoint.params
    for rank, run in enumerate(resharded):
        loaded = run.loaded.state
        for key in whole[NAMES[0]]:
            rec.compare(f"optim DP=2 checkpoint loaded at DP=3 (rank {rank}) full {key}",
                        flat({n: whole[n][key] for n in NAMES}), flat({n: loaded[n][key] for n in NAMES}))
        rec.compare(f"optim DP=2 checkpoint loaded at DP=3 (rank {rank}) params == master cast",
                    flat({n: whole[n]["master"].to(MIXED[n]) for n in NAMES}), flat(run.loaded.params))
    dp3_case, want3 = expected["dp3"]
    modelled3 = documented.model
    for k, step_expected in enumerate(want3):
        step = RESUME_AFTER + k + 1
        label = f"{dp3_case.label} resumed from DP=2 step {step}"
        snaps = [r.snapshots[k] for r in resharded]
        if not rec.expect(f"{label}: every rank reached it", all(snap is not None for snap in snaps)):
            continue
        order = documented.order(dp3_case)
        compare_snapshot(rec, label, step_expected, snaps[0], documented=order,
                         model=None if order is None or modelled3 is None else modelled3[k])
        rec.expect(f"{label}: every rank holds the same params and state bitwise", same_on_every_rank(snaps))


def case_settings(case: OptimCase) -> LaunchSettings:
    """The Megatron-LM settings an optimizer case stands for."""
    dtype = "bfloat16" if case.grads == "bf16" else "float16"
    flags = ["--optimizer sgd"] if case.algorithm == "sgd" else []
    flags.append(f"--clip-grad {case.clip if case.clip is not None else 0.0}")  # Megatron-LM: 1.0
    if case.scaled:
        flags.append(f"--hysteresis {case.hysteresis}")
    if case.schedule is not None:
        flags += case.schedule.megatron_flags()
    return LaunchSettings(
        dims=ParallelDims(dp_size=case.dp), params_dtype=dtype,
        grad_dtype="float32" if case.main_grads_fp32 else dtype, use_distributed_optimizer=True,
        overlap_grad_reduce=case.overlap, overlap_param_gather=case.overlap,
        calculate_per_token_loss=case.averaging.megatron_flags().calculate_per_token_loss,
        has_output_layer=False,
        other_flags=tuple(flags))


def _plan_labels(plan: WorldPlan) -> list[str]:
    """The cases, resumes and extras a world plan runs (how the report names a crash's scope)."""
    labels = [case.label for _, case in plan.cases]
    labels += [resumed_label(r) for r in (plan.dp2_resume_ranks, plan.dp3_resume_ranks) if r]
    return labels + ([MXFP8_LABEL] if plan.extras else [])


def _spawn_plans(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate,
                 cases: list[OptimCase], seed: int, shares_a_world: bool, mxfp8_runs: list
                 ) -> list[RankRuns]:
    """Every world plan in a world of its own, in order (a later world resumes an earlier
    one's checkpoint), laid out as the 4-rank plan. A plan whose world crashed is recorded as
    the crash of the case its failing rank was in (named by the worker), and its cases have
    no results."""
    plans = world_plans(cases, shares_a_world, extras=bool(mxfp8_runs))
    launcher = launcher_for(candidate)
    results: list[list[RankRuns] | None] = []
    checkpoint = None
    for plan in plans:
        resumes = plan.dp2_resume_ranks or plan.dp3_resume_ranks
        if resumes and not plan.cases and checkpoint is None:
            results.append(None)  # no checkpoint to resume from (taken nowhere, or refused)
            continue
        (outcome,) = spawn_each(rank_worker, plan.world, [plan], candidate, seed, mxfp8_runs,
                                checkpoint, isolate=True, timeout_s=ctx.timeout_s,
                                launcher=launcher)
        if outcome.crash is not None:
            _record_crash(rec, candidate, cases, plan, outcome.crash)
            results.append(None)
            continue
        checkpoint = checkpoint or world_checkpoint(plan, outcome.results)
        results.append(outcome.results)
    return as_four_ranks(cases, plans, results)


def _record_crash(rec: CheckRecorder, candidate: Candidate, cases: list[OptimCase],
                  plan: WorldPlan, crash: RankCrashed) -> None:
    """The crash as the case the failing rank named (its note), else as the plan's first."""
    labels = _plan_labels(plan)
    named = [n.removeprefix("in ") for n in crash.first.notes if n.removeprefix("in ") in labels]
    label = named[0] if named else labels[0]
    by_label = {case.label: case for case in cases}
    settings = case_settings(by_label.get(label, CHECKPOINT_CASE))
    with rec.case(label, settings):
        rec.crash(label, crash, candidate)
    others = [other for other in labels if other != label]
    if others:
        rec.skip(f"{', '.join(others)}: not run to the end: their world crashed in {label}")


def check_multi_rank(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate,
                     behaviour: Mapping[Behaviour, DocumentedBehaviour], shares_a_world: bool, *,
                     mxfp8: bool) -> None:
    """The case matrix, the DP=2 resume and the DP=2 -> DP=3 reshard (one 4-rank spawn, or a
    world per DP size for a candidate whose optimizer cannot share one)."""
    cases = case_matrix(ctx.quick)
    seed = ctx.seed % 391  # 391 = 17 * 23: the data patterns' periods
    mxfp8_runs = mxfp8_matrix(ctx.quick) if mxfp8 else []
    # refgrad's (slow, exact) references are computed while the ranks start and train, in a
    # process of their own: pure Python, they would hold this process's interpreter lock
    # against the check that `verify run --jobs` runs beside this one.
    with ThreadPoolExecutor(max_workers=1) as pool:
        references = pool.submit(spawn, _references_process, 1, cases, seed, timeout_s=ctx.timeout_s,
                                 launcher=launcher_for(candidate))
        # One world for every case only where the candidate keeps no process-wide state.
        shared = shares_a_world and not candidate.isolates_configurations
        per_rank = _spawn_plans(ctx, rec, candidate, cases, seed, shared, mxfp8_runs)
        expected = references.result()[0]
    models: dict = {"cases": [None] * len(cases), "dp3": (None, None)}
    if behaviour:  # refgrad's model of its documented optimizer, clipped with its norms
        norms = {"cases": [_reported_norms([per_rank[r].cases[i] for r in case.ranks
                                            if i in per_rank[r].cases])
                           for i, case in enumerate(cases)],
                 "dp3": _reported_norms([per_rank[r].dp3_resumed for r in range(3)
                                         if per_rank[r].dp3_resumed is not None]),
                 "torch_clip": Behaviour.TORCH_CLIP_COEFFICIENT in behaviour}
        models = spawn(_references_process, 1, cases, seed, norms, timeout_s=ctx.timeout_s,
                       launcher=launcher_for(candidate))[0]
    for index, case in enumerate(cases):
        if any(index not in per_rank[r].cases for r in case.ranks):
            continue  # its world crashed: recorded as the crash
        runs = [per_rank[r].cases[index] for r in case.ranks]
        if isinstance(runs[0], Refused):
            rec.skip(f"{case.label}: {runs[0].reason}")
            continue
        with rec.case(case.label, case_settings(case)):
            check_case(rec, case, runs, expected["cases"][index],
                       Documented(behaviour, models["cases"][index]))
    _check_resumes(rec, per_rank, cases, expected, Documented(behaviour, models["dp3"][1]))
    extras_ran = all(per_rank[r].mxfp8 is not None for r in (0, 1))
    if mxfp8_runs and extras_ran:
        check_mxfp8(rec, mxfp8_runs, [per_rank[0].mxfp8, per_rank[1].mxfp8], ctx.timeout_s)


def check_torch_adamw(ctx: CheckContext, rec: CheckRecorder) -> None:
    """Measured, reported: torch.optim.AdamW vs refgrad's spec (= fastgrad, bitwise above)."""
    numel, steps = (64, 3) if ctx.quick else (256, 5)
    rows = []
    for weight_decay in (0.0, 0.1):
        for grad_scale, what in ((1.0, "grads ~ N(0, 1)"), (1e-7, "grads ~ 1e-7 (eps matters)")):
            g = ctx.generator(900 + len(rows))
            param = torch.randn(numel, generator=g)
            grads = [torch.randn(numel, generator=g) * grad_scale for _ in range(steps)]
            h = R.AdamW(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay)
            rows.append([weight_decay, what, numel, steps, R.torch_adamw_ulp_distance(param, grads, h)])
    rec.table(
        "torch.optim.AdamW (foreach=False, CPU) vs refgrad.optim's AdamW: max fp32 ULP on the params",
        ["weight_decay", "grads", "elements", "steps", "max ULP"], rows,
        ["torch uses lerp/addcmul/addcdiv (fused forms), bias corrections in fp64 on the step "
         "size and on sqrt(v)/sqrt(bc2), eps added after that division; fastgrad follows refgrad "
         "(one rounding per op), asserted bitwise by the comparisons of this check",
         "the largest ULP counts sit on params that pass near zero, where one ULP is tiny: "
         "the absolute difference stays about one ULP of 1.0 (2^-23)"],
    )
    worst = max(r[-1] for r in rows)
    rec.note(f"torch.optim.AdamW differs from refgrad's (and fastgrad's) AdamW by up to {worst} "
                f"fp32 ULP on the params within {steps} steps: a different operation order, not a "
                "fastgrad error")


def mxfp8_matrix(quick: bool) -> list[tuple[str, bool, bool]]:
    """(algorithm, sharing, fp32 grads) of the MXFP8 runs: both algorithms, sharing on and off."""
    return [(kind, sharing, grad_fp32) for kind in ("adamw", "sgd") for sharing in (False, True)
            for grad_fp32 in ((True,) if quick else (True, False))]


def _mxfp8_references_process(rank: int, world: int, pickled_inputs: bytes) -> list[dict]:
    """``refgrad_trajectory`` of each ``(algorithm, runs)``, in a process of its own.

    The inputs come pickled by value: as arguments, torch would pass every tensor's
    storage as a file descriptor, more than a process start can carry.
    """
    return [refgrad_trajectory(runs, kind) for kind, runs in pickle.loads(pickled_inputs)]


def _trajectory_inputs(runs: list[dict]) -> bytes:
    """Everything ``refgrad_trajectory`` reads from the runs, as bytes (equal bytes: equal result)."""
    parts = [repr([(run["param_ranges"], run["buckets"]) for run in runs]).encode()]
    for run in runs:
        tensors = [*run["initial"], *(g for step in run["steps"] for g in step["grads"])]
        parts += [repr([(t.dtype, tuple(t.shape)) for t in tensors]).encode(),
                  *(tensor_bit_patterns(t).numpy().tobytes() for t in tensors)]
    return b"|".join(parts)


def check_mxfp8(rec: CheckRecorder, mxfp8_runs: list[tuple[str, bool, bool]],
                per_rank: list[list[dict]], timeout_s: float) -> None:
    """MXFP8 params at DP=2 (ranks 0-1), with and without buffer sharing: masters, optimizer
    state and MXFP8 bits after every step bitwise equal to refgrad; sharing on == off.

    refgrad's trajectory is a function of the algorithm, the initial values and the reduced
    grads only: runs with the same ones bitwise (sharing on and off, when the buffer is
    right) share one computation, done in a process of its own.
    """
    all_runs = [[rank_runs[index] for rank_runs in per_rank] for index in range(len(mxfp8_runs))]
    keys = [(kind, _trajectory_inputs(runs)) for (kind, _, _), runs in zip(mxfp8_runs, all_runs)]
    distinct = list(dict.fromkeys(keys))
    inputs = [(kind, all_runs[keys.index((kind, key))]) for kind, key in distinct]
    trajectories = []
    if inputs:
        trajectories = spawn(_mxfp8_references_process, 1, pickle.dumps(inputs), timeout_s=timeout_s)[0]
    for index, (kind, sharing, grad_fp32) in enumerate(mxfp8_runs):
        runs = all_runs[index]
        label = (f"optim MXFP8 DP=2 {kind} sharing {'on' if sharing else 'off'} "
                 f"grads {'fp32' if grad_fp32 else 'bf16'}")
        rec.expect(f"{label}: the buffer shares param and grad bytes as asked",
                   all(run["sharing"] == sharing for run in runs))
        rec.expect(f"{label}: the ranks' local grads differ (rank-specific data)",
                   not bitwise_equal(runs[0]["steps"][0]["grads"][0], runs[1]["steps"][0]["grads"][0]))
        compare_runs(rec, label, runs, trajectories[distinct.index(keys[index])])
        if sharing and (kind, False, grad_fp32) in mxfp8_runs:
            unshared = mxfp8_runs.index((kind, False, grad_fp32))
            for rank, rank_runs in enumerate(per_rank):
                off, on = rank_runs[unshared]["steps"], rank_runs[index]["steps"]
                rec.expect(f"{label}: grads, masters and MXFP8 bits == sharing off, every step (rank {rank})",
                           all(all(bitwise_equal(x, y) for x, y in zip(a["grads"] + a["masters"],
                                                                       b["grads"] + b["masters"]))
                               and all(bitwise_equal(x, y) for p, q in zip(a["bits"], b["bits"])
                                       for x, y in zip(p, q)) for a, b in zip(off, on)))


def run(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate) -> None:
    """The ``optim`` check against ``candidate``'s optimizer (default: fastgrad's)."""
    behaviour, shares_a_world, mxfp8 = run_part(ctx, rec, candidate, _optimizer_facts)
    check_multi_rank(ctx, rec, candidate, behaviour, shares_a_world, mxfp8=mxfp8)
    check_torch_adamw(ctx, rec)


def _optimizer_facts(ctx: CheckContext, rec: CheckRecorder, candidate: Candidate
                     ) -> tuple[dict[Behaviour, DocumentedBehaviour], bool, bool]:
    """The candidate's documented departures, whether its optimizers share a world, and
    whether it has MXFP8 params. A candidate without the technique raises Unsupported: a
    SKIP."""
    with candidate.optimizer() as optimizer:
        return (candidate.departures(OPTIMIZER_BEHAVIOURS), optimizer.shares_a_world,
                _has_mxfp8(rec, optimizer))


def _has_mxfp8(rec: CheckRecorder, optimizer: DistributedOptimizerStep) -> bool:
    try:
        optimizer.mxfp8()
    except Unsupported as unsupported:
        rec.skip(f"MXFP8 params: {unsupported.reason}")
        return False
    return True


CHECK = Check(
    name=CHECK_NAME,
    summary="distributed optimizer (AdamW/SGD, clipping, loss scaling, checkpoints) vs refgrad, "
            "bitwise, gloo DP=1..4",
    run=run,
    spawns_ranks=True,
    technique=Technique.OPTIMIZER,
)

"""The ``optim`` check's candidate, run function and report glue (see the package docstring)."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fastgrad.errors import LifecycleError
from fastgrad.optim import AdamWConfig, DistributedOptimizer
from refgrad import optim as R
from refgrad.formats import tensor_bit_patterns
from verify.check import CheckContext, CheckRecorder
from verify.checks.optim.cases import (
    CHECKPOINT_CASE,
    FP32,
    MIXED,
    NAMES,
    OptimCase,
    bits,
    build,
    case_matrix,
    train_step,
)
from verify.checks.optim.expectations import case_trajectory
from verify.checks.optim.mxfp8 import compare_runs, refgrad_trajectory, same_bits
from verify.checks.optim.worker import RESUME_AFTER, WORLD, rank_worker
from verify.distributed import spawn


@dataclass(frozen=True)
class OptimCandidate:
    """The optimizer under test: a class with ``DistributedOptimizer``'s constructor,
    ``step``, ``finish_param_sync``, ``publish_params``, ``param_gather_in_flight``,
    ``named_state_dict``/``load_state_dict``, ``loss_scaler`` and ``shards`` (each with
    ``bucket`` and ``gather_handle``).

    It is pickled into the spawned ranks, so it must be importable by name.
    """

    optimizer_cls: type = DistributedOptimizer

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer_cls, type):
            raise TypeError(f"OptimCandidate.optimizer_cls must be a class, got {self.optimizer_cls!r}")

    @classmethod
    def default(cls) -> OptimCandidate:
        """fastgrad's ``DistributedOptimizer``."""
        return cls()


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Params of mixed dtypes as one fp32 tensor (the upcast is exact and injective)."""
    return torch.cat([tensors[n].detach().float().reshape(-1) for n in NAMES])


def _compare_snapshot(rec: CheckRecorder, label: str, want: dict, got: dict) -> None:
    """Params, masters and every state tensor refgrad has, bitwise."""
    rec.compare(f"{label} params", _flat(want["params"]), _flat(got["params"]))
    for key in want["state"][NAMES[0]]:
        rec.compare(f"{label} {key}", _flat({n: want["state"][n][key] for n in NAMES}),
                    _flat({n: got["state"]["params"][n][key] for n in NAMES}))


def _same_on_every_rank(snaps: list[dict]) -> bool:
    first = snaps[0]
    for other in snaps[1:]:
        for n in NAMES:
            if not torch.equal(bits(first["params"][n]), bits(other["params"][n])):
                return False
            for key, tensor in first["state"]["params"][n].items():
                if not torch.equal(bits(tensor), bits(other["state"]["params"][n][key])):
                    return False
    return True


def _check_case(rec: CheckRecorder, case: OptimCase, runs: list[dict], want: list[dict]) -> None:
    for rank, run in enumerate(runs):
        errors = run["errors"]
        rec.expect(f"{case.label}: the optimizer raised nothing (rank {rank})", not errors,
                   "; ".join(f"step {s + 1}: {e}" for s, e in errors)[:400])
        taken = sum(snap is not None for snap in run["snapshots"])
        rec.expect(f"{case.label}: every step ran to its snapshot (rank {rank})", taken == len(want),
                   f"{taken} of {len(want)}")
    scaler_states, scales = case.scaler_states(), case.scales()
    overlapped = case.overlap and case.dp > 1
    for step, expected in enumerate(want):
        label = f"{case.label} step {step + 1}"
        snaps = [run["snapshots"][step] for run in runs]
        if all(snap is not None for snap in snaps):
            _compare_snapshot(rec, label, expected, snaps[0])
            for rank, snap in enumerate(snaps[1:], start=1):  # every rank's params after the gather
                rec.compare(f"{label} params after the gather (rank {rank})", _flat(expected["params"]),
                            _flat(snap["params"]))
            rec.expect(f"{label}: every rank holds the same params and state bitwise",
                       _same_on_every_rank(snaps))
        results = [run["results"][step] if step < len(run["results"]) else {} for run in runs]
        stepped = [r.get("stepped") for r in results]
        rec.expect(f"{label}: stepped={expected['stepped']} on every rank (as refgrad)",
                   all(s == expected["stepped"] for s in stepped),
                   f"ranks: {stepped}" + ("" if all(r.get("agreed", True) for r in results)
                                          else " (the ranks decided differently)"))
        if expected["stepped"]:
            norms = [r.get("grad_norm") for r in results]
            rec.expect(f"{label}: the global grad norm is refgrad's exact one on every rank "
                       f"(the tied copy counted once)", all(n == expected["grad_norm"] for n in norms),
                       f"refgrad {expected['grad_norm']!r}, ranks {norms}")
        if scaler_states is not None:
            used = [r.get("loss_scale") for r in results]
            rec.expect(f"{label}: loss scale {scales[step]:g} used on every rank (Megatron's rule)",
                       all(u == scales[step] for u in used), f"ranks: {used}")
            after = [r.get("scaler") for r in results]
            rec.expect(f"{label}: loss scaler after the step {scaler_states[step]} on every rank "
                       f"(hysteresis {case.hysteresis})", all(a == scaler_states[step] for a in after),
                       f"ranks: {after}")
        if overlapped:
            # A stepped step launches the param all-gather; a skipped step (NaN/inf) launches none.
            launched = [r.get("launched") for r in results]
            rec.expect(f"{label}: a param all-gather in flight after the step iff it stepped",
                       all(x == expected["stepped"] for x in launched), f"ranks: {launched}")
            # the next forward (the next step's, or one after the last) reads the gathered params
            reads = [run["results"][step + 1].get("read_in_flight") if step + 1 < len(run["results"])
                     else run.get("final_read_in_flight") for run in runs]
            rec.expect(f"{label}: the next forward read every param after its all-gather arrived "
                       "(its modules' forward pre-hooks waited)", reads == [False] * len(runs),
                       f"ranks (True: read while in flight): {reads}")


def _references(cases: list[OptimCase], seed: int) -> dict:
    """refgrad's trajectory of every case, and of the DP=3 run resumed from the DP=2 checkpoint."""
    out: dict = {"cases": []}
    for case in cases:
        if case == CHECKPOINT_CASE:
            first, after = case_trajectory(case, seed, worlds=[case.dp] * RESUME_AFTER)
            after = copy.deepcopy(after)
            rest, _ = case_trajectory(case, seed, start=copy.deepcopy(after), first_step_id=RESUME_AFTER)
            out["cases"].append(first + rest)
            dp3_case = dataclasses.replace(CHECKPOINT_CASE, ranks=(0, 1, 2))
            out["dp3"] = (dp3_case, case_trajectory(dp3_case, seed, start=copy.deepcopy(after),
                                                    first_step_id=RESUME_AFTER)[0])
        else:
            out["cases"].append(case_trajectory(case, seed)[0])
    return out


def _references_process(rank: int, world: int, cases: list[OptimCase], seed: int) -> dict:
    """:func:`_references` in a process of its own (``spawn`` with one rank, no candidate code)."""
    return _references(cases, seed)


def _check_resumes(rec: CheckRecorder, per_rank: list[dict], cases: list[OptimCase], expected: dict) -> None:
    """The DP=2 checkpoint resumed at DP=2 (== the uninterrupted run) and at DP=3 (== refgrad)."""
    uninterrupted = per_rank[0]["cases"][cases.index(CHECKPOINT_CASE)]["snapshots"]
    checkpoint = per_rank[0]["cases"][cases.index(CHECKPOINT_CASE)].get("checkpoint")
    rec.expect(f"{CHECKPOINT_CASE.label}: a checkpoint after step {RESUME_AFTER}", checkpoint is not None)
    for rank in (2, 3):
        for k, snap in enumerate(per_rank[rank]["dp2_resumed"]["snapshots"]):
            step = RESUME_AFTER + k + 1
            label = f"{CHECKPOINT_CASE.label} resumed after step {RESUME_AFTER} (rank {rank}) step {step}"
            before = uninterrupted[step - 1]
            if not rec.expect(f"{label}: both runs reached it", snap is not None and before is not None):
                continue
            rec.compare(f"{label} params == uninterrupted", _flat(before["params"]), _flat(snap["params"]))
            for key in before["state"]["params"][NAMES[0]]:
                rec.compare(f"{label} {key} == uninterrupted",
                            _flat({n: before["state"]["params"][n][key] for n in NAMES}),
                            _flat({n: snap["state"]["params"][n][key] for n in NAMES}))
    resharded = [per_rank[r]["dp3_resumed"] for r in range(3)]
    if checkpoint is None or not all("loaded" in run for run in resharded):
        return
    for rank, run in enumerate(resharded):
        loaded = run["loaded"]["state"]["params"]
        for key in checkpoint["params"][NAMES[0]]:
            rec.compare(f"optim DP=2 checkpoint loaded at DP=3 (rank {rank}) full {key}",
                        _flat({n: checkpoint["params"][n][key] for n in NAMES}),
                        _flat({n: loaded[n][key] for n in NAMES}))
        rec.compare(f"optim DP=2 checkpoint loaded at DP=3 (rank {rank}) params == master cast",
                    _flat({n: checkpoint["params"][n]["master"].to(MIXED[n]) for n in NAMES}),
                    _flat(run["loaded"]["params"]))
    dp3_case, want3 = expected["dp3"]
    for k, step_expected in enumerate(want3):
        step = RESUME_AFTER + k + 1
        label = f"{dp3_case.label} resumed from DP=2 step {step}"
        snaps = [r["snapshots"][k] for r in resharded]
        if not rec.expect(f"{label}: every rank reached it", all(snap is not None for snap in snaps)):
            continue
        _compare_snapshot(rec, label, step_expected, snaps[0])
        rec.expect(f"{label}: every rank holds the same params and state bitwise", _same_on_every_rank(snaps))


def check_multi_rank(ctx: CheckContext, rec: CheckRecorder, candidate: OptimCandidate) -> None:
    """The case matrix, the DP=2 resume and the DP=2 -> DP=3 reshard on one 4-rank spawn."""
    cases = case_matrix(ctx.quick)
    seed = ctx.seed % 391  # 391 = 17 * 23: the data patterns' periods
    mxfp8_runs = mxfp8_matrix(ctx.quick) if _supports_mxfp8(rec, candidate) else []
    # refgrad's (slow, exact) references are computed while the ranks start and train, in a
    # process of their own: pure Python, they would hold this process's interpreter lock
    # against the check that `verify run --jobs` runs beside this one.
    with ThreadPoolExecutor(max_workers=1) as pool:
        references = pool.submit(spawn, _references_process, 1, cases, seed, timeout_s=ctx.timeout_s)
        per_rank = spawn(rank_worker, WORLD, cases, candidate.optimizer_cls, seed, mxfp8_runs,
                         timeout_s=ctx.timeout_s)
        expected = references.result()[0]
    for index, case in enumerate(cases):
        runs = [per_rank[r]["cases"][index] for r in case.ranks]
        _check_case(rec, case, runs, expected["cases"][index])

    _check_resumes(rec, per_rank, cases, expected)
    for rank in (0, 1):
        outcome = per_rank[rank]["modified"]
        rec.expect(
            f"optim error: a param modified between all-gather launch and wait is refused "
            f"(LifecycleError naming the rule, DP=2 rank {rank})",
            outcome.startswith("LifecycleError") and "modified between the launch" in outcome,
            outcome[:300],
        )
    check_mxfp8(rec, mxfp8_runs, [per_rank[0]["mxfp8"], per_rank[1]["mxfp8"]], ctx.timeout_s)


def _expect_raises(rec: CheckRecorder, label: str, fn: Callable[[], object],
                   error: type[BaseException], rule: str) -> None:
    try:
        fn()
    except error as exc:
        rec.expect(f"optim error: {label}", rule in str(exc), f"{type(exc).__name__}: {exc}"[:300])
    except Exception as exc:  # noqa: BLE001 - a wrong type is a failure, recorded
        rec.expect(f"optim error: {label}", False,
                   f"expected {error.__name__}, got {type(exc).__name__}: {exc}"[:300])
    else:
        rec.expect(f"optim error: {label}", False, f"no {error.__name__} raised")


def check_errors(ctx: CheckContext, rec: CheckRecorder, candidate: OptimCandidate) -> None:
    """Bad input (DP=1, this process): the right error type with the rule in the message."""
    cls = candidate.optimizer_cls
    model, ddp, _ = build(MIXED, "adamw", optimizer_cls=cls)
    _expect_raises(rec, "a param group mixing buffers (ValueError 'mixes buffers')",
                   lambda: cls(ddp, AdamWConfig(lr=0.1), [{"params": list(model.parameters())}]),
                   ValueError, "mixes buffers")
    for bad in (0.0, -1.0):
        _expect_raises(rec, f"max_grad_norm={bad} (ValueError 'must be finite and > 0')",
                       lambda bad=bad: cls(ddp, AdamWConfig(lr=0.1), max_grad_norm=bad),
                       ValueError, "max_grad_norm must be finite and > 0")
    model, ddp, opt = build(FP32, "adamw", optimizer_cls=cls)
    _expect_raises(rec, "a step before any grad sync finished (LifecycleError 'before the grad sync')",
                   opt.step, LifecycleError, "before the grad sync")
    train_step(model, ddp, opt, 0, 0)
    state = opt.named_state_dict()
    renamed = {**state, "params": {("x" + k if k == "layer.bias" else k): v
                                   for k, v in state["params"].items()}}
    _expect_raises(rec, "a checkpoint whose names do not match (ValueError 'names do not match')",
                   lambda: opt.load_state_dict(renamed), ValueError, "names do not match")
    reshaped = {**state, "params": {**state["params"], "layer.bias": {
        k: v.reshape(1, -1) for k, v in state["params"]["layer.bias"].items()}}}
    _expect_raises(rec, "a checkpoint whose shapes do not match (ValueError 'has shape')",
                   lambda: opt.load_state_dict(reshaped), ValueError, "has shape")


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
    rec.finding(f"torch.optim.AdamW differs from refgrad's (and fastgrad's) AdamW by up to {worst} "
                f"fp32 ULP on the params within {steps} steps: a different operation order, not a "
                "fastgrad error")


def mxfp8_matrix(quick: bool) -> list[tuple[str, bool, bool]]:
    """(algorithm, sharing, fp32 grads) of the MXFP8 runs: both algorithms, sharing on and off."""
    return [(kind, sharing, grad_fp32) for kind in ("adamw", "sgd") for sharing in (False, True)
            for grad_fp32 in ((True,) if quick else (True, False))]


def _supports_mxfp8(rec: CheckRecorder, candidate: OptimCandidate) -> bool:
    if getattr(candidate.optimizer_cls, "supports_mxfp8", False):
        return True
    rec.skip("MXFP8 params: the optimizer has no MXFP8 parameter support "
             f"({candidate.optimizer_cls.__name__}.supports_mxfp8 is absent or False)")
    return False


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
                   not torch.equal(runs[0]["steps"][0]["grads"][0], runs[1]["steps"][0]["grads"][0]))
        compare_runs(rec, label, runs, trajectories[distinct.index(keys[index])])
        if sharing and (kind, False, grad_fp32) in mxfp8_runs:
            unshared = mxfp8_runs.index((kind, False, grad_fp32))
            for rank, rank_runs in enumerate(per_rank):
                off, on = rank_runs[unshared]["steps"], rank_runs[index]["steps"]
                rec.expect(f"{label}: grads, masters and MXFP8 bits == sharing off, every step (rank {rank})",
                           all(all(same_bits(x, y) for x, y in zip(a["grads"] + a["masters"],
                                                                   b["grads"] + b["masters"]))
                               and all(torch.equal(x, y) for p, q in zip(a["bits"], b["bits"])
                                       for x, y in zip(p, q)) for a, b in zip(off, on)))


def run(ctx: CheckContext, rec: CheckRecorder, candidate: OptimCandidate) -> None:
    """The ``optim`` check against ``candidate`` (default: fastgrad's DistributedOptimizer)."""
    check_errors(ctx, rec, candidate)
    check_multi_rank(ctx, rec, candidate)  # with the MXFP8 runs (check_mxfp8) on the same spawn
    check_torch_adamw(ctx, rec)

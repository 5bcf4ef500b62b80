"""The scaled twin's comparison with refgrad: per step, per replica, per parameter.

:func:`compare_steps` holds every step's losses, reduced gradients and updated
parameters (and, for AdamW, master weights and moments; for MXFP8 params, their
bits) of the ranks against refgrad's single-process run of the same case
(:func:`reference_for`): bitwise where the reduction order is fixed, else within
``ulp_bound_factor(DP) x (step + 1)`` ULPs of each tensor's largest magnitude.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from verify.preflight.twin import TwinPlan

UNIT_ROUNDOFF_FP32 = 2.0**-24


def ulp_bound_factor(dp: int) -> int:
    """ULPs of a tensor's largest element allowed per step when the reduction order is free."""
    return 8 * (dp - 1) * dp


@dataclass
class StepRow:
    """One step's comparison against refgrad."""

    step: int
    microbatches: int
    loss_max_ulp: int
    grads_bitwise: int
    grads_total: int
    grad_max_ulp: int
    params_bitwise: int
    params_total: int
    param_max_ulp: int
    state_bitwise: int = 0  # master weights and AdamW moments (distributed optimizer only)
    state_total: int = 0
    state_max_ulp: int = 0
    mxfp8_bitwise: int = 0  # MXFP8 params' scale and element bit tensors (MXFP8 twin only)
    mxfp8_total: int = 0
    grad_norm: float | None = None  # refgrad's global norm, clip coefficient, loss scale (AdamW)
    clip_coefficient: float | None = None
    clipped: bool = False
    loss_scale: float | None = None
    stepped: bool | None = None  # refgrad's optimizer stepped (False: skipped on NaN/inf; None: SGD)
    failures: list[str] = field(default_factory=list)


def collect(case: Any, ranks: list[Any]) -> dict[str, list]:
    """Per step: losses [replica][microbatch] and grads/params {name: tensor} per replica,
    a replica being one (DP rank, TP rank): index ``dp_rank * tp_size + tp_rank``."""
    steps, replicas = len(case.plans), case.dp_size * case.tp_size
    losses = [[[] for _ in range(replicas)] for _ in range(steps)]
    grads = [[{} for _ in range(replicas)] for _ in range(steps)]
    params = [[{} for _ in range(replicas)] for _ in range(steps)]
    state = [[{} for _ in range(replicas)] for _ in range(steps)]
    for res in ranks:
        if res is None:
            continue
        replica = res.dp_rank * case.tp_size + res.tp_rank
        for step in range(steps):
            if res.stage == case.pp_size - 1:
                losses[step][replica] = res.losses[step]
            grads[step][replica].update(res.grads[step])
            params[step][replica].update(res.params[step])
            if hasattr(res, "state"):
                state[step][replica].update(res.state[step])
    return {"losses": losses, "grads": grads, "params": params, "state": state}


def replica_label(case: Any, replica: int) -> str:
    """``replica D`` (TP 1) or ``replica D, TP rank T``."""
    dp_rank, tp_rank = divmod(replica, case.tp_size)
    return f"replica {dp_rank}" if case.tp_size == 1 else f"replica {dp_rank}, TP rank {tp_rank}"


def _on_rank(case: Any, name: str, ref: torch.Tensor, replica: int) -> torch.Tensor:
    """The part of refgrad's tensor the replica's TP rank holds (its head rows; else all)."""
    from refgrad.pipeline_tp import expected_on_rank

    return expected_on_rank(case.spec, name, ref, replica % case.tp_size)


def _within(ref: torch.Tensor, got: torch.Tensor, bound_ulps: int | None) -> tuple[bool, int, str]:
    """(ok, max ULP, detail); bitwise when ``bound_ulps`` is None."""
    from verify.metrics import compare

    ref, got = _same_nans(ref.reshape(-1), got.reshape(-1))
    cmp = compare(ref, got)
    if cmp.bitwise_equal:
        return True, 0, ""
    diff = (got.double() - ref.double()).abs().reshape(-1)
    worst = int(diff.argmax())
    detail = (f"{cmp.n_mismatch}/{cmp.n} elements differ, max {cmp.max_ulp} ULP; element {worst}: "
              f"refgrad {float(ref.reshape(-1)[worst])!r}, fastgrad {float(got.reshape(-1)[worst])!r}")
    if bound_ulps is None:
        return False, cmp.max_ulp, detail
    # The bound is for finite values; a non-finite one must be bitwise the same.
    finite = ref.isfinite() & got.isfinite()
    if not torch.equal(ref[~finite].view(-1).double(), got[~finite].view(-1).double()) or bool(
            (ref.isfinite() != got.isfinite()).any()):
        return False, cmp.max_ulp, detail + " (a non-finite value differs)"
    if not bool(finite.any()):
        return True, cmp.max_ulp, detail
    scale = float(ref[finite].abs().max())
    # fp32 ULP of the largest element: float64's ulp x 2^29 (52 - 23 mantissa bits).
    allowed = bound_ulps * (math.ulp(scale) * 2.0**29 if scale > 0 else UNIT_ROUNDOFF_FP32)
    return bool(diff[finite].max() <= allowed), cmp.max_ulp, detail + f" (bound {allowed:.3g})"


def _same_nans(ref: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors with the NaNs they share set to 0: IEEE 754 leaves a NaN result's sign and
    payload to the hardware (an overflowed fp16 step's inf - inf), so only NaN-ness is compared."""
    both = ref.isnan() & got.isnan()
    if not bool(both.any()):
        return ref, got
    return ref.masked_fill(both, 0), got.masked_fill(both, 0)


def compare_steps(plan: TwinPlan, ranks: list[Any], reference: Any) -> list[StepRow]:
    """Every step's losses, reduced grads and updated params vs refgrad, per replica."""
    case = plan.case
    got = collect(case, ranks)
    rows = []
    for step, step_plan in enumerate(case.plans):
        bound = None if plan.bitwise else ulp_bound_factor(case.dp_size) * (step + 1)
        row = StepRow(step, step_plan.num_microbatches, 0, 0, 0, 0, 0, 0, 0)
        # Every TP rank of a replica reports the replica's (TP-summed) losses.
        ref_loss = torch.tensor([v for rep in reference.losses[step] for _ in range(case.tp_size)
                                 for v in rep])
        got_loss = torch.tensor([v for rep in got["losses"][step] for v in rep])
        if ref_loss.shape != got_loss.shape:
            row.failures.append(f"step {step}: {got_loss.numel()} losses, refgrad has {ref_loss.numel()}")
        else:
            ok, row.loss_max_ulp, detail = _within(ref_loss, got_loss, bound)
            if not ok:
                row.failures.append(f"step {step}: loss differs from refgrad: {detail}")
        for kind, ref_named in (("grads", reference.grads[step]), ("params", reference.params[step])):
            for name in sorted(ref_named):
                for replica in range(case.dp_size * case.tp_size):
                    cand = got[kind][step][replica].get(name)
                    setattr(row, f"{kind}_total", getattr(row, f"{kind}_total") + 1)
                    if cand is None:
                        row.failures.append(f"step {step}: {name} missing on "
                                            f"{replica_label(case, replica)}")
                        continue
                    ok, ulps, detail = _within(_on_rank(case, name, ref_named[name], replica),
                                               cand, bound)
                    attr = "grad_max_ulp" if kind == "grads" else "param_max_ulp"
                    setattr(row, attr, max(getattr(row, attr), ulps))
                    if ulps == 0:
                        setattr(row, f"{kind}_bitwise", getattr(row, f"{kind}_bitwise") + 1)
                    if not ok:
                        what = "reduced gradient" if kind == "grads" else "updated parameter"
                        row.failures.append(f"step {step}: {what} {name} "
                                            f"({replica_label(case, replica)}) differs from "
                                            f"refgrad: {detail}")
        if hasattr(reference, "state"):
            from verify.preflight.twin_optim_reference import compare_optimizer_step

            _compare_state(case, row, reference.state[step], got["state"][step], bound)
            compare_optimizer_step(row, reference, ranks, bound)
        if hasattr(reference, "mxfp8"):
            from verify.preflight.twin_mxfp8 import compare_mxfp8_params

            compare_mxfp8_params(case, row, reference, ranks)
        rows.append(row)
    return rows


def _compare_state(case: Any, row: StepRow, ref_state: dict, got_state: list[dict],
                   bound: int | None) -> None:
    """Master weights and AdamW moments per parameter and replica vs refgrad.optim."""
    for name in sorted(ref_state):
        for replica, per_name in enumerate(got_state):
            for key, ref in ref_state[name].items():
                row.state_total += 1
                cand = per_name.get(name, {}).get(key)
                if cand is None:
                    row.failures.append(f"step {row.step}: optimizer {key} of {name} missing on "
                                        f"{replica_label(case, replica)}")
                    continue
                ok, ulps, detail = _within(_on_rank(case, name, ref, replica), cand, bound)
                row.state_max_ulp = max(row.state_max_ulp, ulps)
                row.state_bitwise += ulps == 0
                if not ok:
                    row.failures.append(f"step {row.step}: optimizer {key} of {name} "
                                        f"({replica_label(case, replica)}) differs from "
                                        f"refgrad.optim: {detail}")


def reference_for(plan: TwinPlan) -> Any:
    """refgrad's single-process run of the same case (with refgrad.optim for AdamW)."""
    from refgrad.pipeline import reference_training

    case = plan.case
    if plan.mxfp8 is not None:
        from verify.preflight.twin_mxfp8 import reference_with_mxfp8

        return reference_with_mxfp8(case, plan.mxfp8)
    if plan.optimizer == "adamw":
        from verify.preflight.twin_optim_reference import reference_with_optimizer

        return reference_with_optimizer(case, plan.adamw)
    return reference_training(case.spec, case.plans, case.dp_size, lr=case.lr,
                              reduction=case.reduction)

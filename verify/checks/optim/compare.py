"""The ``optim`` check's comparisons of the ranks' results with refgrad, and their classification.

A candidate that documents no departure (fastgrad) is held bitwise to ``refgrad.optim``'s
trajectory. Where the candidate documents one (:data:`~verify.candidates.interfaces.OPTIMIZER_BEHAVIOURS`; Megatron-Core's
``torch.optim.AdamW`` order, its fp32 partial-sum grad norm, its param all-gather launched in
the forward), it is held to refgrad's model of that behaviour (``model``: the trajectory of
``expectations.ProductionModel``, bitwise; the norm within its bound; no all-gather in flight
after the step) and the distance from the spec is recorded as a documented difference naming
where the behaviour lives; a mismatch with the model is a FAIL.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType

import torch

from refgrad.formats import FLOAT32, gamma
from verify.candidates.interfaces import Behaviour, DocumentedBehaviour
from verify.check import CheckRecorder
from verify.checks.optim.cases import NAMES, SHAPES, OptimCase
from verify.checks.optim.records import CaseRun, Snapshot
from verify.metrics import bitwise_equal


@dataclass(frozen=True)
class Documented:
    """What a case's comparisons classify: the candidate's behaviour and refgrad's model of it
    (``model``: the trajectory under the documented behaviour; None: the spec's own)."""

    behaviour: Mapping[Behaviour, DocumentedBehaviour]
    model: list[dict] | None = None

    def order(self, case: OptimCase) -> DocumentedBehaviour | None:
        """The documented behaviours behind a case's numbers (the step's order of operations,
        and the norm it clips with), as one: None when the candidate follows the spec."""
        parts = [self.behaviour.get(Behaviour.TORCH_ADAMW_ORDER if case.algorithm == "adamw"
                                    else Behaviour.TORCH_SGD_ORDER)]
        if case.clip is not None:
            parts += [self.behaviour.get(Behaviour.PARTIAL_SUM_GRAD_NORM),
                      self.behaviour.get(Behaviour.TORCH_CLIP_COEFFICIENT)]
        parts = [p for p in parts if p is not None]
        if not parts or self.model is None:
            return None
        return DocumentedBehaviour(" + ".join(p.summary for p in parts),
                                   "; ".join(p.where for p in parts))


AS_SPECIFIED = Documented(MappingProxyType({}))


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Params of mixed dtypes as one fp32 tensor (the upcast is exact and injective)."""
    return torch.cat([tensors[n].detach().float().reshape(-1) for n in NAMES])


def compare_snapshot(rec: CheckRecorder, label: str, want: dict, got: Snapshot, *,
                     documented: DocumentedBehaviour | None = None, model: dict | None = None) -> None:
    """Params, masters and every state tensor refgrad has (``want``, a step of refgrad's
    trajectory), bitwise (to refgrad's model of a documented behaviour where there is one)."""
    def check(what: str, key: str | None) -> None:
        pick = ((lambda snap: flat(snap["params"])) if key is None
                else (lambda snap: flat({n: snap["state"][n][key] for n in NAMES})))
        candidate = (flat(got.params) if key is None
                     else flat({n: got.state[n][key] for n in NAMES}))
        rec.compare_documented(f"{label} {what}", pick(want), candidate, documented=documented,
                               documented_reference=None if model is None else pick(model))

    check("params", None)
    for key in want["state"][NAMES[0]]:
        check(key, key)


def same_on_every_rank(snaps: list[Snapshot]) -> bool:
    """Whether every rank's snapshot holds the first's params and state, bitwise."""
    first = snaps[0]
    for other in snaps[1:]:
        for n in NAMES:
            if not bitwise_equal(first.params[n], other.params[n]):
                return False
            for key, tensor in first.state[n].items():
                if not bitwise_equal(tensor, other.state[n][key]):
                    return False
    return True


def norm_bound(dp: int) -> Fraction:
    """γ(n + k + R + 8) (u = 2^-24): the relative error of an fp32 partial-sum norm whose every
    rounding acts on non-negative terms, along its longest chain of ``n`` elements (the largest
    param), ``k`` per-param norms and ``R`` ranks, with 8 for the squares, the square roots and
    the final conversions."""
    return gamma(max(torch.Size(s).numel() for s in SHAPES.values()) + len(NAMES) + dp + 8,
                 FLOAT32.unit_roundoff)


def _check_norms(rec: CheckRecorder, label: str, case: OptimCase, exact: float | None,
                 norms: list, documented: Documented) -> None:
    spec = all(n == exact for n in norms)
    what = (f"{label}: the global grad norm is refgrad's exact one on every rank "
            f"(the tied copy counted once)")
    detail = f"refgrad {exact!r}, ranks {norms}"
    partial = documented.behaviour.get(Behaviour.PARTIAL_SUM_GRAD_NORM)
    if partial is None or case.clip is None or exact is None:
        rec.expect(what, spec, detail)
        return
    bound = norm_bound(case.dp)
    within = all(isinstance(n, float) and abs(Fraction(n) - Fraction(exact)) <= bound * Fraction(exact)
                 for n in norms)
    worst = max((abs(n - exact) / exact for n in norms if isinstance(n, float) and exact), default=0.0)
    rec.expect_documented(what, spec, documented=partial, documented_holds=within,
                          detail=f"{detail}; largest relative error {worst:.3g} "
                                 f"(bound {float(bound):.3g}, γ(n + k + R + 8))")


def check_case(rec: CheckRecorder, case: OptimCase, runs: list[CaseRun], want: list[dict],
               documented: Documented = AS_SPECIFIED) -> None:
    """Every rank's run of ``case`` against refgrad's trajectory ``want`` (the spec's)."""
    for rank, run in enumerate(runs):
        taken = sum(snap is not None for snap in run.snapshots)
        rec.expect(f"{case.label}: every step ran to its snapshot (rank {rank})", taken == len(want),
                   f"{taken} of {len(want)}")
    scaler_states, scales = case.scaler_states(), case.scales()
    overlapped = case.overlap and case.dp > 1
    order = documented.order(case)
    model = documented.model
    for step, expected in enumerate(want):
        label = f"{case.label} step {step + 1}"
        snaps = [run.snapshots[step] for run in runs]
        modelled = None if model is None or order is None else model[step]
        if all(snap is not None for snap in snaps):
            compare_snapshot(rec, label, expected, snaps[0], documented=order, model=modelled)
            for rank, snap in enumerate(snaps[1:], start=1):  # every rank's params after the gather
                reference = modelled if modelled is not None else expected
                rec.compare_documented(
                    f"{label} params after the gather (rank {rank})", flat(expected["params"]),
                    flat(snap.params), documented=order,
                    documented_reference=None if order is None else flat(reference["params"]))
            rec.expect(f"{label}: every rank holds the same params and state bitwise",
                       same_on_every_rank(snaps))
        results = [run.step(step) for run in runs]  # None: the rank has no such step
        outcomes = [None if r is None else r.outcome for r in results]
        stepped = [None if o is None else o.stepped for o in outcomes]
        rec.expect(f"{label}: stepped={expected['stepped']} on every rank (as refgrad)",
                   all(s == expected["stepped"] for s in stepped),
                   f"ranks: {stepped}" + ("" if all(r is None or r.agreed for r in results)
                                          else " (the ranks decided differently)"))
        if expected["stepped"]:
            _check_norms(rec, label, case, expected["grad_norm"],
                         [None if o is None else o.grad_norm for o in outcomes], documented)
        if scaler_states is not None:
            used = [None if o is None else o.loss_scale for o in outcomes]
            rec.expect(f"{label}: loss scale {scales[step]:g} used on every rank (Megatron's rule)",
                       all(u == scales[step] for u in used), f"ranks: {used}")
            after = [None if r is None else r.scaler for r in results]
            rec.expect(f"{label}: loss scaler after the step {scaler_states[step]} on every rank "
                       f"(hysteresis {case.hysteresis})", all(a == scaler_states[step] for a in after),
                       f"ranks: {after}")
        if overlapped:
            # A stepped step launches the param all-gather; a skipped step (NaN/inf) launches none.
            launched = [None if r is None else r.launched for r in results]
            in_forward = documented.behaviour.get(Behaviour.PARAM_GATHER_IN_FORWARD)
            rec.expect_documented(
                f"{label}: a param all-gather in flight after the step iff it stepped",
                all(x == expected["stepped"] for x in launched), documented=in_forward,
                documented_holds=None if in_forward is None else all(x is False for x in launched),
                detail=f"ranks: {launched}")
            # the next forward (the next step's, or one after the last) reads the gathered params
            reads = [run.steps[step + 1].read_in_flight if step + 1 < len(run.steps)
                     else run.final_read_in_flight for run in runs]
            rec.expect(f"{label}: the next forward read every param after its all-gather arrived "
                       "(its modules' forward pre-hooks waited)", reads == [False] * len(runs),
                       f"ranks (True: read while in flight): {reads}")

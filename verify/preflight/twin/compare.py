"""The scaled twin's comparison with refgrad: per step, per replica, per parameter.

:func:`compare_steps` holds every step's losses, reduced gradients and updated parameters
(and, with an optimizer, master weights and moments and the step's outcome; for MXFP8
params, their bits) of the ranks against refgrad's single-process run of the same case
(:func:`verify.preflight.twin.reference.reference_for`): bitwise where the reduction order
is fixed, else within ``ulp_bound_factor(DP) x (step + 1)`` ULPs of each tensor's largest
magnitude. Where the candidate documents how its optimizer departs from refgrad's spec
(:data:`verify.candidates.interfaces.OPTIMIZER_BEHAVIOURS`), it is held to refgrad's model
of that behaviour and the distance from the spec is kept as a :class:`DocumentedDifference`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType

import torch

from gradvocab import RankResult
from refgrad.formats import FLOAT32, gamma
from refgrad.pipeline import ReferenceResult, expected_on_rank
from verify.candidates.interfaces import Behaviour, DocumentedBehaviour, PipelineCase
from verify.metrics import bitwise_equal
from verify.preflight.twin.bounds import ulp_bound_factor, within
from verify.preflight.twin.reference import OptimReference
from verify.preflight.twin.variants import MXFP8Twin, TwinTraining, adamw_of

# An optimizer without documented departures from refgrad.optim.
AS_SPECIFIED: Mapping[Behaviour, DocumentedBehaviour] = MappingProxyType({})


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
    state_bitwise: int = 0  # master weights and AdamW moments (optimizer twins only)
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


@dataclass
class DocumentedDifference:
    """How far a candidate's documented behaviour put its results from refgrad's spec, over
    the whole twin: ``compared`` tensors (or values), ``differing`` of them not bitwise the
    spec's, the largest distance (``max_ulp`` fp32 ULPs, or ``max_relative`` for the norm)."""

    behaviour: DocumentedBehaviour
    compared: int = 0
    differing: int = 0
    max_ulp: int = 0
    max_relative: float = 0.0
    bound: str = ""

    def to_dict(self) -> dict:
        return {"summary": self.behaviour.summary, "where": self.behaviour.where,
                "compared": self.compared, "differing": self.differing,
                "max_ulp": self.max_ulp, "max_relative": self.max_relative, "bound": self.bound}


def collect(case: PipelineCase, ranks: list[RankResult | None], with_state: bool) -> dict[str, list]:
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
            if with_state and res.optimizer is not None:
                state[step][replica].update(res.optimizer.state[step])
    return {"losses": losses, "grads": grads, "params": params, "state": state}


def replica_label(case: PipelineCase, replica: int) -> str:
    """``replica D`` (TP 1) or ``replica D, TP rank T``."""
    dp_rank, tp_rank = divmod(replica, case.tp_size)
    return f"replica {dp_rank}" if case.tp_size == 1 else f"replica {dp_rank}, TP rank {tp_rank}"


def _on_rank(case: PipelineCase, name: str, ref: torch.Tensor, replica: int) -> torch.Tensor:
    """The part of refgrad's tensor the replica's TP rank holds (its head rows; else all)."""
    return expected_on_rank(case.spec, name, ref, replica % case.tp_size)


class StepComparison:
    """Compares one twin's ranks with refgrad, step by step, for one candidate."""

    def __init__(self, case: PipelineCase, training: TwinTraining, bitwise: bool,
                 ranks: list[RankResult | None], reference: OptimReference | ReferenceResult,
                 *, candidate: str = "the candidate",
                 behaviour: Mapping[Behaviour, DocumentedBehaviour] = AS_SPECIFIED) -> None:
        self.case, self.training, self.bitwise = case, training, bitwise
        self.ranks, self.reference, self.candidate = ranks, reference, candidate
        self.behaviour = behaviour
        self.optimizer = adamw_of(training) is not None
        self.got = collect(case, ranks, self.optimizer)
        self.documented = {b.summary: DocumentedDifference(b) for b in behaviour.values()}

    def rows(self) -> list[StepRow]:
        return [self._step(step) for step in range(len(self.case.plans))]

    def _step(self, step: int) -> StepRow:
        case, reference, got = self.case, self.reference, self.got
        bound = None if self.bitwise else ulp_bound_factor(case.dp_size) * (step + 1)
        row = StepRow(step, case.plans[step].num_microbatches, 0, 0, 0, 0, 0, 0, 0)
        # Every TP rank of a replica reports the replica's (TP-summed) losses.
        ref_loss = torch.tensor([v for rep in reference.losses[step] for _ in range(case.tp_size)
                                 for v in rep])
        got_loss = torch.tensor([v for rep in got["losses"][step] for v in rep])
        if ref_loss.shape != got_loss.shape:
            row.failures.append(f"step {step}: {got_loss.numel()} losses, refgrad has {ref_loss.numel()}")
        else:
            ok, row.loss_max_ulp, detail = within(ref_loss, got_loss, bound, self.candidate)
            if not ok:
                row.failures.append(f"step {step}: loss differs from refgrad: {detail}")
        for kind, ref_named in (("grads", reference.grads[step]), ("params", reference.params[step])):
            for name in sorted(ref_named):
                for replica in range(case.dp_size * case.tp_size):
                    self._compare_one(row, kind, name, replica, ref_named[name],
                                      got[kind][step][replica].get(name), bound)
        if isinstance(reference, OptimReference):
            self._compare_state(row, bound)
            self._compare_outcome(row, bound)
            if isinstance(self.training, MXFP8Twin):
                compare_mxfp8_params(case, row, reference, self.ranks, self.candidate)
        return row

    def _compare_one(self, row: StepRow, kind: str, name: str, replica: int,
                     ref: torch.Tensor, cand: torch.Tensor | None, bound: int | None) -> None:
        step = row.step
        setattr(row, f"{kind}_total", getattr(row, f"{kind}_total") + 1)
        if cand is None:
            row.failures.append(f"step {step}: {name} missing on {replica_label(self.case, replica)}")
            return
        ok, ulps, detail = within(_on_rank(self.case, name, ref, replica), cand, bound,
                                  self.candidate)
        attr = "grad_max_ulp" if kind == "grads" else "param_max_ulp"
        setattr(row, attr, max(getattr(row, attr), ulps))
        if ulps == 0:
            setattr(row, f"{kind}_bitwise", getattr(row, f"{kind}_bitwise") + 1)
        if not ok:
            what = "reduced gradient" if kind == "grads" else "updated parameter"
            row.failures.append(f"step {step}: {what} {name} ({replica_label(self.case, replica)}) "
                                f"differs from refgrad: {detail}")

    def _compare_state(self, row: StepRow, bound: int | None) -> None:
        """Master weights and AdamW moments per parameter and replica vs refgrad (its model of
        the candidate's documented optimizer, if any; then the distance each documented
        behaviour puts between the candidate and the spec is recorded)."""
        reference, case, behaviour = self.reference, self.case, self.behaviour
        ref_state = reference.state[row.step]
        documented = reference.spec_state and (behaviour.get(Behaviour.TORCH_ADAMW_ORDER)
                                               or behaviour.get(Behaviour.NO_DECAY_ON_1D_PARAMS))
        model = (f" (refgrad's model of {self.candidate}'s documented AdamW)" if documented else "")
        for name in sorted(ref_state):
            for replica, per_name in enumerate(self.got["state"][row.step]):
                for key, ref in ref_state[name].items():
                    row.state_total += 1
                    cand = per_name.get(name, {}).get(key)
                    if cand is None:
                        row.failures.append(f"step {row.step}: optimizer {key} of {name} missing "
                                            f"on {replica_label(case, replica)}")
                        continue
                    ok, ulps, detail = within(_on_rank(case, name, ref, replica), cand, bound,
                                              self.candidate)
                    row.state_max_ulp = max(row.state_max_ulp, ulps)
                    row.state_bitwise += ulps == 0
                    if not ok:
                        row.failures.append(f"step {row.step}: optimizer {key} of {name} "
                                            f"({replica_label(case, replica)}) differs from "
                                            f"refgrad.optim{model}: {detail}")
                    elif documented:
                        self._note_documented(row.step, name, key, replica, cand)

    def _note_documented(self, step: int, name: str, key: str, replica: int,
                         cand: torch.Tensor) -> None:
        """The candidate's distance from the spec (under its AdamW order) and, for a 1-D
        param, from the same model had it been decayed (under no decay on 1-D params)."""
        reference, behaviour = self.reference, self.behaviour
        order = (behaviour.get(Behaviour.TORCH_ADAMW_ORDER)
                 or behaviour.get(Behaviour.NO_DECAY_ON_1D_PARAMS))
        self._note_spec_distance(order, reference.spec_state[step][name][key], cand, name,
                                 replica)
        no_decay = behaviour.get(Behaviour.NO_DECAY_ON_1D_PARAMS)
        if no_decay is not None and reference.decayed_state and cand.dim() == 1:
            self._note_spec_distance(no_decay, reference.decayed_state[step][name][key], cand,
                                     name, replica)

    def _note_spec_distance(self, behaviour: DocumentedBehaviour, spec: torch.Tensor,
                            cand: torch.Tensor, name: str, replica: int) -> None:
        record = self.documented[behaviour.summary]
        record.compared += 1
        _, ulps, _ = within(_on_rank(self.case, name, spec, replica), cand, None)
        if ulps:
            record.differing += 1
            record.max_ulp = max(record.max_ulp, ulps)

    def _norm_tolerance(self, step: int, bound_ulps: int | None) -> float:
        """How far the candidate's global norm may be from refgrad's: 0 when the reduction
        order is fixed (exact sum of squares, two fp64 roundings: bitwise). Otherwise each
        reduced grad element may be off by ``bound_ulps`` fp32 ULPs of its tensor's largest
        magnitude (``a_t``), and ``| ||g + d|| - ||g|| | <= ||d|| <= sqrt(sum_t numel_t
        a_t^2)``, plus two fp64 roundings."""
        if bound_ulps is None:
            return 0.0
        reference = self.reference
        scale = reference.steps[step].loss_scale or 1.0
        total = 0.0
        for grad in reference.grads[step].values():
            top = float(grad.abs().max()) / scale
            allowed = bound_ulps * (math.ulp(top) * 2.0**29 if top > 0 else 2.0**-149)
            total += grad.numel() * allowed * allowed
        norm = reference.steps[step].grad_norm
        return math.sqrt(total) + 2 * math.ulp(norm if math.isfinite(norm) else 0.0)

    def partial_sum_norm_bound(self) -> Fraction:
        """The relative bound ``γ(n + k + R + 8)`` on an fp32 partial-sum norm (``u = 2^-24``):
        per-param fp32 norms over at most ``n`` elements, their norm over ``k`` params,
        squared and summed over ``R`` ranks in fp32, the root in fp64. Every rounding in that
        chain acts on non-negative terms, so each adds at most ``u`` relative error along the
        longest chain."""
        grads = self.reference.grads[0]
        n = max(g.numel() for g in grads.values())
        return gamma(n + len(grads) + self.case.world + 8, FLOAT32.unit_roundoff)

    def _compare_outcome(self, row: StepRow, bound_ulps: int | None) -> None:
        """The step's outcome (stepped, global grad norm, clip coefficient, loss scale) on every
        rank vs refgrad's; the norm bitwise where the reduction order is fixed, else within
        :meth:`_norm_tolerance` (a candidate's documented partial-sum norm within
        :meth:`partial_sum_norm_bound`), and then clipping is compared only outside that band."""
        reference, step = self.reference, row.step
        outcome = reference.steps[step]
        stepped, norm = outcome.stepped, outcome.grad_norm
        coef, scale = outcome.clip_coefficient, outcome.loss_scale
        row.grad_norm, row.clip_coefficient, row.loss_scale = norm, coef, scale
        row.stepped = stepped
        row.clipped = coef is not None and coef < 1.0
        partial = self.behaviour.get(Behaviour.PARTIAL_SUM_GRAD_NORM)
        tolerance = self._norm_tolerance(step, bound_ulps)
        if partial is not None and math.isfinite(norm):
            relative = float(self.partial_sum_norm_bound())
            tolerance = max(tolerance, relative * norm)
        decided = reference.max_norm is None or abs(norm - reference.max_norm) > tolerance
        for res in self.ranks:
            if res is None or res.optimizer is None:
                continue
            got = res.optimizer.steps[step]
            got_stepped, got_norm = got.stepped, got.grad_norm
            got_coef, got_scale = got.clip_coefficient, got.loss_scale
            where = f"step {step}: optimizer on stage {res.stage} (replica {res.dp_rank})"
            if got_stepped != stepped:
                row.failures.append(f"{where} {'stepped' if got_stepped else 'skipped'}, refgrad "
                                    f"{'stepped' if stepped else 'skipped'}")
            if got_norm is not None:
                self._compare_norm(row, where, got_norm, norm, tolerance, partial)
            if got_scale != scale:
                row.failures.append(f"{where}: loss scale {got_scale!r}, refgrad {scale!r}")
            if decided and (got_coef is not None and got_coef < 1.0) != row.clipped:
                row.failures.append(f"{where}: {'clipped' if got_coef is not None and got_coef < 1 else 'not clipped'}"
                                    f" (coefficient {got_coef!r}), refgrad coefficient {coef!r}")

    def _compare_norm(self, row: StepRow, where: str, got: float, norm: float, tolerance: float,
                      partial: DocumentedBehaviour | None) -> None:
        if math.isnan(norm) and math.isnan(got):
            return
        if not abs(got - norm) <= tolerance:
            row.failures.append(f"{where}: global grad norm {got!r}, refgrad {norm!r}"
                                + (f" (bound {tolerance:.3g})" if tolerance else ""))
            return
        if partial is not None and math.isfinite(norm) and norm > 0:
            record = self.documented[partial.summary]
            record.compared += 1
            record.bound = f"relative {float(self.partial_sum_norm_bound()):.3g} (γ(n + k + R + 8))"
            if got != norm:
                record.differing += 1
                record.max_relative = max(record.max_relative, abs(got - norm) / norm)

    def documented_differences(self) -> list[DocumentedDifference]:
        """Every documented behaviour the candidate showed, with its distance from the spec."""
        return list(self.documented.values())


def compare_steps(case: PipelineCase, training: TwinTraining, bitwise: bool,
                  ranks: list[RankResult | None], reference: OptimReference | ReferenceResult,
                  *, candidate: str = "the candidate",
                  behaviour: Mapping[Behaviour, DocumentedBehaviour] = AS_SPECIFIED
                  ) -> tuple[list[StepRow], list[DocumentedDifference]]:
    """Every step's losses, reduced grads and updated params vs refgrad, per replica; and the
    documented differences from refgrad's spec."""
    comparison = StepComparison(case, training, bitwise, ranks, reference, candidate=candidate,
                                behaviour=behaviour)
    return comparison.rows(), comparison.documented_differences()


def compare_mxfp8_params(case: PipelineCase, row: StepRow, reference: OptimReference,
                         ranks: list[RankResult | None], candidate: str = "the candidate") -> None:
    """Every rank's MXFP8 scale and element bits after step ``row.step`` vs refgrad's, bitwise."""
    ref = reference.mxfp8[row.step]
    reported: dict[int, set[str]] = {}  # replica -> the MXFP8 params its ranks reported
    for res in ranks:
        if res is None or res.optimizer is None:
            continue
        replica = res.dp_rank * case.tp_size + res.tp_rank
        reported.setdefault(replica, set()).update(res.optimizer.mxfp8[row.step])
        for name, (scales, elements) in sorted(res.optimizer.mxfp8[row.step].items()):
            for part, got, want in (("scale", scales, ref[name][0]), ("element", elements, ref[name][1])):
                want = expected_on_rank(case.spec, name, want, res.tp_rank)
                row.mxfp8_total += 1
                if bitwise_equal(got, want):
                    row.mxfp8_bitwise += 1
                    continue
                diff = (got != want).reshape(-1)
                first = int(diff.nonzero()[0])
                row.failures.append(
                    f"step {row.step}: MXFP8 {part} bits of {name} ({replica_label(case, replica)}) "
                    f"differ from refgrad.mxfp8: {int(diff.sum())}/{diff.numel()} differ; "
                    f"{part} {first}: refgrad {int(want.reshape(-1)[first]):#04x}, "
                    f"{candidate} {int(got.reshape(-1)[first]):#04x}")
    for replica, names in sorted(reported.items()):  # every refgrad param, on some stage of it
        for name in sorted(set(ref) - names):
            row.failures.append(f"step {row.step}: MXFP8 param {name} "
                                f"({replica_label(case, replica)}) was not reported by its rank")

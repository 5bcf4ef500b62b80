"""Megatron-Core's observables held to refgrad, every difference classified.

Each technique's module compares what a driver returned with refgrad's exact reference
(the *spec*) and with refgrad variants that model a documented production behaviour
(``Model``: a name and where it lives in megatron-core). :func:`classify` decides:

* ``match``: bitwise equal to the spec;
* ``production``: not the spec, but bitwise equal to a documented production model
  (the finding names it and the megatron-core module and function);
* ``bug``: equal to neither (the finding gives the ULP distances);
* ``skip``: could not run in this version or on this device (the reason).

A *finding* is anything that is not ``match``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum

import torch

from verify.metrics import compare


class Verdict(str, Enum):
    MATCH = "match"
    PRODUCTION = "production"
    BUG = "bug"
    SKIP = "skip"


@dataclass(frozen=True)
class Finding:
    """One comparison's outcome: what was compared, the verdict, why, and where it lives."""

    technique: str
    name: str
    verdict: Verdict
    detail: str = ""
    where: str = ""

    def to_dict(self) -> dict:
        out = asdict(self)
        out["verdict"] = self.verdict.value
        return out

    def line(self) -> str:
        where = f" [{self.where}]" if self.where else ""
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.verdict.value.upper():10s} {self.technique}: {self.name}{where}{detail}"


@dataclass(frozen=True)
class Model:
    """A refgrad variant that models a documented production behaviour, and where it lives."""

    name: str
    expected: torch.Tensor
    where: str


def _describe(reference: torch.Tensor, observed: torch.Tensor) -> str:
    c = compare(reference, observed)
    return f"{c.n_mismatch}/{c.n} elements differ, max {c.max_ulp} ULP"


def classify(technique: str, name: str, observed: torch.Tensor, spec: torch.Tensor,
             documented: Sequence[Model] = ()) -> Finding:
    """``match`` if ``observed`` is bitwise ``spec``, ``production`` if it is a documented
    model's, otherwise ``bug`` (ULP distances to the spec and each model in the detail)."""
    if compare(spec, observed).bitwise_equal:
        return Finding(technique, name, Verdict.MATCH)
    for model in documented:
        if compare(model.expected, observed).bitwise_equal:
            return Finding(technique, name, Verdict.PRODUCTION,
                           f"{model.name} (vs refgrad's spec: {_describe(spec, observed)})",
                           model.where)
    parts = [f"vs refgrad's spec: {_describe(spec, observed)}"]
    parts += [f"vs {m.name}: {_describe(m.expected, observed)}" for m in documented]
    return Finding(technique, name, Verdict.BUG, "; ".join(parts))


def expect_equal(technique: str, name: str, observed: object, expected: object,
                 documented: Sequence[tuple[str, object, str]] = ()) -> Finding:
    """:func:`classify` for plain data (layouts, counts): ``documented`` holds
    ``(name, expected, where)`` of production behaviours."""
    if observed == expected:
        return Finding(technique, name, Verdict.MATCH)
    for model_name, model_expected, where in documented:
        if observed == model_expected:
            return Finding(technique, name, Verdict.PRODUCTION, model_name, where)
    return Finding(technique, name, Verdict.BUG, f"got {observed!r}, refgrad gives {expected!r}")


def summarize(findings: Sequence[Finding]) -> dict[str, int]:
    """How many findings of each verdict."""
    counts = {v.value: 0 for v in Verdict}
    for f in findings:
        counts[f.verdict.value] += 1
    return counts

"""The seam between verify and the implementation under test.

A *candidate* is one implementation of the techniques gradverify verifies: fastgrad (ours,
the default) or Megatron-Core (the code most users train with). Every check and the
preflight twin reach the implementation only through a :class:`Candidate`, one typed
interface per technique (a :class:`typing.Protocol` in ``verify.candidates.api.<technique>``),
never by importing it. A candidate that cannot run a technique here (its installed version
lacks the feature, or it needs a GPU) raises :class:`Unsupported` with the reason, and the
check records a SKIP naming it: nothing is dropped silently.

A candidate is a frozen dataclass: it is pickled into the spawned rank processes, which
ask it for the technique they run (``candidate.pipeline()`` inside the rank), so an
implementation is imported only where it runs.

Deliberately broken candidates, which prove that each check can fail, are the tests' own
subclasses of a candidate (``tests/candidates/*_faults.py``): they go through the same seam as
production, and the seam knows nothing of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from verify.candidates.api.core import Behaviour, DocumentedBehaviour, Technique, Unsupported
from verify.candidates.api.findings import (
    CrashSignature,
    Effect,
    Finding,
    LaunchSettings,
)

if TYPE_CHECKING:  # the technique interfaces, for annotations only
    from verify.candidates.api.deferred_wgrad import DeferredWgrad
    from verify.candidates.api.grad_reduction import GradReduction
    from verify.candidates.api.layout import BucketLayout
    from verify.candidates.api.mxfp8 import MXFP8
    from verify.candidates.api.optimizer import DistributedOptimizerStep
    from verify.candidates.api.pipeline import PipelineTraining


@dataclass(frozen=True)
class CandidateInfo:
    """What a report says about a candidate: its name, its installed version and how it ran.

    ``redirects`` lists what had to be redirected for it to run on this device (empty when
    it runs as published), ``unsupported`` the techniques it cannot run here with the reason.
    """

    name: str
    version: str
    description: str
    redirects: tuple[str, ...] = ()
    unsupported: tuple[tuple[str, str], ...] = ()
    details: tuple[tuple[str, str], ...] = field(default=())

    def to_dict(self) -> dict:
        """Plain values for the JSON report."""
        return {
            "name": self.name,
            "version": self.version,
            "description": self.description,
            "redirects": list(self.redirects),
            "unsupported": {t: r for t, r in self.unsupported},
            "details": dict(self.details),
        }


class Candidate(ABC):
    """One implementation of the verified techniques (subclasses are frozen dataclasses).

    Each technique accessor returns that technique's typed interface, or raises
    :class:`Unsupported` with the reason. The accessors are called where the technique runs
    (inside a rank process for the multi-rank techniques), so they may import the
    implementation and set up what it needs there.
    """

    name: ClassVar[str]
    # The packages its code lives in: a rank's crash whose root cause lies in them (or in a
    # library they call) is the candidate's; elsewhere it is the harness's own error. The
    # module defining the candidate's class counts too (a test's broken subclass).
    code_modules: ClassVar[tuple[str, ...]] = ()
    # Modules its ranks import, which the rank launcher's fork server imports once so that
    # every fresh rank process starts with them (e.g. Megatron-Core: ~3 s of CPU a rank).
    preload_modules: ClassVar[tuple[str, ...]] = ()
    # True: a configuration may leave process-wide state behind (a module global, a
    # process-wide group), so each configuration a check builds runs in fresh processes.
    # False only for a candidate that by design keeps none (fastgrad).
    isolates_configurations: ClassVar[bool] = True

    @abstractmethod
    def info(self) -> CandidateInfo:
        """Name, installed version, redirects and unsupported techniques, for the report."""

    @property
    def label(self) -> str:
        """How reports name it: the candidate's name (a test's deliberately broken subclass
        adds the bug it carries, as ``"<name> (fault: <bug>)"``)."""
        return self.name

    def documented(self, behaviour: Behaviour) -> DocumentedBehaviour | None:
        """How this candidate documents ``behaviour`` (None: it follows refgrad's spec there)."""
        del behaviour
        return None

    def findings(self) -> tuple[Finding, ...]:
        """The root causes this candidate is known to have, each with its rule (none: every
        failure is a FAIL of its own)."""
        return ()

    @property
    def own_modules(self) -> tuple[str, ...]:
        """The packages whose crashes are this candidate's: :attr:`code_modules` and the
        module of its own class."""
        return (*self.code_modules, type(self).__module__)

    def unsupported(self, technique: Technique, reason: str) -> Unsupported:
        """The :class:`Unsupported` to raise for ``technique``, naming this candidate."""
        return Unsupported(technique, f"{self.label} {reason}")

    def layout(self) -> BucketLayout:
        """Bucket layout and the padded grad buffer."""
        raise self.unsupported(Technique.LAYOUT, "does not implement the bucket layout")

    def grad_reduction(self) -> GradReduction:
        """The data-parallel gradient reduction (reduce-scatter / all-reduce)."""
        raise self.unsupported(Technique.GRAD_REDUCTION, "does not implement the grad reduction")

    def deferred_wgrad(self) -> DeferredWgrad:
        """The output layer with deferred embedding wgrad, and its drain."""
        raise self.unsupported(Technique.DEFERRED_WGRAD, "does not implement deferred wgrad")

    def pipeline(self) -> PipelineTraining:
        """DDP grad sync with the 1F1B schedules, plain and interleaved."""
        raise self.unsupported(Technique.PIPELINE, "does not implement the pipeline schedules")

    def optimizer(self) -> DistributedOptimizerStep:
        """The distributed optimizer step with the param all-gather."""
        raise self.unsupported(Technique.OPTIMIZER, "does not implement the distributed optimizer")

    def mxfp8(self) -> MXFP8:
        """MXFP8 quantization and param/grad buffer sharing."""
        raise self.unsupported(Technique.MXFP8, "does not implement MXFP8")


__all__ = [
    "Behaviour",
    "Candidate",
    "CandidateInfo",
    "CrashSignature",
    "DocumentedBehaviour",
    "Effect",
    "Finding",
    "LaunchSettings",
    "Technique",
    "Unsupported",
]

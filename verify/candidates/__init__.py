"""What ``verify`` holds to refgrad: the candidates, reached only through this package.

See :mod:`verify.candidates.api` for the seam and ``docs/candidates.md`` for how to add one.
"""

from verify.candidates.api import (
    Behaviour,
    Candidate,
    CandidateInfo,
    DocumentedBehaviour,
    Fault,
    Technique,
    Unsupported,
)
from verify.candidates.fastgrad import FastgradCandidate
from verify.candidates.registry import CANDIDATES, DEFAULT_CANDIDATE, candidate_named

__all__ = [
    "CANDIDATES",
    "Behaviour",
    "DEFAULT_CANDIDATE",
    "Candidate",
    "CandidateInfo",
    "DocumentedBehaviour",
    "FastgradCandidate",
    "Fault",
    "Technique",
    "Unsupported",
    "candidate_named",
]

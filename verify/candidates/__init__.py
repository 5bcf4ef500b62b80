"""What ``verify`` holds to refgrad: the candidates, reached only through this package.

See :mod:`verify.candidates.interfaces` for the seam and ``docs/candidates.md`` for how to add one.
"""

from verify.candidates.fastgrad import FastgradCandidate
from verify.candidates.interfaces import (
    Behaviour,
    Candidate,
    CandidateInfo,
    DocumentedBehaviour,
    Finding,
    LaunchSettings,
    Technique,
    Unsupported,
)
from verify.candidates.registry import (
    CANDIDATES,
    DEFAULT_CANDIDATE,
    ENTRY_POINT_GROUP,
    candidate_named,
    candidate_names,
    default_candidate,
)

__all__ = [
    "CANDIDATES",
    "ENTRY_POINT_GROUP",
    "Behaviour",
    "DEFAULT_CANDIDATE",
    "Candidate",
    "CandidateInfo",
    "DocumentedBehaviour",
    "FastgradCandidate",
    "Finding",
    "LaunchSettings",
    "Technique",
    "Unsupported",
    "candidate_named",
    "candidate_names",
    "default_candidate",
]

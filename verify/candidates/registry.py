"""The candidates ``verify`` knows by name (``--candidate NAME``), as a fixed table."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from verify.candidates.api import Candidate
from verify.candidates.fastgrad import FastgradCandidate

DEFAULT_CANDIDATE = "fastgrad"

CANDIDATES: Mapping[str, Callable[[], Candidate]] = MappingProxyType({
    "fastgrad": FastgradCandidate,
})


def candidate_named(name: str) -> Candidate:
    """The candidate registered as ``name``; a ValueError lists the valid names otherwise."""
    try:
        factory = CANDIDATES[name]
    except KeyError:
        raise ValueError(f"unknown candidate {name!r}; valid names: {', '.join(CANDIDATES)}") from None
    return factory()

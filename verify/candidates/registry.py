"""The candidates ``verify`` knows by name (``--candidate NAME``), as a fixed table.

Listing a candidate imports its adapter's entry module only, never the implementation:
``MegatronCoreCandidate`` imports megatron-core where a technique runs, and without it
installed every technique is Unsupported with the install hint."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from verify.candidates.api import Candidate
from verify.candidates.fastgrad import FastgradCandidate
from verify.candidates.megatron_core.candidate import MegatronCoreCandidate

DEFAULT_CANDIDATE = "fastgrad"

CANDIDATES: Mapping[str, Callable[[], Candidate]] = MappingProxyType({
    "fastgrad": FastgradCandidate,
    "megatron-core": MegatronCoreCandidate,
})


def candidate_named(name: str) -> Candidate:
    """The candidate registered as ``name``; a ValueError lists the valid names otherwise."""
    try:
        factory = CANDIDATES[name]
    except KeyError:
        raise ValueError(f"unknown candidate {name!r}; valid names: {', '.join(CANDIDATES)}") from None
    return factory()

"""The candidates ``verify`` knows by name (``--candidate NAME``).

Four are built in: fastgrad (the default), Megatron-Core, and torch's own DDP and FSDP2. Another package adds its own
through the ``gradverify.candidates`` entry-point group (``pyproject.toml``:
``[project.entry-points."gradverify.candidates"] fsdp2 = "mypkg.gradverify:FSDP2Candidate"``;
``docs/candidates.md``), with no change to gradverify.

Listing names imports nothing; :func:`candidate_named` imports the adapter's entry module
only, never the implementation: ``MegatronCoreCandidate`` imports megatron-core where a
technique runs, and without it installed every technique is Unsupported with the install
hint."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType

from verify.candidates.fastgrad import FastgradCandidate
from verify.candidates.interfaces import Candidate
from verify.candidates.megatron_core.candidate import MegatronCoreCandidate
from verify.candidates.torch_ddp.candidate import TorchDDPCandidate
from verify.candidates.torch_fsdp2.candidate import TorchFSDP2Candidate

DEFAULT_CANDIDATE = "fastgrad"
ENTRY_POINT_GROUP = "gradverify.candidates"

CANDIDATES: Mapping[str, Callable[[], Candidate]] = MappingProxyType({
    "fastgrad": FastgradCandidate,
    "megatron-core": MegatronCoreCandidate,
    "torch-ddp": TorchDDPCandidate,
    "torch-fsdp2": TorchFSDP2Candidate,
})
"""The built-in candidates (their names cannot be taken by a plugin)."""


class CandidatePluginError(ValueError):
    """An installed ``gradverify.candidates`` entry point that cannot be used."""


def _plugins() -> dict[str, EntryPoint]:
    """Installed entry points of the group by name (a built-in name is refused)."""
    found: dict[str, EntryPoint] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in CANDIDATES:
            raise CandidatePluginError(
                f"the {ENTRY_POINT_GROUP} entry point {point.name!r} = {point.value!r} takes the "
                f"name of a built-in candidate; give it another name")
        found[point.name] = point
    return found


def candidate_names() -> tuple[str, ...]:
    """Every name ``--candidate`` takes: the built-ins, then installed plugins, sorted."""
    return (*CANDIDATES, *sorted(_plugins()))


def default_candidate() -> Candidate:
    """The candidate a check or twin verifies when none is named (fastgrad)."""
    return CANDIDATES[DEFAULT_CANDIDATE]()


def candidate_named(name: str) -> Candidate:
    """The candidate registered as ``name``; a ValueError lists the valid names otherwise."""
    factory = CANDIDATES.get(name)
    if factory is not None:
        return factory()
    point = _plugins().get(name)
    if point is None:
        raise ValueError(f"unknown candidate {name!r}; valid names: {', '.join(candidate_names())}")
    try:
        factory = point.load()
    except Exception as exc:  # a plugin's import error is reported, not a traceback
        raise CandidatePluginError(f"candidate {name!r} ({ENTRY_POINT_GROUP} entry point "
                                   f"{point.value!r}) failed to import: {exc}") from exc
    if not (isinstance(factory, type) and issubclass(factory, Candidate)):
        raise CandidatePluginError(f"candidate {name!r}: the entry point {point.value!r} must name a "
                                   f"subclass of verify.candidates.interfaces.Candidate")
    candidate = factory()
    if candidate.name != name:
        raise CandidatePluginError(f"candidate {name!r}: {point.value!r} calls itself "
                                   f"{candidate.name!r}; the entry point's name must be its name")
    return candidate


__all__ = ["CANDIDATES", "DEFAULT_CANDIDATE", "ENTRY_POINT_GROUP", "CandidatePluginError",
           "candidate_named", "candidate_names", "default_candidate"]

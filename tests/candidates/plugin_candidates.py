"""Candidates as a third-party package would ship them (``gradverify.candidates`` entry points)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from verify.candidates.fastgrad import FastgradCandidate
from verify.candidates.interfaces import CandidateInfo


@dataclass(frozen=True)
class VendoredFastgrad(FastgradCandidate):
    """fastgrad under another name, as a package vendoring it would register it."""

    name: ClassVar[str] = "vendored-fastgrad"

    def info(self) -> CandidateInfo:
        return CandidateInfo(name=self.name, version="9.9", description="fastgrad, vendored")


@dataclass(frozen=True)
class Misnamed(FastgradCandidate):
    name: ClassVar[str] = "another-name"


class NotACandidate:
    pass

"""A commit's tree for the bench scripts that time today's code against an earlier one
(imported as ``_commits``; bench/ is on sys.path when a script runs)."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def export_commit(commit: str, directory: Path) -> Path:
    """The tree of ``commit`` unpacked into ``directory`` (run from there, or on PYTHONPATH)."""
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=REPO, check=True,
                             capture_output=True).stdout
    path = directory / "tree.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(directory / "tree", filter="data")
    return directory / "tree"

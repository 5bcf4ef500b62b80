"""Helpers for multi-rank tests: real gloo process groups on localhost."""

from verify.distributed import spawn as run_distributed

__all__ = ["run_distributed"]

"""Megatron-Core as a verified candidate (see redirect, runtime, version and the drivers)."""

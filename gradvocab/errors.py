"""The exception every package raises when an object is used out of order."""


class LifecycleError(RuntimeError):
    """A buffer, grid or schedule was used out of order (e.g. reading params after their bucket
    was zeroed, or this rank's groups asked of a ``ParallelDims`` that holds sizes only)."""


__all__ = ["LifecycleError"]

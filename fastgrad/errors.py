"""Exceptions raised by fastgrad when it refuses to compute garbage."""


class LifecycleError(RuntimeError):
    """A buffer or schedule was used out of order (e.g. reading params after their bucket was zeroed)."""


__all__ = ["LifecycleError"]

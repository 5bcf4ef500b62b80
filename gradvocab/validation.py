"""The one integer check the vocabulary's types share: a value that is an int (anything
``operator.index`` accepts, never a bool) and at least a minimum, its errors naming the
parameter and the rule."""

from __future__ import annotations

import operator


def int_at_least(value: object, what: str, minimum: int, *, expected: str = "an int",
                 rule: str | None = None) -> int:
    """``value`` as an ``int``; ``what`` names it in the errors.

    TypeError ``"<what> must be <expected>, got <type>"`` for a bool or a non-integer;
    ValueError ``"<what> must be <rule>, got <value>"`` below ``minimum`` (``rule`` defaults
    to ``"an int >= <minimum>"``).
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be {expected}, got bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be {expected}, got {type(value).__name__}") from None
    if number < minimum:
        raise ValueError(f"{what} must be {rule or f'an int >= {minimum}'}, got {number}")
    return number


# The vocabulary's own plumbing, not part of its public face (gradvocab re-exports every
# module's __all__): its modules import it from here.
__all__: list[str] = []

"""Count arguments: ints only, checked in one place.

Every count the public API takes (tokens to trim, a block length, a context,
a number of slots or retained rows) is an integer: a float such as ``1.5``
would put half a token into a ring's arithmetic, and a bool is an int only by
accident of Python's history. ``count`` accepts Python ints and integer types
that say so (``numbers.Integral``: numpy's, for instance), refuses everything
else -- bools and floats included, whatever their value -- and returns a
plain ``int``.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional


def count(value: Any, what: str, minimum: Optional[int] = 0) -> int:
    """``value`` as an ``int`` if it is an integer ``>= minimum`` (no bound when
    ``minimum`` is None), else ``TypeError`` (not an integer) or ``ValueError``
    (too small), naming ``what`` and the value that came."""
    if type(value) is not int:  # (the common case skips the ABC check)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value}")
    return value


def optional_count(value: Any, what: str, minimum: Optional[int] = 0) -> Optional[int]:
    """``count`` that lets ``None`` (the default) through."""
    return None if value is None else count(value, what, minimum)

"""Small argument checks shared by the pools' public calls: a bad argument raises an error
naming the call and the argument, never a bare ``TypeError`` from a comparison inside."""

from __future__ import annotations

import numpy as np


def check_int(value: object, what: str, where: str) -> int:
    """``value`` as an int: ``TypeError`` naming ``what`` and ``where`` for a bool, float,
    string, ``None`` or anything else that is not an integer (numpy integers pass)."""
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: {what} must be an int, got {type(value).__name__} "
                        f"{value!r:.20}")
    return int(value)

"""``count_nonzero`` of a whole array, without numpy's Python wrapper.

``np.count_nonzero(a)`` is a Python function that, with no axis, calls numpy's C
``count_nonzero``; on the scheduler's path, where the arrays are a few pages long, the
wrapper's two Python frames cost about three times the count (0.5 us against 0.13 on the
2-core CPU of the scheduler bench) and the hot paths call it a dozen times a request. The
C function is the one the wrapper calls, so the result is the same for every input.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike

try:  # numpy 2
    from numpy._core.multiarray import count_nonzero as _c_count_nonzero
except ImportError:  # pragma: no cover - numpy 1 keeps it under numpy.core
    from numpy.core.multiarray import count_nonzero as _c_count_nonzero  # type: ignore[no-redef]

__all__ = ["count_nonzero"]

count_nonzero: Callable[[ArrayLike], np.intp] = _c_count_nonzero
"""Non-zero (``True``) elements of the whole array ``a`` (a numpy integer, as
``np.count_nonzero`` returns)."""

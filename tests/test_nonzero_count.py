"""The C-level count of non-zero elements the hot paths use equals numpy's own."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.pools.nonzero_count import count_nonzero


@pytest.mark.parametrize("values", [
    np.zeros(0, dtype=bool),
    np.array([True, False, True]),
    np.array([0, 3, -1, 0, 7], dtype=np.int64),
    np.array([0, 2, 0], dtype=np.int32),
    np.arange(1 << 17, dtype=np.int64) % 3,
    np.zeros((4, 5), dtype=np.uint8) + np.eye(4, 5, dtype=np.uint8),
])
def test_counts_what_numpy_counts(values: np.ndarray) -> None:
    got = count_nonzero(values)
    assert got == np.count_nonzero(values)
    assert type(got) is type(np.count_nonzero(values))


def test_a_view_counts_only_its_elements() -> None:
    values = np.arange(10, dtype=np.int64)
    assert count_nonzero(values[::3] > 2) == 3  # of 0, 3, 6, 9
    assert count_nonzero(values[1::4]) == 3  # 1, 5, 9

"""The fast recognition of valid slot indices agrees with the full checks on any input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.pools import IndexSpace, Indices
from hicache.pools.page_ids import (
    _checked_page_ids,
    checked_pages,
    is_run,
    owned_page_ids,
    page_ids,
    single_page,
    valid_pages,
)

PAGE, PAGES = 4, 12


def checked_the_long_way(indices: Indices) -> np.ndarray | None:
    """The pages by the one-check-at-a-time path, or ``None`` when it raises."""
    try:
        return _checked_page_ids(
            indices,
            space=IndexSpace.DEVICE_FULL,
            pool_name="full",
            page_size=PAGE,
            num_pages=PAGES,
            op="test",
        )
    except (TypeError, ValueError):
        return None


slot_lists = st.one_of(
    # whole pages, maybe shuffled or repeated, maybe out of range
    st.lists(st.integers(-2, PAGES + 2), max_size=8).map(
        lambda pages: [p * PAGE + o for p in pages for o in range(PAGE)]
    ),
    # arbitrary slots
    st.lists(st.integers(-5, (PAGES + 2) * PAGE), max_size=16),
    # runs of consecutive slots, most starting on a page boundary, of any length
    st.lists(st.tuples(st.integers(-1, PAGES + 1), st.sampled_from([0, 0, 0, 1]),
                       st.integers(1, 3 * PAGE)), max_size=4).map(
        lambda runs: [s for page, shift, n in runs
                      for s in range(page * PAGE + shift, page * PAGE + shift + n)]),
    # whole pages running up to the top of int32 or int64 and maybe past it (a +1
    # difference wraps there), then a valid page
    st.tuples(st.sampled_from([2**31, 2**63]), st.integers(1, 2),
              st.integers(1, 3)).map(lambda t: list(range(t[0] - t[1] * PAGE,
                                                           t[0] + (t[2] - t[1]) * PAGE))
                                     + list(range(PAGE, 2 * PAGE))),
)


@settings(max_examples=1500, deadline=None)
@given(
    slots=slot_lists,
    dtype=st.sampled_from([torch.int32, torch.int64]),
    space=st.sampled_from([IndexSpace.DEVICE_FULL, IndexSpace.HOST_FULL]),
)
def test_fast_path_accepts_only_what_the_checks_accept(
    slots: list[int], dtype: torch.dtype, space: IndexSpace
) -> None:
    top = torch.iinfo(dtype).max
    slots = [(s + top + 1) % (2 * (top + 1)) - top - 1 for s in slots]  # wrap to the dtype
    indices = Indices(torch.tensor(slots, dtype=dtype), space)
    fast = valid_pages(indices, IndexSpace.DEVICE_FULL, PAGE, PAGES)
    long = checked_the_long_way(indices)
    checked = checked_pages(indices, IndexSpace.DEVICE_FULL, PAGE, PAGES)
    assert (checked is None) == (fast is None)
    if fast is not None:
        assert long is not None and np.array_equal(fast, long)
        assert checked is not None and np.array_equal(checked[0], fast)
        # told a run, by its first page, exactly when the pages are one
        assert checked[1] == (int(fast[0]) if is_run(fast) else None)
    if long is not None and len(slots):
        assert fast is not None  # valid input never takes the long path
    else:
        assert fast is None


def test_pages_are_a_copy() -> None:
    tensor = torch.arange(PAGE, 2 * PAGE, dtype=torch.int64)
    pages = page_ids(
        Indices(tensor, IndexSpace.DEVICE_FULL),
        space=IndexSpace.DEVICE_FULL,
        pool_name="full",
        page_size=PAGE,
        num_pages=PAGES,
        op="test",
    )
    tensor.fill_(0)
    assert pages.tolist() == [1]


@pytest.mark.parametrize(
    "slots, message",
    [
        ([PAGE, PAGE + 1], "whole number of pages"),
        ([0, 1, 2, 3], "reserved for padding"),
        ([PAGE + 1, PAGE, PAGE + 2, PAGE + 3], "whole, ordered pages"),
        ([PAGE * 13, PAGE * 13 + 1, PAGE * 13 + 2, PAGE * 13 + 3], "out of range"),
        # a slot twice in pages whose first and last slots span them, as a run's would
        ([PAGE, PAGE, *range(PAGE + 2, 3 * PAGE)], "whole, ordered pages"),
        # ascending pages that are not one run, the last one past the pool
        ([p * PAGE + o for p in (1, 3, PAGES + 1) for o in range(PAGE)], "out of range"),
    ],
)
def test_errors_name_what_is_wrong(slots: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        page_ids(
            Indices(torch.tensor(slots), IndexSpace.DEVICE_FULL),
            space=IndexSpace.DEVICE_FULL,
            pool_name="full",
            page_size=PAGE,
            num_pages=PAGES,
            op="test",
        )


def test_single_page_names_only_one_whole_page_of_cpu_integer_slots() -> None:
    """The one-page free's shortcut: the page of one whole valid page; ``None`` (the
    checked path then names what is wrong) for anything else, even with a page's values."""
    page = torch.arange(PAGE, 2 * PAGE)
    full = IndexSpace.DEVICE_FULL
    assert single_page(Indices(page, full), full, PAGE, PAGES) == 1
    assert single_page(Indices(page.to(torch.int32), full), full, PAGE, PAGES) == 1
    last = torch.arange(PAGES * PAGE, (PAGES + 1) * PAGE)
    assert single_page(Indices(last, full), full, PAGE, PAGES) == PAGES
    for other in (page.view(1, PAGE), page.to(torch.float32), page + PAGES * PAGE,
                  page - PAGE, page.flip(0), page[:-1]):
        assert single_page(Indices(other, full), full, PAGE, PAGES) is None
    assert single_page(Indices(page, IndexSpace.HOST_FULL), full, PAGE, PAGES) is None
    assert single_page(page, full, PAGE, PAGES) is None  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_single_page_is_none_for_cuda_slots() -> None:
    page = torch.arange(PAGE, 2 * PAGE, device="cuda")
    full = IndexSpace.DEVICE_FULL
    assert single_page(Indices(page, full), full, PAGE, PAGES) is None


@pytest.mark.parametrize("values,expected", [
    ([], True), ([7], True), ([3, 4, 5], True), ([3, 5, 4, 6], False), ([3, 4, 4, 6], False),
    ([5, 4, 3], False), (list(range(100, 100 + (1 << 16) + 5)), True),
    ([*range(10, 20), 21], False), ([10, 12, 11, 13], False), ([10, 9, 12, 13], False),
])
def test_is_run(values: list[int], expected: bool) -> None:
    for dtype in (np.int32, np.int64):
        assert is_run(np.array(values, dtype=dtype)) is expected


def test_is_run_does_not_wrap_at_the_top_of_the_dtype() -> None:
    """Values that pass the top of int32/int64 and wrap to its bottom are not a run."""
    for dtype in (np.int32, np.int64):
        top = int(np.iinfo(dtype).max)
        assert not is_run(np.array([top - 1, top, -top - 1], dtype=dtype))  # top + 1 wrapped
        assert is_run(np.array([top - 2, top - 1, top], dtype=dtype))


def test_owned_page_ids_equal_the_checked_ids_of_whole_pages() -> None:
    slots = torch.tensor([32, 33, 34, 35, 8, 9, 10, 11, 12, 13, 14, 15], dtype=torch.int64)
    indices = Indices(slots, IndexSpace.DEVICE_FULL)
    checked = page_ids(indices, space=IndexSpace.DEVICE_FULL, pool_name="p", page_size=4,
                       num_pages=20, op="t")
    assert owned_page_ids(indices, 4).tolist() == checked.tolist() == [8, 2, 3]

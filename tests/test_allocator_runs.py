"""Run-friendly allocation: requests land in consecutive pages whenever the free list allows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.controller.stats import _breaks
from hicache.pools import IndexSpace, Indices, PageAllocator
from hicache.pools.free_runs import FreeRuns


def pages(allocator: PageAllocator, ids: list[int]) -> Indices:
    slots = [p * allocator.page_size + o for p in ids for o in range(allocator.page_size)]
    return Indices(torch.tensor(slots), allocator.space)


def holey() -> PageAllocator:
    """Pages 1..12 with free runs [2..3] (2 pages), [5..8] (4 pages), [10] (1 page)."""
    allocator = PageAllocator(12, 2, IndexSpace.HOST_FULL, "host")
    assert allocator.try_alloc(24) is not None
    allocator.free(pages(allocator, [2, 3]))
    allocator.free(pages(allocator, [5, 6, 7, 8]))
    allocator.free(pages(allocator, [10]))
    return allocator


def test_free_runs() -> None:
    """free_runs lists (first page, length) lowest first."""
    starts, lengths = holey().free_runs()
    assert starts.tolist() == [2, 5, 10] and lengths.tolist() == [2, 4, 1]


def test_smallest_fitting_run_is_used() -> None:
    """A 2-page request takes the 2-page hole, leaving the 4-page run whole."""
    allocator = holey()
    got = allocator.try_alloc(4)
    assert got is not None and got.tensor.tolist() == [4, 5, 6, 7]
    allocator.check_integrity()


def test_fitting_run_beats_lower_fragments() -> None:
    """A 3-page request skips the lower 2-page hole for the 4-page run: one copy, not two."""
    allocator = holey()
    got = allocator.try_alloc(6)
    assert got is not None and got.tensor.tolist() == list(range(10, 16))


def test_longest_runs_first_when_nothing_fits() -> None:
    """A 5-page request draws on the 4-page and the 2-page runs (two pieces), lowest pages
    of those first; the 1-page hole is untouched."""
    allocator = holey()
    got = allocator.try_alloc(10)
    assert got is not None
    assert got.tensor.tolist() == [4, 5, 6, 7, 10, 11, 12, 13, 14, 15]
    starts, lengths = allocator.free_runs()
    assert starts.tolist() == [8, 10] and lengths.tolist() == [1, 1]
    allocator.check_integrity()


@pytest.mark.parametrize("page_size", [1, 3])
@pytest.mark.parametrize("holes", [5, 40])
def test_allocation_over_many_runs_gives_every_page_once(page_size: int, holes: int) -> None:
    """A request drawing on few runs (concatenated ranges) or many (expanded in one
    vectorised pass) gets the same pages from try_alloc and try_alloc_pages: the lowest
    pages of the runs, every one once, slots page after page."""
    for call in ("try_alloc", "try_alloc_pages"):
        allocator = PageAllocator(4 * holes, page_size, IndexSpace.HOST_FULL, "host")
        assert allocator.try_alloc(4 * holes * page_size) is not None
        freed = [page for hole in range(holes) for page in (4 * hole + 2, 4 * hole + 3)]
        allocator.free(pages(allocator, freed[::-1][:2] + freed[:-2]))  # out of order
        want = freed[:-1]  # every hole but the last page
        got = getattr(allocator, call)(len(want) * page_size)
        assert got is not None
        slots = got if call == "try_alloc" else got[0]
        assert slots.tensor.tolist() == pages(allocator, want).tensor.tolist()
        if call == "try_alloc_pages":
            assert got[1].dtype == np.int64 and got[1].tolist() == want
        starts, lengths = allocator.free_runs()
        assert starts.tolist() == [freed[-1]] and lengths.tolist() == [1]
        allocator.check_integrity()


def test_equal_longest_runs_go_lowest_first() -> None:
    """With no run long enough, equal longest runs are taken lower start first and the
    surplus stays at the top of the highest run taken."""
    allocator = PageAllocator(12, 1, IndexSpace.HOST_FULL, "host")
    assert allocator.try_alloc(12) is not None
    allocator.free(pages(allocator, [2, 3, 6, 7, 10, 11]))
    got = allocator.try_alloc(3)
    assert got is not None and got.tensor.tolist() == [2, 3, 6]
    starts, lengths = allocator.free_runs()
    assert starts.tolist() == [7, 10] and lengths.tolist() == [1, 2]
    allocator.check_integrity()


def test_free_merges_with_both_neighbours() -> None:
    """Freeing the pages between two free runs leaves one run over all three."""
    allocator = holey()
    allocator.free(pages(allocator, [4]))
    allocator.free(pages(allocator, [9]))
    starts, lengths = allocator.free_runs()
    assert starts.tolist() == [2] and lengths.tolist() == [9]
    allocator.check_integrity()


def test_scattered_unordered_free_makes_one_run_per_gap() -> None:
    """Pages freed out of order and apart join the runs they touch, one run per gap."""
    allocator = PageAllocator(12, 2, IndexSpace.HOST_FULL, "host")
    assert allocator.try_alloc(24) is not None
    allocator.free(pages(allocator, [7, 1, 12, 3, 2]))
    starts, lengths = allocator.free_runs()
    assert starts.tolist() == [1, 7, 12] and lengths.tolist() == [3, 1, 1]
    allocator.check_integrity()


def test_fresh_pool_gives_one_run() -> None:
    """A fresh pool hands out consecutive pages from the bottom."""
    allocator = PageAllocator(16, 4, IndexSpace.DEVICE_FULL, "full")
    got = allocator.try_alloc(20)
    assert got is not None and np.array_equal(got.tensor.numpy(), np.arange(4, 24))


def test_stats_report_mean_host_run_length() -> None:
    """TransferStats counts contiguous host runs per op: 2 runs over 5 tokens -> 2.5."""
    from controller_helpers import make_controller

    from hicache.controller import TorchBackend

    ctrl = make_controller(TorchBackend(), page_size=1, host_pages=8)
    host = ctrl.host_pool.allocator
    first, middle, last = host.try_alloc(2), host.try_alloc(3), host.try_alloc(3)
    assert first is not None and middle is not None and last is not None
    host.free(first)
    host.free(last)  # free runs: slots 1-2 and 6-8
    device = ctrl.device_allocator.try_alloc(5)
    assert device is not None and ctrl.write(device) is not None
    ctrl.drain()
    assert ctrl.stats.host_runs[("device_to_host", "full")] == 2
    assert ctrl.stats.mean_host_run_tokens("device_to_host", "full") == 2.5
    assert ctrl.stats.mean_host_run_tokens("host_to_device", "full") is None


def test_free_run_heaps_drop_stale_entries() -> None:
    """Runs that leave by merging stay in their length's heap only until stale entries
    outnumber live ones; the next insert of that length compacts the heap."""
    runs = FreeRuns(1000)
    runs.take(1, 1000)
    for page in range(1, 1000, 2):
        runs.add(page, 1)  # 500 one-page runs
    for page in range(998, 300, -2):
        runs.add(page, 1)  # merges the one-page run below into the run above
    live = runs._counts[1]
    assert len(runs._starts[1]) == 500 > 2 * live + 16  # stale entries wait
    runs.take(1, 1)
    runs.add(1, 1)  # an insert of that length compacts
    assert len(runs._starts[1]) == live
    assert runs.best_fit(1) == 1 and runs.best_fit(2) == 301
    runs.check_integrity("full")


def test_host_runs_counted_per_page_match_the_slots() -> None:
    """Breaks between host runs counted on page ids (repeats included) are those of the
    sorted slots they stand for."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        page_size = int(rng.integers(1, 5))
        pages = rng.integers(1, 15, int(rng.integers(1, 12)))
        slots = np.sort((pages[:, None] * page_size + np.arange(page_size)).reshape(-1))
        assert _breaks(pages, page_size) == np.count_nonzero(np.diff(slots) != 1), pages
        distinct = np.unique(pages)  # an allocation's: distinct, ascending
        assert _breaks(distinct, page_size, ascending=True) == _breaks(distinct, page_size)


def _host_pages(ctrl, taken: list[int], freed: list[int]) -> None:
    """Take host pages ``taken`` one by one (in order from page 1), then free ``freed``."""
    host = ctrl.host_pool.allocator
    pages = {}
    for page in taken:
        got = host.try_alloc(host.page_size)
        assert got is not None and int(got.tensor[0]) // host.page_size == page
        pages[page] = got
    for page in freed:
        host.free(pages[page])


def test_host_runs_of_merged_writes_interleaving_their_pages() -> None:
    """Two writes queued before one start are one op: host pages [1, 5] and [2, 4] join as
    [1, 5, 2, 4], which spans its count but is two runs of slots (1-2, 4-5), not one."""
    from controller_helpers import make_controller

    from hicache.controller import TorchBackend

    ctrl = make_controller(TorchBackend(), page_size=2, host_pages=5)
    _host_pages(ctrl, [1, 2, 3, 4, 5], [1, 5])
    first = ctrl.device_allocator.try_alloc(4)
    assert first is not None
    host_a = ctrl.write(first)
    assert host_a is not None and host_a.tensor[::2].tolist() == [2, 10]
    ctrl.host_pool.allocator.free(Indices(torch.tensor([4, 5, 8, 9]), IndexSpace.HOST_FULL))
    second = ctrl.device_allocator.try_alloc(4)
    assert second is not None
    host_b = ctrl.write(second)
    assert host_b is not None and host_b.tensor[::2].tolist() == [4, 8]
    ctrl.start_writing()
    ctrl.drain()
    assert ctrl.stats.ops_submitted["device_to_host"] == 1  # one op for both calls
    assert ctrl.stats.host_runs[("device_to_host", "full")] == 2
    assert ctrl.stats.mean_host_run_tokens("device_to_host", "full") == 4.0


def test_host_runs_of_one_write_with_a_gap_of_one_page() -> None:
    """One write of pages [1, 2, 5] (ascending, one allocation's): two runs, though its
    last page is one past the span of a single run."""
    from controller_helpers import make_controller

    from hicache.controller import TorchBackend

    ctrl = make_controller(TorchBackend(), page_size=2, host_pages=5)
    _host_pages(ctrl, [1, 2, 3, 4, 5], [1, 2, 5])
    device = ctrl.device_allocator.try_alloc(6)
    assert device is not None
    host = ctrl.write(device)
    assert host is not None and host.tensor[::2].tolist() == [2, 4, 10]
    ctrl.drain()
    assert ctrl.stats.host_runs[("device_to_host", "full")] == 2

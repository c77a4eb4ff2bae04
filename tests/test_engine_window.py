"""The reference engine's sliding-window bookkeeping (hicache.engine.window) and a request's
slots (hicache.engine.request): which own pages give their SWA rows back and when, how many
SWA pages admission reserves, which cached prefix SWA layers can reuse (CPU)."""

from __future__ import annotations

import pytest
import torch

from hicache.engine.request import Request
from hicache.engine.window import SlidingWindow, held_swa_pages
from hicache.engine.workload import Turn
from hicache.pools import AttentionKind, HybridSWAPool, IndexSpace, Indices, RowGeometry
from hicache.radix import TreeNode

PAGE = 4
WINDOW = 6  # a token reads itself and the 5 before it
CHUNK = 8


@pytest.fixture
def pool() -> HybridSWAPool:
    geometry = RowGeometry(AttentionKind.MHA, 1, 2, 0, torch.float32)
    return HybridSWAPool(num_layers=2, swa_layers=[1], full_pages=16, swa_pages=16,
                         page_size=PAGE, geometry=geometry, device="cpu")


@pytest.fixture
def window(pool: HybridSWAPool) -> SlidingWindow:
    return SlidingWindow(pool, WINDOW, PAGE, CHUNK)


def request(prefix_pages: list[int], own_pages: list[int], prompt_tokens: int = 40) -> Request:
    prefix = torch.tensor(prefix_pages, dtype=torch.int64)[:, None] * PAGE + torch.arange(PAGE)
    made = Request(Turn(0, 0, (), 4), list(range(prompt_tokens)), PAGE,
                   TreeNode(0, b"", None, 0),
                   Indices(prefix.reshape(-1), IndexSpace.DEVICE_FULL), 0, 0, 0)
    made.own_pages = list(own_pages)
    return made


def test_own_pages_leave_the_window_from_the_first_one(window: SlidingWindow) -> None:
    """At 16 computed tokens the next page starts at 16 and reads back to 11: pages 0, 1
    (tokens 0..7) are out of every future window; at 20, page 2 (8..11) too."""
    r = request([], [5, 6, 7, 8, 9])
    assert r.num_computed == 0 and held_swa_pages(r) == 5
    r.num_computed = 8
    assert window.pages_to_release(r) == []
    r.num_computed = 16
    assert window.pages_to_release(r) == [5, 6]
    assert window.pages_to_release(r) == []
    assert held_swa_pages(r) == 3
    r.num_computed = 19  # the page boundary counts, not the last token
    assert window.pages_to_release(r) == []
    r.num_computed = 20
    assert window.pages_to_release(r) == [7]
    assert held_swa_pages(r) == 2


def test_prefix_pages_are_the_trees_not_the_requests(window: SlidingWindow) -> None:
    """A 2-page prefix: own pages start at position 8; at 24 tokens the window reaches back
    to 19, so own pages 0, 1 (positions 8..15) go; the prefix's SWA rows are never given."""
    r = request([1, 2], [5, 6, 7, 8])
    assert r.num_computed == 8
    r.num_computed = 16
    assert window.pages_to_release(r) == []
    r.num_computed = 24
    assert window.pages_to_release(r) == [5, 6]
    r.num_computed = 40
    assert window.pages_to_release(r) == [7, 8]  # never past the pages it owns


def test_admission_reserves_the_window_the_page_and_the_next_chunk(
        window: SlidingWindow) -> None:
    """Budget: ceil(5 / 4) = 2 window pages, the current page, 2 chunk pages = 5 pages; a
    running request holding 2 SWA pages may still take 3."""
    assert window.budget_pages == 5
    assert window.tokens_wanted([]) == 5 * PAGE
    holding_two = request([], [5, 6])
    holding_six = request([], [1, 2, 3, 4, 5, 6])
    assert window.tokens_wanted([holding_two]) == (5 + 3) * PAGE
    assert window.tokens_wanted([holding_two, holding_six]) == (5 + 3 + 0) * PAGE


def test_a_prefix_is_usable_only_where_its_window_tail_has_swa_rows(
        pool: HybridSWAPool, window: SlidingWindow) -> None:
    """Three cached pages; SWA rows kept only for the last 5 positions (7..11): the whole
    prefix is usable, a cut at 8 is not (it would read 3..7), nor at 4 (0..3)."""
    slots = pool.try_alloc(3 * PAGE)
    assert slots is not None
    pool.free_swa(Indices(slots.tensor[:PAGE], IndexSpace.DEVICE_FULL))
    assert window.usable_prefix(slots, 12) == 12
    assert window.usable_prefix(slots, 8) == 0
    pool.free_swa(Indices(slots.tensor[PAGE:2 * PAGE], IndexSpace.DEVICE_FULL))
    assert window.usable_prefix(slots, 12) == 0


def test_slots_cover_whole_pages_of_the_positions_asked(pool: HybridSWAPool) -> None:
    """5 positions over pages [2, 7, 9]: the first 2 pages' 8 slots, prefix page first."""
    r = request([2], [7, 9])
    assert r.slots(5).tensor.tolist() == [8, 9, 10, 11, 28, 29, 30, 31]
    assert r.slots(4).tensor.tolist() == [8, 9, 10, 11]
    assert len(r.slots(12)) == 12
    assert r.slots(5).space is IndexSpace.DEVICE_FULL


def test_a_window_of_a_page_and_one_token(pool: HybridSWAPool) -> None:
    """Window 5 (4 earlier tokens, one page): at 16 computed tokens the next token reads
    12..16, so all 3 pages before go; admission reserves 1 window page, the current one and
    2 chunk pages; a prefix needs SWA rows for its last page only."""
    window = SlidingWindow(pool, 5, PAGE, CHUNK)
    assert window.budget_pages == 4
    r = request([], [5, 6, 7, 8, 9])
    r.num_computed = 12
    assert window.pages_to_release(r) == [5, 6]
    r.num_computed = 16
    assert window.pages_to_release(r) == [7]
    slots = pool.try_alloc(3 * PAGE)
    assert slots is not None
    pool.free_swa(Indices(slots.tensor[:2 * PAGE], IndexSpace.DEVICE_FULL))
    assert window.usable_prefix(slots, 12) == 12
    assert window.usable_prefix(slots, 8) == 0

"""A staged op's host slots found once and cut per chunk, and its chunks' copies from
templates: the same segments, pieces and 2D copies as finding them from each chunk's own
slots and views, for random slots (partial pages, repeats, gaps) and random chunk bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from controller_helpers import make_controller
from test_staged_plans import scattered_move

from hicache.controller import MovedTransfer, copy2d
from hicache.controller.base import SlotPages
from hicache.controller.chunk_slots import OpSlots, run_breaks, segments_between
from hicache.controller.direct_staging import PagePlan
from hicache.controller.slot_segments import (
    page_pieces,
    page_run_segments,
    page_segments,
    whole_pages,
)
from hicache.controller.staged import StagedBackend
from hicache.controller.staged_chunk import ChunkPlan, StagedMove
from hicache.controller.staged_views import StagingBuffer
from hicache.pools import HostLayout


def random_slots(rng: np.random.Generator, page_size: int) -> np.ndarray:
    """Sorted host slots: stretches of consecutive slots of random lengths and gaps (so
    whole pages, partial pages and runs across pages), some slots repeated."""
    lengths = rng.integers(1, 3 * page_size + 2, size=rng.integers(1, 8))
    gaps = rng.integers(0, 2 * page_size, size=lengths.size)
    firsts = np.cumsum(lengths + gaps) - lengths
    slots = np.concatenate([np.arange(first, first + length)
                            for first, length in zip(firsts, lengths, strict=True)])
    repeats = rng.integers(0, slots.size, size=rng.integers(0, 3))
    return np.sort(np.concatenate([slots, slots[repeats]])).astype(np.int64)


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
def test_segments_cut_from_the_op_equal_the_chunk_own(page_size: int) -> None:
    """For 300 random slot sets and chunk bounds (empty, one slot, mid-page, the whole op),
    the op's segments cut to the chunk equal the chunk's own segments, and the pieces a
    plan derives from them equal the chunk's own pieces."""
    rng = np.random.default_rng(page_size)
    for _ in range(300):
        slots = random_slots(rng, page_size)
        segments = page_segments(slots, *page_pieces(slots, page_size), page_size)
        positions = np.array([segment.position for segment in segments], dtype=np.int64)
        bounds = [(0, slots.size), (0, 0), (0, 1),
                  *(sorted(rng.integers(0, slots.size + 1, size=2)) for _ in range(6))]
        for start, end in bounds:
            start, end = int(start), int(end)
            own = slots[start:end]
            cut = segments_between(segments, positions, start, end)
            expected = page_segments(own, *page_pieces(own, page_size), page_size)
            assert cut == expected, (slots, page_size, start, end)
            plan = PagePlan(own, page_size, cut)
            starts, lengths = plan.pieces()
            own_starts, own_lengths = page_pieces(own, page_size)
            assert np.array_equal(starts, own_starts) and np.array_equal(lengths, own_lengths)
            assert plan.whole_pages == bool((own_lengths == page_size).all())


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
def test_whole_page_segments_equal_the_general_ones(page_size: int) -> None:
    """Slots that are whole pages (runs of consecutive pages, gaps, a page repeated, pages
    out of order): :func:`whole_pages` finds them and their segments and positions from one
    entry a page equal :func:`page_segments` of every slot; slots that are not whole pages
    in order (a partial page, a page's slots out of order, a page not from a multiple of the
    page size, no slots) are refused."""
    rng = np.random.default_rng(100 + page_size)
    for _ in range(300):
        runs = rng.integers(1, 6, size=rng.integers(1, 6))
        firsts = np.cumsum(runs + rng.integers(0, 3, size=runs.size)) - runs
        pages = np.concatenate([np.arange(first, first + run)
                                for first, run in zip(firsts, runs, strict=True)])
        if rng.random() < 0.3:  # a page moved twice, or pages not in order
            pages = np.insert(pages, rng.integers(0, pages.size + 1), pages[0])
        if rng.random() < 0.2:
            pages = rng.permutation(pages)
        slots = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)
        found = whole_pages(slots.astype(np.int64), page_size)
        assert found is not None and np.array_equal(found, pages)
        segments, positions = page_run_segments(found, page_size)
        assert segments == page_segments(slots, *page_pieces(slots, page_size), page_size)
        assert positions.tolist() == [segment.position for segment in segments]
    assert whole_pages(np.zeros(0, dtype=np.int64), page_size) is None
    if page_size > 1:
        one_page = np.arange(page_size, dtype=np.int64)
        for refused in (one_page[:-1], one_page[::-1].copy(), one_page + 1):
            assert whole_pages(refused, page_size) is None, refused


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_template_copies_equal_copies_planned_from_views(layout: HostLayout) -> None:
    """Every chunk of a scattered move, for several layer shapes and chunk sizes: the copies
    shifted from templates equal ``plan_copies`` of the chunk's own views, run by run; the
    same move again (a new op of the same slots) plans no new template."""
    backend = StagedBackend(4)
    ctrl = make_controller(backend, page_size=4, num_layers=4, layout=layout)
    buffer = StagingBuffer(torch.zeros(4096, dtype=ctrl.device_pool.data.dtype))
    for round_number, seed in enumerate((0, 1, 1)):
        moved = scattered_move(ctrl, seed)
        move = StagedMove(moved, None)
        planned = backend.templates.planned
        for chunk_tokens in (4, 8, 21):
            for shape in (((0, 1),), ((0, 2),), ((0, 1), (1, 2)), ((0, 4),)):
                for plan in move.chunks(moved, chunk_tokens, shape, buffer,
                                        backend.templates):
                    assert isinstance(plan, ChunkPlan) and plan.copies is not None
                    staged = plan.staged(buffer)
                    for copies, (offset, count) in zip(plan.copies, shape, strict=True):
                        expected = [planned_copy for views in plan.views(staged, offset, 0,
                                                                         count)
                                    for planned_copy in copy2d.plan_copies(
                                        *views, moved.source.host_pool.data.data_ptr(),
                                        buffer.data.data_ptr())]
                        assert copies == expected, (chunk_tokens, shape)
        if round_number == 0:
            assert backend.templates.planned > 0
        elif round_number == 2:
            assert backend.templates.planned == planned  # seed 1 again: none


def test_op_slots_of_each_layout() -> None:
    """A ``page_first_direct`` op keeps segments (and where they start), the others run
    breaks."""
    for layout in HostLayout:
        ctrl = make_controller(StagedBackend(4), page_size=4, num_layers=2, layout=layout)
        op = OpSlots(scattered_move(ctrl))
        direct = layout is HostLayout.PAGE_FIRST_DIRECT
        assert (op.segments is not None) == direct and (op.breaks is None) == direct


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_run_breaks_from_known_pages_equal_the_slots_own(page_size: int) -> None:
    """An op of whole host pages whose pages its checks found (``layer_first`` host) takes
    its run breaks from the pages: the same breaks as from its slots, for 50 random page
    sets (runs, gaps, out of order)."""
    ctrl = make_controller(StagedBackend(4), page_size=page_size, num_layers=2,
                           layout=HostLayout.LAYER_FIRST)
    rng = np.random.default_rng(page_size)
    move = scattered_move(ctrl)
    for _ in range(50):
        pages = rng.permutation(40)[:rng.integers(1, 30)] + 1
        if rng.integers(2):
            pages = np.sort(pages)
        slots = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)
        host_index = torch.from_numpy(slots.astype(np.int64))
        known = SlotPages(pages.astype(np.int64), page_size, pages.astype(np.int64),
                          page_size, False)
        moved = MovedTransfer(move.source, host_index, host_index, pages=known,
                              device_page_index=torch.from_numpy(pages.astype(np.int64)))
        op = OpSlots(moved)
        assert op.breaks is not None
        assert op.breaks.tolist() == run_breaks(slots).tolist(), pages
        assert OpSlots(MovedTransfer(move.source, host_index, host_index)).breaks.tolist() \
            == op.breaks.tolist()

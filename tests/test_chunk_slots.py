"""A staged op's host slots found once and cut per chunk, and its chunks' copies from
templates: the same segments, pieces and 2D copies as finding them from each chunk's own
slots and views, for random slots (partial pages, repeats, gaps) and random chunk bounds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from controller_helpers import make_controller
from test_staged_plans import scattered_move

from hicache.controller import CacheController, MovedTransfer, copy2d
from hicache.controller.base import PoolTransfer, SlotPages
from hicache.controller.chunk_slots import ChunkSlots, OpSlots, run_breaks, segments_between
from hicache.controller.direct_staging import PagePlan
from hicache.controller.slot_segments import (
    page_pieces,
    page_run_segments,
    page_segments,
    whole_pages,
)
from hicache.controller.staged import StagedBackend
from hicache.controller.staged_chunk import ChunkPlan, StagedMove
from hicache.controller.staged_views import PoolViews, StagingBuffer
from hicache.pools import HostLayout, IndexSpace, Indices


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


def run_move(ctrl: CacheController, first_page: int, num_pages: int,
             known: bool) -> MovedTransfer:
    """``num_pages`` whole host pages from ``first_page`` (one run) and as many device pages
    in a random order; with ``known``, the pages its checks would have found handed over."""
    page_size = ctrl.host_pool.page_size
    rng = np.random.default_rng(first_page)
    host_pages = np.arange(first_page, first_page + num_pages, dtype=np.int64)
    device_pages = (rng.permutation(ctrl.device_allocator.num_pages)[:num_pages] + 1)
    host = (host_pages[:, None] * page_size + np.arange(page_size)).reshape(-1)
    device = (device_pages[:, None] * page_size + np.arange(page_size)).reshape(-1)
    host_idx = Indices(torch.from_numpy(host), IndexSpace.HOST_FULL)
    device_idx = Indices(torch.from_numpy(device.astype(np.int64)), IndexSpace.DEVICE_FULL)
    transfer = PoolTransfer(name="full", host_pool=ctrl.host_pool, device_pool=ctrl.device_pool,
                            host_indices=host_idx, device_indices=device_idx,
                            layers=tuple(range(ctrl.device_pool.num_layers)))
    if not known:
        return MovedTransfer(transfer, host_idx.tensor, device_idx.tensor)
    pages = SlotPages(host_pages, page_size, device_pages.astype(np.int64), page_size, True)
    return MovedTransfer(transfer, host_idx.tensor, device_idx.tensor, pages=pages,
                         device_page_index=torch.from_numpy(device_pages.astype(np.int64)).to(
                             ctrl.device_pool.device))


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("known", [False, True], ids=["found", "known"])
@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a GPU")])])
def test_chunks_of_one_host_run_equal_plans_made_afresh(
        monkeypatch: pytest.MonkeyPatch, layout: HostLayout, known: bool, device: str) -> None:
    """Ops whose host slots are one run of whole pages, between the same pools: one plan is
    made per chunk length and layer shape over all of them, every other chunk of an op
    (or of a later op) is that plan shifted (``ChunkPlan.of_run``), and each equals a plan
    made afresh from the chunk's slots cut the general way: copies, staging shapes, host
    pages, its own op's page ids, their span and (on a GPU) the address the page kernel
    reads them at."""
    page_size = 4
    ctrl = make_controller(StagedBackend(4), device=device, page_size=page_size, num_layers=4,
                           layout=layout)
    buffer = StagingBuffer(torch.zeros(8192, dtype=ctrl.device_pool.data.dtype,
                                       device=device))
    templates = StagedBackend(4).templates
    views = PoolViews(ctrl.host_pool, ctrl.device_pool)  # shared by the ops, as a backend's
    made = []
    init = ChunkPlan.__init__

    def counted(self: ChunkPlan, *args: Any) -> None:
        made.append(self)
        init(self, *args)

    monkeypatch.setattr(ChunkPlan, "__init__", counted)
    planned: set[tuple[int, object]] = set()  # (length, shape) planned in an earlier call
    for first_page, num_pages in ((3, 11), (40, 7), (1, 1), (20, 11)):
        moved = run_move(ctrl, first_page, num_pages, known)
        move = StagedMove(moved, None, views)
        if device == "cuda" and known and layout is not HostLayout.PAGE_FIRST:
            assert move.page_index_ptr is not None  # the page kernel reads the ids
        general = OpSlots(moved)
        general.run_page = None  # segments cut by binary search, as for any op
        for chunk_tokens in (4, 8, 12, 40):
            for shape in (((0, 4),), ((0, 1),), ((0, 1), (1, 2))):
                made.clear()
                plans = move.chunks(moved, chunk_tokens, shape, buffer, templates)
                lengths = {(plan.slots.end - plan.slots.start, shape) for plan in plans}
                assert len(made) == len(lengths - planned), (chunk_tokens, shape)
                planned |= lengths
                for plan in plans:
                    slots = plan.slots
                    cut = ChunkSlots(moved, slots.start, slots.end, general)
                    if slots.pages is None:
                        assert slots.runs == [(0, slots.end - slots.start)]
                    else:
                        assert cut.pages is not None
                        assert slots.pages.segments == cut.pages.segments
                    fresh = ChunkPlan(move, slots, shape, buffer, templates)
                    assert plan.copies is not None and plan.copies == fresh.copies
                    assert (plan.shape, plan.numel, plan.wide_shape) == (
                        fresh.shape, fresh.numel, fresh.wide_shape)
                    assert plan.kernel_pages == fresh.kernel_pages
                    assert (plan.page_span is None) == (fresh.page_span is None)
                    if plan.page_span is not None and fresh.page_span is not None:
                        assert plan.page_span[1:] == fresh.page_span[1:]
                        assert plan.page_span[0] is fresh.page_span[0]
                    if fresh.direct is not None:
                        assert plan.direct is not None and plan.direct is not fresh.direct
                        assert plan.direct.segments == fresh.direct.segments

"""The controller's page-granular in-flight counts against a reference model that keeps the
slots of every live call in plain Python sets (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.controller import CacheController, Direction, TorchBackend
from hicache.controller.inflight import HeldCall, InFlightPages, pages_of_slots
from hicache.pools import (
    AttentionKind,
    DeviceKVPool,
    HostKVPool,
    HostLayout,
    IndexSpace,
    Indices,
    PageAllocator,
    RowGeometry,
)

PAGE = 2
NUM_PAGES = 12  # page 0 included
GEOMETRY = RowGeometry(AttentionKind.MHA, 1, 2, 0, torch.float32)
D2H, H2D = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE
DEVICE, HOST = IndexSpace.DEVICE_FULL, IndexSpace.HOST_FULL


def tracker() -> InFlightPages:
    device = DeviceKVPool(name="full", space=DEVICE, num_layers=1, num_slots=NUM_PAGES * PAGE,
                          geometry=GEOMETRY, device="cpu")
    host = HostKVPool(name="full", space=HOST, num_layers=1, num_pages=NUM_PAGES - 1,
                      page_size=PAGE, geometry=GEOMETRY, layout=HostLayout.LAYER_FIRST, pin=False)
    return InFlightPages([(device, PAGE), (host, PAGE)])


class Reference:
    """Live calls as (direction, {space: set of slots}); a slot is held when a live call
    names it."""

    def __init__(self) -> None:
        self.calls: dict[int, tuple[Direction, dict[IndexSpace, set[int]]]] = {}

    def held(self, space: IndexSpace, direction: Direction | None = None) -> set[int]:
        return {slot for d, slots in self.calls.values() if direction in (None, d)
                for slot in slots.get(space, set())}

    def conflict(self, space: IndexSpace, slots: list[int], new_op: Direction) -> int | None:
        """The slot a new op would be refused for, checked direction by direction."""
        order = [D2H, H2D] if new_op is D2H else [D2H]
        for direction in order:
            held = self.held(space, direction)
            for slot in slots:
                if slot in held:
                    return slot
        return None


pages_st = st.lists(st.integers(1, NUM_PAGES - 1), min_size=0, max_size=4, unique=True)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.sampled_from([D2H, H2D]), pages_st, pages_st,
                                st.integers(0, 5)), min_size=1, max_size=30),
       probe=pages_st)
def test_counts_match_the_reference(
    steps: list[tuple[bool, Direction, list[int], list[int], int]], probe: list[int]
) -> None:
    """After any sequence of takes and give-backs, busy slots, masks and refusals are the
    reference's."""
    held, ref = tracker(), Reference()
    live: list[HeldCall] = []
    for take, direction, device_pages, host_pages, pick in steps:
        _take_or_give_back(held, ref, live, take, direction, device_pages, host_pages, pick)
        for space in (DEVICE, HOST):
            assert held.held_slots(space).tolist() == sorted(ref.held(space))
            every = np.arange(NUM_PAGES * PAGE)
            assert held.mask(space, every).tolist() == [s in ref.held(space) for s in every]
    pages = np.array(probe, dtype=np.int64)
    slots = [p * PAGE + o for p in probe for o in range(PAGE)]
    for space in (DEVICE, HOST):
        busy = held.first_busy_page(space, pages)
        expected = next((p for p in probe if p * PAGE in ref.held(space)), None)
        assert busy == expected
        for new_op in (D2H, H2D):
            slot = ref.conflict(space, slots, new_op)
            if slot is None:
                held.refuse_conflicts(space, pages, "op", new_op)
            else:
                with pytest.raises(ValueError, match=rf"^op: {space.name} slot {slot} "):
                    held.refuse_conflicts(space, pages, "op", new_op)


def test_slot_conflicts_name_the_first_held_slot() -> None:
    """refuse_slot_conflicts names the first held slot in the order given, not a page start."""
    held = tracker()
    held.take(HeldCall(D2H, ((DEVICE, np.array([3], dtype=np.int64)),)))
    with pytest.raises(ValueError, match=r"^write: DEVICE_FULL slot 7 of pool 'full' is "
                                         r"already being backed up"):
        held.refuse_slot_conflicts(DEVICE, np.array([9, 7, 6]), "write", D2H)
    loads = tracker()
    loads.take(HeldCall(H2D, ((HOST, np.array([3], dtype=np.int64)),)))
    loads.refuse_slot_conflicts(HOST, np.array([7]), "load", H2D)  # two loads may share


def test_pages_of_slots_leaves_out_padding_and_repeats() -> None:
    """Any slots: their distinct pages, ascending, page 0 (padding) left out."""
    slots = np.array([9, 0, 1, 8, 5, 4, 9], dtype=np.int32)
    assert pages_of_slots(slots, PAGE).tolist() == [2, 4]


def test_pools_with_their_own_page_sizes() -> None:
    """A device allocator of one-slot pages beside a host pool of four-slot pages: each
    space is held in its own pages, the write's slots are busy until the ack, and only
    those."""
    device_allocator = PageAllocator(16, 1, DEVICE, "full")
    device = DeviceKVPool(name="full", space=DEVICE, num_layers=1, num_slots=20,
                          geometry=GEOMETRY, device="cpu")
    host = HostKVPool(name="full", space=HOST, num_layers=1, num_pages=4, page_size=4,
                      geometry=GEOMETRY, layout=HostLayout.LAYER_FIRST, pin=False)
    ctrl = CacheController(device_pool=device, device_allocator=device_allocator,
                           host_pool=host, backend=TorchBackend())
    slots = device_allocator.try_alloc(8)
    assert slots is not None
    written = ctrl.write(Indices(slots.tensor[[0, 1, 2, 3]], DEVICE))
    assert written is not None and written.tensor.tolist() == [4, 5, 6, 7]
    assert ctrl.busy_slots(DEVICE).tolist() == [1, 2, 3, 4]
    assert ctrl.busy_slots(HOST).tolist() == [4, 5, 6, 7]
    assert not ctrl.is_in_flight(Indices(slots.tensor[4:], DEVICE))
    with pytest.raises(ValueError, match="slot 4 of pool 'full' belongs to a transfer"):
        ctrl.evict_host(written)
    ctrl.drain()
    assert ctrl.busy_slots(DEVICE).size == 0 and ctrl.busy_slots(HOST).size == 0
    ctrl.evict_host(written)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=40), st.booleans(), st.sampled_from([1, 2, 4]))
def test_pages_of_slots_equals_the_distinct_pages(slots: list[int], ordered: bool,
                                                  page: int) -> None:
    """Slots in order (the path without a sort) or in any order: the distinct pages,
    sorted, page 0 left out."""
    values = np.array(sorted(slots) if ordered else slots, dtype=np.int64)
    want = sorted({s // page for s in slots} - {0})
    got = pages_of_slots(values, page)
    assert got.dtype == np.int64 and got.tolist() == want


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.sampled_from([D2H, H2D]), pages_st, pages_st,
                                st.integers(0, 5), st.booleans()), min_size=1, max_size=30),
       probe=pages_st)
def test_checks_now_and_then_match_the_reference(
    steps: list[tuple[bool, Direction, list[int], list[int], int, bool]], probe: list[int]
) -> None:
    """Calls given back with or without a check since their take (counted or not yet):
    every later check still answers as the reference does."""
    held, ref = tracker(), Reference()
    live: list[HeldCall] = []
    for take, direction, device_pages, host_pages, pick, check in steps:
        _take_or_give_back(held, ref, live, take, direction, device_pages, host_pages, pick)
        if check:
            space = HOST if pick % 2 else DEVICE
            every = np.arange(NUM_PAGES * PAGE)
            assert held.mask(space, every).tolist() == [s in ref.held(space) for s in every]
    pages = np.array(probe, dtype=np.int64)
    for space in (DEVICE, HOST):
        expected = next((p for p in probe if p * PAGE in ref.held(space)), None)
        assert held.first_busy_page(space, pages) == expected
        every = np.arange(NUM_PAGES * PAGE)
        assert held.mask(space, every).tolist() == [s in ref.held(space) for s in every]


def test_a_lone_call_given_back_unchecked_leaves_no_count() -> None:
    """A call taken and given back with no check between leaves every page free, and a
    call taken after it is seen by the next check."""
    held = tracker()
    first = HeldCall(D2H, ((HOST, np.array([2, 3], dtype=np.int64)),
                           (DEVICE, np.array([5], dtype=np.int64))))
    held.take(first)
    held.give_back(first)
    assert held.first_busy_page(DEVICE, np.array([5], dtype=np.int64)) is None
    assert not held.mask(HOST, np.arange(NUM_PAGES * PAGE)).any()
    second = HeldCall(D2H, ((DEVICE, np.array([5], dtype=np.int64)),))
    held.take(second)
    with pytest.raises(ValueError, match=r"^write: DEVICE_FULL slot 10 "):
        held.refuse_conflicts(DEVICE, np.array([5], dtype=np.int64), "write", D2H)
    held.give_back(second)
    held.refuse_conflicts(DEVICE, np.array([5], dtype=np.int64), "write", D2H)


def _take_or_give_back(held: InFlightPages, ref: Reference, live: list[HeldCall], take: bool,
                       direction: Direction, device_pages: list[int], host_pages: list[int],
                       pick: int) -> None:
    """One step of a property test: take a new call (always when none is live) or give back
    the live call ``pick`` picks, in ``held`` and in the reference alike."""
    if take or not live:
        call = HeldCall(direction, ((HOST, np.array(host_pages, dtype=np.int64)),
                                    (DEVICE, np.array(device_pages, dtype=np.int64))))
        held.take(call)
        live.append(call)
        ref.calls[id(call)] = (direction, {
            HOST: {p * PAGE + o for p in host_pages for o in range(PAGE)},
            DEVICE: {p * PAGE + o for p in device_pages for o in range(PAGE)}})
        return
    call = live.pop(pick % len(live))
    held.give_back(call)
    del ref.calls[id(call)]

"""Property tests: PageAllocator and HybridSWAPool against plain Python models (CPU)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from hicache.pools import (
    AttentionKind,
    HybridSWAPool,
    IndexSpace,
    Indices,
    PageAllocator,
    PageTable,
    RowGeometry,
)

PAGE_SIZE = 2
FULL_PAGES, SWA_PAGES = 12, 5
GEOMETRY = RowGeometry(AttentionKind.MHA, 1, 2, 0, torch.float32)


def _slots(pages: list[int]) -> list[int]:
    """Slot ids of ``pages`` in page order."""
    return [p * PAGE_SIZE + i for p in pages for i in range(PAGE_SIZE)]


def _full(slots: list[int]) -> Indices:
    """DEVICE_FULL indices of ``slots``."""
    return Indices(torch.tensor(slots, dtype=torch.int64), IndexSpace.DEVICE_FULL)


# ---- PageAllocator alone -------------------------------------------------------------------

_ALLOC_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 5)),
        st.tuples(st.just("free"), st.integers(0, 100)),
    ),
    max_size=30,
)


def _model_pick(free_pages: set[int], num_pages: int) -> list[int]:
    """The allocator's run-friendly rule, written plainly: the smallest free run that holds
    the request (lowest first among equals), else the longest runs first."""
    runs: list[list[int]] = []
    for page in sorted(free_pages):
        if runs and runs[-1][-1] == page - 1:
            runs[-1].append(page)
        else:
            runs.append([page])
    fitting = [run for run in runs if len(run) >= num_pages]
    if fitting:
        return min(fitting, key=len)[:num_pages]
    taken: list[int] = []
    for run in sorted(runs, key=len, reverse=True):
        if len(taken) >= num_pages:
            break
        taken += run
    return sorted(taken)[:num_pages]


@settings(max_examples=100, deadline=None)
@given(ops=_ALLOC_OPS)
def test_page_allocator_matches_a_set_model(ops: list[tuple[str, int]]) -> None:
    """Allocations follow the run-friendly rule or return None exactly when the model is short."""
    allocator = PageAllocator(8, PAGE_SIZE, IndexSpace.DEVICE_FULL, "full")
    free_pages = set(range(1, 9))
    chunks: list[list[int]] = []
    for op, arg in ops:
        if op == "alloc":
            got = allocator.try_alloc(arg * PAGE_SIZE)
            if arg > len(free_pages):
                assert got is None
                continue
            pages = _model_pick(free_pages, arg)
            assert got is not None and got.tensor.tolist() == _slots(pages)
            free_pages -= set(pages)
            chunks.append(pages)
        elif chunks:
            pages = chunks.pop(arg % len(chunks))
            allocator.free(_full(_slots(pages)))
            free_pages |= set(pages)
        assert allocator.num_free_tokens == len(free_pages) * PAGE_SIZE
        allocator.check_integrity()
    assert sorted(allocator.used_pages().tolist()) == sorted(set(range(1, 9)) - free_pages)


# ---- HybridSWAPool -------------------------------------------------------------------------


class HybridSWAMachine(RuleBasedStateMachine):
    """Random alloc / free / free_swa / translate against free page sets and a slot map."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = HybridSWAPool(
            num_layers=3, swa_layers=[1], full_pages=FULL_PAGES, swa_pages=SWA_PAGES,
            page_size=PAGE_SIZE, geometry=GEOMETRY, device="cpu",
        )
        self.free_full = set(range(1, FULL_PAGES + 1))
        self.free_swa_pages = set(range(1, SWA_PAGES + 1))
        self.chunks: list[list[int]] = []  # full pages of each live allocation
        self.swa_of: dict[int, int] = {}  # full slot -> SWA slot, mapped slots only

    def _allocated_slots(self) -> list[int]:
        """Full slots of every live allocation."""
        return _slots([p for chunk in self.chunks for p in chunk])

    @rule(num_pages=st.integers(0, 4))
    def alloc(self, num_pages: int) -> None:
        got = self.pool.try_alloc(num_pages * PAGE_SIZE)
        fits = num_pages <= len(self.free_full) and num_pages <= len(self.free_swa_pages)
        if not fits:
            assert got is None
            return
        assert got is not None
        full_pages = _model_pick(self.free_full, num_pages)
        swa_pages = _model_pick(self.free_swa_pages, num_pages)
        assert got.tensor.tolist() == _slots(full_pages)
        self.free_full -= set(full_pages)
        self.free_swa_pages -= set(swa_pages)
        self.swa_of.update(zip(_slots(full_pages), _slots(swa_pages), strict=True))
        if full_pages:
            self.chunks.append(full_pages)

    @precondition(lambda self: self.chunks)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        chunk = self.chunks.pop(data.draw(st.integers(0, len(self.chunks) - 1)))
        self.pool.free(_full(_slots(chunk)))
        self._unmap(chunk)
        self.free_full |= set(chunk)

    @precondition(lambda self: self.chunks)
    @rule(data=st.data())
    def free_swa(self, data: st.DataObject) -> None:
        chunk = data.draw(st.sampled_from(self.chunks))
        pages = data.draw(st.permutations(chunk))
        pages = pages[: data.draw(st.integers(1, len(pages)))]
        self.pool.free_swa(_full(_slots(pages)))
        self._unmap(pages)

    @precondition(lambda self: self.chunks)
    @rule(data=st.data())
    def translate(self, data: st.DataObject) -> None:
        slots = data.draw(st.lists(st.sampled_from([0, *self._allocated_slots()]), max_size=8))
        out = self.pool.translate_full_to_swa(_full(slots))
        assert out.tensor.dtype == torch.int32
        assert out.tensor.tolist() == [self.swa_of.get(s, 0) for s in slots]

    @precondition(lambda self: self.chunks)
    @rule(data=st.data())
    def translate_page_table(self, data: st.DataObject) -> None:
        pages = [0, *(p for chunk in self.chunks for p in chunk)]
        row = st.lists(st.sampled_from(pages), min_size=3, max_size=3)
        table = data.draw(st.lists(row, min_size=1, max_size=3))
        full = PageTable(torch.tensor(table, dtype=torch.int32), IndexSpace.DEVICE_FULL,
                         PAGE_SIZE)
        out = self.pool.translate_page_table(full)
        expected = [[self.swa_of.get(p * PAGE_SIZE, 0) // PAGE_SIZE for p in r] for r in table]
        assert out.tensor.tolist() == expected

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        assert self.pool.full_allocator.num_free_tokens == len(self.free_full) * PAGE_SIZE
        assert self.pool.swa_allocator.num_free_tokens == len(self.free_swa_pages) * PAGE_SIZE

    def _unmap(self, full_pages: list[int]) -> None:
        """Drop the model's mapping of ``full_pages``, returning their SWA pages."""
        for page in full_pages:
            swa = self.swa_of.get(page * PAGE_SIZE)
            if swa is not None:
                self.free_swa_pages.add(swa // PAGE_SIZE)
            for slot in _slots([page]):
                self.swa_of.pop(slot, None)


HybridSWAMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None
)
TestHybridSWAPool = HybridSWAMachine.TestCase

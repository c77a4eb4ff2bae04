"""The file store's LRU bookkeeping (:class:`FileLRU`) against a plain model: random
touches, reservations, releases, removals, scans and clears give the same victims, bytes
and membership, and a reservation or a scan leaves the bytes under the cap (a touch never
refuses a page already on disk, so it may pass the cap while pinned pages hold the rest,
until the next eviction); pages a call has pinned are never victims; a reservation the cap
cannot hold is refused (CPU, no I/O)."""

from __future__ import annotations

import random

import pytest

from hicache.storage.file_lru import FileLRU


class Model:
    """What the docstrings promise, kept as plainly as possible."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self.order: list[tuple[str, int]] = []  # unpinned, least recently used first
        self.pinned: dict[str, tuple[int, int]] = {}  # name -> (size, calls writing it)

    @property
    def used(self) -> int:
        return sum(size for _, size in self.order) + self.pinned_bytes

    @property
    def pinned_bytes(self) -> int:
        return sum(size for size, _ in self.pinned.values())

    def _pop(self, name: str) -> int | None:
        for i, (other, size) in enumerate(self.order):
            if other == name:
                del self.order[i]
                return size
        return None

    def _evict_for(self, size: int) -> list[tuple[str, int]]:
        victims = []
        while self.cap is not None and self.used + size > self.cap and self.order:
            victims.append(self.order.pop(0))
        return victims

    def load(self, entries: list[tuple[str, int]]) -> list[tuple[str, int]]:
        for name, size in entries:
            if all(other != name for other, _ in self.order) and name not in self.pinned:
                self.order.append((name, size))
        return self._evict_for(0)

    def touch(self, name: str, size: int) -> list[tuple[str, int]]:
        if name in self.pinned:
            return []
        known = self._pop(name)
        if known is not None:
            self.order.append((name, known))
            return []
        victims = self._evict_for(size)
        self.order.append((name, size))
        return victims

    def reserve(self, name: str, size: int) -> list[tuple[str, int]] | None:
        if name in self.pinned:
            held, calls = self.pinned[name]
            self.pinned[name] = (held, calls + 1)
            return []
        self._pop(name)
        if self.cap is not None and size > self.cap - self.pinned_bytes:
            return None
        victims = self._evict_for(size)
        self.pinned[name] = (size, 1)
        return victims

    def release(self, names: list[str]) -> None:
        for name in names:
            if name in self.pinned:
                size, calls = self.pinned[name]
                if calls == 1:
                    del self.pinned[name]
                    self.order.append((name, size))
                else:
                    self.pinned[name] = (size, calls - 1)

    def remove(self, name: str) -> bool:
        if self._pop(name) is not None:
            return True
        return self.pinned.pop(name, None) is not None

    def clear(self) -> None:
        self.order = []


NAMES = [f"page{i}" for i in range(8)]


@pytest.mark.parametrize("seed", range(40))
def test_random_operations_agree_with_the_model(seed: int) -> None:
    rng = random.Random(seed)
    cap = rng.choice([None, 1, 25, 60, 100])
    lru, model = FileLRU(cap), Model(cap)
    for step in range(300):
        op, name, size = rng.randrange(7), rng.choice(NAMES), rng.choice([5, 10, 20])
        where = f"seed {seed}, step {step}, op {op}"
        if op == 0:
            assert lru.touch(name, size) == model.touch(name, size), where
        elif op in (1, 2):
            fresh = name not in model.pinned  # else a second writer: nothing to make room for
            reserved = lru.reserve(name, size)
            assert reserved == model.reserve(name, size), where
            if cap is not None and reserved is not None and fresh:  # room was made
                assert model.used <= cap, where
        elif op == 3:
            names = rng.sample(NAMES, rng.randrange(1, 4))
            lru.release(names)
            model.release(names)
        elif op == 4:
            assert lru.remove(name) == model.remove(name), where
        elif op == 5:
            entries = [(rng.choice(NAMES), rng.choice([5, 10])) for _ in range(3)]
            assert lru.load(entries) == model.load(entries), where
            if cap is not None:
                assert model.used <= cap or not model.order, where
        elif rng.random() < 0.2:
            lru.clear()
            model.clear()
        assert lru.used_bytes == model.used, where
        assert len(lru) == len(model.order), where
        assert [name in lru for name in NAMES] == [
            any(n == name for n, _ in model.order) or name in model.pinned for name in NAMES]


def test_a_call_never_evicts_the_pages_it_pinned() -> None:
    lru = FileLRU(30)
    assert lru.reserve("a", 10) == [] and lru.reserve("b", 10) == []
    assert lru.touch("old", 10) == []
    assert lru.reserve("c", 10) == [("old", 10)]  # a and b are pinned: the old page goes
    assert lru.reserve("d", 10) is None, "30 bytes pinned: a fourth page cannot be held"
    lru.release(["a", "b", "c"])
    assert lru.reserve("d", 10) == [("a", 10)], "released pages are evictable, oldest first"
    assert lru.used_bytes == 30 and "a" not in lru and "d" in lru


def test_a_page_written_by_two_calls_stays_pinned_until_both_release() -> None:
    lru = FileLRU(20)
    assert lru.reserve("a", 10) == [] and lru.reserve("a", 10) == []
    assert lru.used_bytes == 10
    lru.release(["a"])
    assert lru.reserve("b", 10) == [] and lru.reserve("c", 10) is None, "a is still pinned"
    lru.release(["a"])
    assert lru.reserve("c", 10) == [("a", 10)]


def test_a_scan_at_the_cap_evicts_nothing_and_one_over_evicts_the_oldest() -> None:
    lru = FileLRU(20)
    assert lru.load([("a", 10), ("b", 10)]) == []
    assert lru.load([("c", 1)]) == [("a", 10)]
    assert lru.used_bytes == 11


def test_a_scan_that_finds_a_page_being_written_counts_it_once() -> None:
    """A file a call has pinned (renamed into place, not released yet) that a directory
    scan lists is not indexed twice: the bytes and the index stay consistent."""
    lru = FileLRU(100)
    assert lru.reserve("a", 10) == []
    assert lru.load([("a", 10), ("b", 10)]) == []
    lru.release(["a"])
    assert lru.used_bytes == 20 and len(lru) == 2


def test_a_cap_below_one_byte_is_refused() -> None:
    assert FileLRU(1).capacity_bytes == 1
    with pytest.raises(ValueError, match="capacity_bytes must be >= 1 or None, got 0"):
        FileLRU(0)


def test_sync_forgets_files_gone_and_puts_others_files_first_in_line() -> None:
    lru = FileLRU(capacity_bytes=40)
    assert lru.load([("a", 10), ("b", 10)]) == []
    lru.touch("a", 10)  # b is now the least recently used of ours
    assert lru.sync([("x", 10), ("a", 10), ("y", 10)]) == []  # b is gone, x and y are new
    assert "b" not in lru and lru.used_bytes == 30
    assert lru.touch("c", 20) == [("x", 10)]  # the others' oldest first, then y, then a
    assert lru.touch("d", 10) == [("y", 10)]


def test_pin_existing_keeps_a_found_file_out_of_reach_until_released() -> None:
    lru = FileLRU(capacity_bytes=20)
    assert lru.load([("a", 10), ("b", 10)]) == []
    assert lru.pin_existing("a", 10) == []
    assert lru.reserve("c", 10) == [("b", 10)]  # a is pinned: b goes
    assert lru.reserve("d", 10) is None  # a and c hold the whole cap
    lru.release(["a", "c"])
    assert lru.used_bytes == 20 and lru.reserve("d", 10) == [("a", 10)]
    assert lru.pin_existing("z", 10) == [("c", 10)]  # unknown to the index: room made

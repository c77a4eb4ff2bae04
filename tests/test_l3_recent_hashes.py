"""A prefetch's page hashes are computed by its worker, not on the scheduler thread, and kept
for the node its tokens become, whose backup to the store then computes none (CPU, the real
file store). What the kept hashes give is checked against the chain computed from scratch."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from test_l3_tier import MODEL, PAGE, make_config, put, settle

import hicache.l3.hashes as hashes_module
import hicache.l3.jobs as jobs_module
from hicache.factory import build_service
from hicache.l3.hashes import RecentHashes, key_page_hashes
from hicache.radix.key import TOKEN_BYTES
from hicache.service import HiCacheService
from hicache.storage import chain_page_hashes

SYSTEM = list(range(500, 508))  # 4 pages of 2, cached and stored first
TAIL = list(range(700, 712))  # 6 pages


def _key(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int64).tobytes()


def _joined(tokens: list[int], parent: bytes) -> bytes:
    return key_page_hashes(_key(tokens), PAGE, parent)


PARENT = bytes(range(32))


class KnownTail(NamedTuple):
    """A tail whose hashes are known (:class:`hicache.l3.hashes.HashedTail`)."""

    tail: bytes
    parent: bytes
    joined: bytes | None


def _known(tokens: list[int]) -> KnownTail:
    return KnownTail(_key(tokens), PARENT, _joined(tokens, PARENT))


def test_a_kept_tail_gives_the_hashes_of_a_key_it_starts_with() -> None:
    recent = RecentHashes(PAGE)
    recent.add(_known(TAIL))
    assert recent.find(PARENT, _key(TAIL)) == _joined(TAIL, PARENT)
    assert recent.find(PARENT, _key(TAIL[:4])) == _joined(TAIL[:4], PARENT)


@pytest.mark.parametrize("key", [
    [*TAIL[:2], 1, 2],  # the same first page, then other tokens
    [*TAIL, 800, 801],  # longer than the tail kept
    [1, 2, *TAIL[2:]],  # another first page
])
def test_a_key_the_kept_tail_does_not_start_with_is_not_found(key: list[int]) -> None:
    recent = RecentHashes(PAGE)
    recent.add(_known(TAIL))
    assert recent.find(PARENT, _key(key)) is None


def test_the_same_tokens_after_another_page_are_not_found() -> None:
    recent = RecentHashes(PAGE)
    recent.add(_known(TAIL))
    assert recent.find(bytes(32), _key(TAIL)) is None


def test_tails_after_one_page_are_kept_apart_and_the_oldest_leaves_first() -> None:
    recent = RecentHashes(PAGE, limit=3)
    tails = [[t, t + 1, t + 2, t + 3] for t in (10, 20, 30, 40)]
    for tail in tails:
        recent.add(_known(tail))
    assert len(recent) == 3
    assert recent.find(PARENT, _key(tails[0])) is None
    for tail in tails[1:]:
        assert recent.find(PARENT, _key(tail)) == _joined(tail, PARENT)
    recent.add(KnownTail(_key([5]), PARENT, b""))  # shorter than a page: nothing to keep
    assert len(recent) == 3


def test_a_tail_whose_hashes_are_not_computed_yet_is_not_found_until_they_are() -> None:
    """A prefetch's job is kept when it starts; its worker sets its hashes later."""
    recent = RecentHashes(PAGE)
    job = jobs_module.PrefetchJob(_key(TAIL), PARENT, PAGE, 16)
    recent.add(job)
    assert recent.find(PARENT, _key(TAIL)) is None
    job.joined = _joined(TAIL, PARENT)
    assert recent.find(PARENT, _key(TAIL[:2])) == _joined(TAIL[:2], PARENT)


def test_what_is_kept_is_bounded_in_bytes_too() -> None:
    """Long tails fill the byte bound before the count: the oldest go; a tail larger than
    the bound is not kept at all; a tail kept again replaces the old entry's bytes."""
    recent = RecentHashes(PAGE, limit=100, limit_bytes=1000)
    tails = [[t] * 20 for t in range(5)]  # 160 bytes of tokens, 10 pages' hashes: 480
    for tail in tails[:2]:
        recent.add(_known(tail))
    assert len(recent) == 2 and recent.num_bytes == 960
    recent.add(_known(tails[1]))  # again: no more bytes
    assert len(recent) == 2 and recent.num_bytes == 960
    recent.add(_known(tails[2]))
    assert len(recent) == 2 and recent.num_bytes == 960
    assert recent.find(PARENT, _key(tails[0])) is None
    assert recent.find(PARENT, _key(tails[2])) is not None
    huge = [7] * 200
    recent.add(_known(huge))
    assert recent.find(PARENT, _key(huge)) is None and recent.num_bytes == 960


def test_the_bounds_hold_what_reaches_them_exactly() -> None:
    """A tail of one page is kept; kept bytes may reach the byte bound, not pass it; a
    tail of exactly the byte bound is kept alone."""
    one_page = [3, 4]  # 16 bytes of tokens and one hash of 32
    recent = RecentHashes(PAGE, limit=10, limit_bytes=96)
    recent.add(_known(one_page))
    assert recent.find(PARENT, _key(one_page)) == _joined(one_page, PARENT)
    other = [5, 6]
    recent.add(_known(other))
    assert len(recent) == 2 and recent.num_bytes == 96
    recent.add(_known([8, 9, 10, 11]))  # 32 + 64 = 96: alone
    assert len(recent) == 1 and recent.num_bytes == 96
    assert recent.find(PARENT, _key([8, 9])) == _joined([8, 9], PARENT)


@pytest.fixture
def hashing_threads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(thread name, tokens) of every page-hash computation of the cache's side."""
    calls: list[tuple[str, int]] = []

    def recorded(real: Callable[..., bytes]) -> Callable[..., bytes]:
        def hashed(key: bytes, page_size: int, parent: bytes) -> bytes:
            calls.append((threading.current_thread().name, len(key) // TOKEN_BYTES))
            return real(key, page_size, parent)
        return hashed

    monkeypatch.setattr(hashes_module, "key_page_hashes",
                        recorded(hashes_module.key_page_hashes))
    monkeypatch.setattr(jobs_module, "key_page_hashes", recorded(jobs_module.key_page_hashes))
    return calls


def _prefetch_and_serve(service: HiCacheService, tokens: list[int],
                        finish_first: bool = True) -> int | None:
    """An engine's request: match, prefetch the tail, finish it, compute the tokens and
    insert them; then the backups and puts run (``finish_first=False``: the prefetch is
    finished after them, its query back). Returns the tokens the store had."""
    prefetch = service.prefetch(tokens, service.match(tokens))
    assert prefetch is not None and service.wait_prefetch(prefetch, timeout_s=10.0)
    found = prefetch.found_tokens
    if finish_first:
        service.finish_prefetch(prefetch)
    put(service, tokens)
    settle(service)
    if not finish_first:
        service.finish_prefetch(prefetch)
    return found


@pytest.mark.parametrize("finish_first", [True, False], ids=["finished", "open"])
def test_the_scheduler_hashes_neither_a_prefetched_tail_nor_its_node(
        tmp_path: Path, hashing_threads: list[tuple[str, Any]], finish_first: bool) -> None:
    """Whether the prefetch is finished before its tokens' node is backed up or after."""
    service = build_service(make_config(tmp_path / "l3"), **MODEL)
    try:
        put(service, SYSTEM)
        settle(service)
        hashing_threads.clear()
        assert _prefetch_and_serve(service, SYSTEM + TAIL, finish_first) == 0
        assert hashing_threads == [("hicache-l3-prefetch", len(TAIL))]
        [node] = [n for n in service.tree.nodes() if n.tokens == tuple(TAIL)]
        assert node.in_storage
        assert node.page_hashes == b"".join(chain_page_hashes(SYSTEM + TAIL, PAGE)[4:])
    finally:
        service.stop()


def test_every_node_keeps_its_chain_when_requests_share_and_part_after_prefetches(
        tmp_path: Path) -> None:
    """Requests whose tails share first pages and part later, each prefetched (its tail's
    hashes kept), inserted and stored: every node's hashes are the chain of its tokens
    from the root, and a second instance finds every page in the store."""
    service = build_service(make_config(tmp_path / "l3", device_tokens=64), **MODEL)
    rng = np.random.default_rng(3)
    requests = []
    try:
        put(service, SYSTEM)
        settle(service)
        for _ in range(12):
            stem = [int(t) for t in rng.integers(900, 903, size=int(rng.integers(1, 4)) * 2)]
            tokens = SYSTEM + stem + [int(t) for t in rng.integers(0, 99, size=4)]
            requests.append(tokens)
            if service.match(tokens).device_hit_tokens < len(tokens):
                _prefetch_and_serve(service, tokens)
        for node in service.tree.nodes():
            path = []
            current = node
            while current is not service.tree.root:
                path = list(current.tokens) + path
                assert current.parent is not None
                current = current.parent
            if node.page_hashes is not None:
                expected = chain_page_hashes(path, PAGE)[-len(node.page_hashes) // 32:]
                assert node.page_hashes == b"".join(expected), path
    finally:
        service.stop()
    store = build_service(make_config(tmp_path / "l3"), **MODEL)
    try:
        assert store.storage is not None
        for tokens in requests:
            keys = chain_page_hashes(tokens, PAGE)
            assert store.storage.store.exists(keys).num_leading_ok == len(keys)
    finally:
        store.stop()

"""Prefetch at its edges: a tail exactly as long as ``prefetch_threshold_tokens`` is fetched,
a shorter one is not, a tail with no whole page is never asked for even with no threshold,
the tail starts after the host hit as well as the device hit, ``found_tokens`` says how
many tokens the store has, and pages arriving into a full host evict host leaves for room
(CPU, the real file store in a temporary directory)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from radix_helpers import expected_rows, read_rows
from test_l3_tier import MODEL, make_config, pool_of, put, settle

from hicache.factory import build_service
from hicache.service import HiCacheService

X = list(range(500, 520))  # 10 pages of 2


def stored_and_reader(tmp_path: Path, threshold: int
                      ) -> Iterator[tuple[HiCacheService, HiCacheService]]:
    writer = build_service(make_config(tmp_path / "l3", threshold=threshold), **MODEL)
    reader = build_service(make_config(tmp_path / "l3", threshold=threshold), **MODEL)
    try:
        put(writer, X)
        settle(writer)
        yield writer, reader
    finally:
        writer.stop()
        reader.stop()


@pytest.fixture
def four(tmp_path: Path) -> Iterator[HiCacheService]:
    """A reader whose threshold is 4 tokens, of a store that has ``X``."""
    for _, reader in stored_and_reader(tmp_path, threshold=4):
        yield reader


def fetched(service: HiCacheService, tokens: list[int], expect: int) -> int:
    """Prefetch ``tokens``' uncached pages, check ``found_tokens``; tokens attached."""
    key = service.key(tokens)
    prefetch = service.prefetch(key, service.match(key))
    assert prefetch is not None and prefetch.num_tokens == expect
    assert service.wait_prefetch(prefetch, timeout_s=10.0)
    assert prefetch.found_tokens == expect
    return service.finish_prefetch(prefetch)


def test_a_tail_as_long_as_the_threshold_is_fetched_a_shorter_one_is_not(four) -> None:
    assert four.prefetch(four.key(X[:2]), four.match(four.key(X[:2]))) is None
    assert four.storage is not None and four.storage.stats.prefetches == 0
    assert fetched(four, X[:4], expect=4) == 4
    four.check_integrity()


def test_the_tail_starts_after_the_host_hit(four) -> None:
    assert fetched(four, X[:4], expect=4) == 4  # now a host hit of 4 tokens
    match = four.match(four.key(X))
    assert (match.device_hit_tokens, match.host_hit_tokens) == (0, 4)
    assert fetched(four, X, expect=16) == 16
    match = four.match(four.key(X))
    loaded = four.load_back(match, 10**6)
    assert loaded.queued
    four.start_loading()
    four.step()
    pool = pool_of(four)
    assert torch.equal(read_rows(pool, loaded.device_indices.tensor),
                       expected_rows(X, pool.num_layers))
    four.check_integrity()


def test_with_no_threshold_a_tail_without_a_whole_page_is_not_asked_for(tmp_path: Path
                                                                        ) -> None:
    for _, reader in stored_and_reader(tmp_path, threshold=0):
        assert fetched(reader, X[:4], expect=4) == 4
        key = reader.key(X[:5])  # whole pages only: nothing past the 4 cached tokens
        assert reader.prefetch(key, reader.match(key)) is None
        assert reader.storage is not None and reader.storage.stats.prefetches == 1


def test_pages_arriving_into_a_full_host_evict_host_leaves_for_room(four) -> None:
    """The reader's host (64 tokens) is full of two host-only sequences of 32: the 20
    tokens the store has evict the older one and arrive."""
    older, newer = list(range(1000, 1032)), list(range(2000, 2032))
    for tokens in (older, newer):
        put(four, tokens)
        settle(four)
        four.evict(10**6)
    assert four.tree.io.host_free_tokens() == 0
    assert fetched(four, X, expect=20) == 20
    assert four.match(four.key(X)).host_hit_tokens == 20
    assert four.match(four.key(older)).host_hit_tokens == 0, "evicted for the arrival"
    assert four.match(four.key(newer)).host_hit_tokens == 32
    four.check_integrity()

"""``hicache bench storage``'s turn figures: a scheduler's turn alone and while a store (a
file store, a real Redis server) puts and gets a host pool's pages, per host layout; the
store's failure is the run's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from storage_helpers import needs_redis

from hicache.bench import storage_turns
from hicache.bench.redis_local import RedisServer
from hicache.bench.storage_turns import LAYOUTS, REFERENCE, WAIT_S, measure_turns, scheduler_turns
from hicache.pools import HostLayout
from hicache.storage import (
    FileStore,
    Namespace,
    PageStatus,
    StorageResult,
    chain_page_hashes,
    open_store,
)


def test_a_turn_is_the_wait_and_the_python_after_it() -> None:
    times = scheduler_turns(20)
    assert len(times) == 20 and min(times) >= WAIT_S * 1e6


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.value)
def test_the_turns_are_timed_alone_and_beside_a_store_moving_every_page(
        tmp_path: Path, layout: HostLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four rows: the turn's mean, median and 99th percentile with the store working beside
    the same alone, and the bytes the store moved a second, which counts whole rounds of a
    put and a get of every page (each get finds every page the put stored); the store is
    left empty."""
    moved: list[tuple[str, int]] = []
    for name in ("put", "get"):
        real = getattr(FileStore, name)

        def spied(self: FileStore, keys: list[bytes], pages: list[list[memoryview]],
                  timeout_s: float | None = None, *, real=real, name=name) -> StorageResult:
            result = real(self, keys, pages, timeout_s)
            moved.append((name, result.statuses.count(PageStatus.OK)))
            return result

        monkeypatch.setattr(FileStore, name, spied)
    rows = measure_turns("file", str(tmp_path), layout, page_tokens=2, num_pages=3, turns=30)
    assert [row.figure for row in rows] == [
        f"turn mean us, {layout.value}", f"turn p50 us, {layout.value}",
        f"turn p99 us, {layout.value}", f"put+get GB/s, {layout.value}"]
    page_kib = 2 * 2 * 32 * 8 * 128 * 2 >> 10
    assert all(row.store == "file" and row.page_kib == page_kib for row in rows)
    for row in rows[:3]:
        assert row.reference_name == REFERENCE and row.reference is not None
        assert row.value >= WAIT_S * 1e6 and row.reference >= WAIT_S * 1e6
    assert rows[0].value <= rows[2].value and rows[1].value <= rows[2].value
    pages = storage_turns._pool(layout, 2, 3).num_slots // 2  # every page of the pool
    assert moved and all(count == pages for _, count in moved)
    assert rows[3].reference is None and rows[3].value >= 0
    assert not list(tmp_path.rglob("*.kv"))


def test_a_store_that_fails_stops_the_run_naming_the_layout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(self: FileStore, keys: list[bytes], pages: object,
                timeout_s: float | None = None) -> StorageResult:
        return StorageResult((PageStatus.ERROR,) * len(keys), "disk full")

    monkeypatch.setattr(FileStore, "put", failing)
    with pytest.raises(RuntimeError, match="file store, page_first_direct: disk full"):
        measure_turns("file", str(tmp_path), HostLayout.PAGE_FIRST_DIRECT, page_tokens=2,
                      num_pages=2, turns=5)
    assert storage_turns.LAYOUTS == (HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST_DIRECT)


@needs_redis
def test_the_turns_beside_redis_leave_its_namespace_empty(redis_server: RedisServer) -> None:
    url = f"redis://127.0.0.1:{redis_server.port}"
    rows = measure_turns("redis", url, HostLayout.LAYER_FIRST, page_tokens=2, num_pages=2,
                         turns=50)
    assert [row.store for row in rows] == ["redis"] * 4
    assert rows[3].figure == "put+get GB/s, layer_first" and rows[3].value > 0
    pool = storage_turns._pool(HostLayout.LAYER_FIRST, 2, 2)
    space = Namespace.for_host_pool(pool, model_id="bench/model",
                                    model_revision="turns-layer_first")
    with open_store(url, space) as store:
        keys = chain_page_hashes(torch.randint(0, 100_000, (pool.num_slots,),
                                               generator=torch.Generator().manual_seed(1)), 2)
        assert store.exists(keys).num_leading_ok == 0

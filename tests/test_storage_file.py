"""The file store: round trips, prefixes, dedup, corruption, stale namespaces, the size cap."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from storage_helpers import fill, hashes, make_pool, namespace, rows, views

from hicache.pools import HostLayout
from hicache.storage import FileStore, PageStatus, open_store

OK, MISS, CORRUPT, ERROR, TIMEOUT = (PageStatus.OK, PageStatus.MISS, PageStatus.CORRUPT,
                                     PageStatus.ERROR, PageStatus.TIMEOUT)


def page_file(store: FileStore, key: bytes) -> Path:
    name = key.hex() + ".kv"
    return store.directory / name[:2] / name


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_pages_round_trip_into_other_slots_and_touch_nothing_else(tmp_path: Path,
                                                                  layout: HostLayout) -> None:
    """get writes the stored pages bit for bit into the given slots and no other slot."""
    pool = make_pool(layout)
    keys = hashes(5)
    with FileStore(tmp_path, namespace(pool), num_threads=2) as store:
        assert store.put(keys, views(pool, 1, 5)).statuses == (OK,) * 5
        fill(pool, 10, 7, -3.0)
        result = store.get(keys, views(pool, 11, 5))
        assert result.statuses == (OK,) * 5 and result.num_leading_ok == 5
        assert torch.equal(rows(pool, 11, 5), rows(pool, 1, 5))
        assert (rows(pool, 10, 1) == -3.0).all() and (rows(pool, 16, 1) == -3.0).all()
        assert store.stats().pages_hit == 5 and store.stats().bytes_read == 5 * 768


def test_exists_reports_the_stored_prefix(tmp_path: Path) -> None:
    """exists gives a status per page; num_leading_ok stops at the first gap."""
    pool = make_pool()
    keys = hashes(4)
    with FileStore(tmp_path, namespace(pool)) as store:
        store.put([keys[0], keys[1], keys[3]], views(pool, 1, 3))
        result = store.exists(keys)
        assert result.statuses == (OK, OK, MISS, OK) and result.num_leading_ok == 2
        assert store.exists([]).statuses == ()


def test_put_skips_pages_already_stored(tmp_path: Path) -> None:
    """A second put of the same pages writes nothing and counts them as skipped."""
    pool = make_pool()
    keys = hashes(3)
    with FileStore(tmp_path, namespace(pool)) as store:
        store.put(keys[:2], views(pool, 1, 2))
        before = page_file(store, keys[0]).stat().st_mtime_ns
        assert store.put(keys, views(pool, 1, 3)).statuses == (OK,) * 3
        assert page_file(store, keys[0]).stat().st_mtime_ns == before
        stats = store.stats()
        assert (stats.pages_written, stats.pages_skipped) == (3, 2)


@pytest.mark.parametrize("damage", ["payload bit", "header bit", "truncated", "padded"])
def test_a_damaged_page_file_is_corrupt_never_loaded_and_deleted(tmp_path: Path,
                                                                 damage: str) -> None:
    """Bit flips, truncation and extra bytes are CORRUPT, counted, and the file is removed."""
    pool = make_pool()
    keys = hashes(3)
    with FileStore(tmp_path, namespace(pool)) as store:
        store.put(keys, views(pool, 1, 3))
        path = page_file(store, keys[1])
        data = bytearray(path.read_bytes())
        if damage == "payload bit":
            data[store.format.header_len + 100] ^= 0x01
        elif damage == "header bit":
            data[40] ^= 0x80
        elif damage == "truncated":
            data = data[:-1]
        else:
            data += b"\0"
        path.write_bytes(bytes(data))
        result = store.get(keys, views(pool, 11, 3))
        assert result.statuses == (OK, CORRUPT, OK)
        assert not path.exists() and store.stats().pages_corrupt == 1
        assert store.exists(keys).statuses == (OK, MISS, OK)


def test_another_model_revision_misses(tmp_path: Path) -> None:
    """Pages of revision r1 are not found under r2 (same directory, same hashes)."""
    pool = make_pool()
    keys = hashes(2)
    with FileStore(tmp_path, namespace(pool, "r1")) as old, \
            FileStore(tmp_path, namespace(pool, "r2")) as new:
        old.put(keys, views(pool, 1, 2))
        assert new.exists(keys).statuses == (MISS, MISS)
        assert new.get(keys, views(pool, 11, 2)).statuses == (MISS, MISS)


def test_a_page_of_another_namespace_under_this_key_is_corrupt(tmp_path: Path) -> None:
    """An object carrying another namespace's digest (a stale copy) is refused and removed."""
    pool = make_pool()
    keys = hashes(1)
    with FileStore(tmp_path, namespace(pool, "r1")) as old, \
            FileStore(tmp_path, namespace(pool, "r2")) as new:
        old.put(keys, views(pool, 1, 1))
        page_file(new, keys[0]).parent.mkdir(parents=True)
        shutil.copy(page_file(old, keys[0]), page_file(new, keys[0]))
        assert new.get(keys, views(pool, 11, 1)).statuses == (CORRUPT,)
        assert not page_file(new, keys[0]).exists() and page_file(old, keys[0]).exists()


def test_the_size_cap_evicts_least_recently_used_pages(tmp_path: Path) -> None:
    """At its cap the store evicts the least recently used page; an evicted page misses."""
    pool = make_pool()
    keys = hashes(5)
    store = FileStore(tmp_path, namespace(pool))
    cap = 3 * store.format.object_len
    store.close()
    with FileStore(tmp_path, namespace(pool), capacity_bytes=cap) as store:
        store.put(keys[:3], views(pool, 1, 3))
        store.get(keys[:1], views(pool, 11, 1))  # page 0 is now the most recent
        assert store.put(keys[3:5], views(pool, 4, 2)).statuses == (OK, OK)
        assert store.exists(keys).statuses == (OK, MISS, MISS, OK, OK)
        stats = store.stats()
        assert stats.pages_evicted == 2 and stats.bytes_evicted == 2 * store.format.payload_len
        assert store.get(keys[1:2], views(pool, 11, 1)).statuses == (MISS,)
        assert store.lru.used_bytes == cap


def test_a_put_larger_than_the_cap_keeps_what_it_acknowledged(tmp_path: Path) -> None:
    """A put never evicts pages it wrote itself: pages past the cap are ERROR, not lost."""
    pool = make_pool()
    keys = hashes(5)
    object_len = FileStore(tmp_path / "probe", namespace(pool)).format.object_len
    with FileStore(tmp_path, namespace(pool), capacity_bytes=3 * object_len,
                   num_threads=1) as store:
        result = store.put(keys, views(pool, 1, 5))
        assert result.statuses == (OK, OK, OK, ERROR, ERROR) and "store full" in str(result.error)
        assert store.get(keys[:3], views(pool, 11, 3)).statuses == (OK,) * 3
        assert torch.equal(rows(pool, 11, 3), rows(pool, 1, 3))


def test_a_reopened_store_indexes_existing_files_for_its_cap(tmp_path: Path) -> None:
    """Files already on disk count against the cap of a new store on the same directory."""
    pool = make_pool()
    keys = hashes(4)
    with FileStore(tmp_path, namespace(pool)) as store:
        store.put(keys[:3], views(pool, 1, 3))
        object_len = store.format.object_len
    with FileStore(tmp_path, namespace(pool), capacity_bytes=3 * object_len) as store:
        store.put(keys[3:], views(pool, 4, 1))
        assert store.exists(keys).statuses.count(OK) == 3 and store.stats().pages_evicted == 1


def test_an_expired_deadline_reads_nothing(tmp_path: Path) -> None:
    """Pages not started by the deadline are TIMEOUT and their slots are left untouched."""
    pool = make_pool()
    keys = hashes(3)
    with FileStore(tmp_path, namespace(pool)) as store:
        store.put(keys, views(pool, 1, 3))
        fill(pool, 11, 3, 7.0)
        assert store.get(keys, views(pool, 11, 3), timeout_s=1e-9).statuses == (TIMEOUT,) * 3
        assert (rows(pool, 11, 3) == 7.0).all() and store.stats().pages_timeout == 3


@pytest.mark.parametrize("layout", [HostLayout.PAGE_FIRST, HostLayout.PAGE_FIRST_DIRECT],
                         ids=lambda x: x.value)
def test_o_direct_reads_round_trip(tmp_path: Path, layout: HostLayout) -> None:
    """direct_io reads 4 KiB aligned pages with O_DIRECT, bit for bit."""
    pool = make_pool(layout, page_size=16, heads=4, head_dim=16, num_layers=2)
    pool_page_bytes = namespace(pool).page_bytes
    assert pool_page_bytes % 4096 == 0
    keys = hashes(4)
    with FileStore(tmp_path, namespace(pool), direct_io=True) as store:
        store.put(keys[:3], views(pool, 1, 3))
        assert store.get(keys[:3], views(pool, 11, 3)).statuses == (OK,) * 3
        assert torch.equal(rows(pool, 11, 3), rows(pool, 1, 3))


def test_clear_removes_only_this_namespace(tmp_path: Path) -> None:
    """clear empties this namespace's directory and leaves another revision's pages."""
    pool = make_pool()
    keys = hashes(2)
    with FileStore(tmp_path, namespace(pool, "r1")) as one, \
            FileStore(tmp_path, namespace(pool, "r2")) as two:
        one.put(keys, views(pool, 1, 2))
        two.put(keys, views(pool, 1, 2))
        assert one.clear() == 2
        assert one.exists(keys).statuses == (MISS, MISS)
        assert two.exists(keys).statuses == (OK, OK)
        assert one.delete(keys).statuses == (MISS, MISS)
        assert two.delete(keys[:1]).statuses == (OK,)


def test_bad_locations_are_refused_with_the_fix(tmp_path: Path) -> None:
    """A file as root, an unknown scheme or a malformed address raises ValueError."""
    pool = make_pool()
    ns = namespace(pool)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        FileStore(tmp_path / "f", ns)
    for url, match in (("s3://bucket", "unknown storage scheme"),
                       ("redis://localhost", "not host:port"),
                       ("redis://a:1,b:2", "redis\\+cluster"),
                       ("file://host/x", "file:///absolute")):
        with pytest.raises(ValueError, match=match):
            open_store(url, ns)
    store = open_store(f"file://{tmp_path}/store", ns)
    assert isinstance(store, FileStore) and os.path.isdir(store.directory)
    store.close()


@pytest.mark.parametrize("page_size", [16, 64])
def test_page_first_direct_pages_of_16_and_64_slots_round_trip(tmp_path: Path,
                                                               page_size: int) -> None:
    """page_first_direct pages of 16 and 64 slots (one segment each) go to the file store and
    come back bit for bit into other pages; the pages around them are untouched."""
    pool = make_pool(HostLayout.PAGE_FIRST_DIRECT, page_size=page_size, num_pages=10)
    keys = hashes(3)
    with FileStore(tmp_path, namespace(pool)) as store:
        assert store.put(keys, views(pool, 1, 3)).statuses == (OK,) * 3
        fill(pool, 4, 5, -3.0)
        assert store.get(keys, views(pool, 5, 3)).statuses == (OK,) * 3
        assert torch.equal(rows(pool, 5, 3), rows(pool, 1, 3))
        assert (rows(pool, 4, 1) == -3.0).all() and (rows(pool, 8, 1) == -3.0).all()


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 1), (3, 1), (4, 2), (6, 3), (8, 4),
                                               (64, 4)])
def test_the_default_io_threads_are_half_the_cpus_from_1_to_4(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int, threads: int) -> None:
    """More I/O threads than half the CPUs the process may run on take cores from the
    engine's threads; a store built without ``num_threads`` gets that many."""
    from hicache.storage.page_files import default_io_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert default_io_threads() == threads
    with FileStore(tmp_path, namespace(make_pool())) as store:
        assert store._num_threads == threads
    with FileStore(tmp_path, namespace(make_pool()), num_threads=3) as store:
        assert store._num_threads == 3

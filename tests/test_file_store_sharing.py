"""The file store on a directory several processes share, and what crashes leave there.

- A ``put`` that found its first pages already stored reported them OK, then evicted them
  for its later pages at the cap: the chain it said it stored was unreadable.
- Each process counted only the pages it wrote or read, and scanned the directory once:
  N processes with one cap kept N times the cap on disk, for good. A store with a cap now
  scans again while it writes, so the others' pages count against the cap (and the pages
  they deleted leave its count).
- A writer killed mid-page left its temporary file forever, counted nowhere.

Two stores in one process stand for two processes (each keeps its own index); one test
runs real processes.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import time
from pathlib import Path

import pytest
from storage_helpers import hashes, make_pool, namespace, views

from hicache.storage import FileStore, PageStatus
from hicache.storage.file_scan import STALE_TMP_MIN_S

OK = PageStatus.OK
PAGES = 4


def object_len(root: Path) -> int:
    with FileStore(root / "probe", namespace(make_pool())) as probe:
        return probe.format.object_len


def pages_on_disk(root: Path) -> int:
    directory = root / namespace(make_pool()).hex
    return len(list(directory.glob("*/*.kv")))


def test_a_put_never_evicts_a_page_it_found_stored(tmp_path: Path) -> None:
    pool = make_pool()
    keys = hashes(3)  # one chain of 3 pages
    with FileStore(tmp_path, namespace(pool), capacity_bytes=2 * object_len(tmp_path),
                   num_threads=1) as store:
        assert store.put(keys[:1], views(pool, 1, 1)).statuses == (OK,)
        result = store.put(keys, views(pool, 1, 3))
        assert result.statuses[:2] == (OK, OK)
        assert result.statuses[2] is PageStatus.ERROR and "store full" in (result.error or "")
        assert store.exists(keys).statuses == (OK, OK, PageStatus.MISS)
        assert store.stats().pages_skipped == 1 and store.stats().pages_evicted == 0
        # released at the end of the call: the next put may evict them as usual
        assert store.put(hashes(2, seed=7), views(pool, 4, 2)).statuses == (OK, OK)
        assert store.exists(keys).statuses[:2] == (PageStatus.MISS, PageStatus.MISS)


def test_two_stores_on_one_directory_keep_it_within_their_cap(tmp_path: Path) -> None:
    pool = make_pool()
    cap = PAGES * object_len(tmp_path)
    with FileStore(tmp_path, namespace(pool), capacity_bytes=cap, rescan_interval_s=0) as one, \
            FileStore(tmp_path, namespace(pool), capacity_bytes=cap,
                      rescan_interval_s=0) as two:
        assert one.get(hashes(1, seed=99), views(pool, 0, 1)).num_leading_ok == 0  # scanned
        assert two.get(hashes(1, seed=99), views(pool, 0, 1)).num_leading_ok == 0
        assert one.put(hashes(PAGES, seed=1), views(pool, 0, PAGES)).num_leading_ok == PAGES
        assert two.put(hashes(PAGES, seed=2), views(pool, 0, PAGES)).num_leading_ok == PAGES
        assert pages_on_disk(tmp_path) == PAGES  # the second found the first's, evicted them
        assert two.exists(hashes(PAGES, seed=2)).statuses == (OK,) * PAGES
        assert one.put(hashes(1, seed=3), views(pool, 0, 1)).num_leading_ok == 1
        assert pages_on_disk(tmp_path) == PAGES
        assert one.lru.used_bytes == cap  # the first's index: the second's pages, less one


def test_pages_another_store_deleted_leave_the_index_at_the_next_scan(tmp_path: Path) -> None:
    pool = make_pool()
    size = object_len(tmp_path)
    with FileStore(tmp_path, namespace(pool), capacity_bytes=PAGES * size,
                   rescan_interval_s=0) as one, \
            FileStore(tmp_path, namespace(pool)) as two:
        assert one.put(hashes(PAGES, seed=1), views(pool, 0, PAGES)).num_leading_ok == PAGES
        assert two.delete(hashes(PAGES, seed=1)).statuses == (OK,) * PAGES
        assert one.put(hashes(2, seed=2), views(pool, 0, 2)).num_leading_ok == 2
        assert one.lru.used_bytes == 2 * size
        assert one.stats().pages_evicted == 0  # nothing evicted for pages that were gone


def test_a_store_without_a_scan_due_leaves_the_others_pages_alone(tmp_path: Path) -> None:
    pool = make_pool()
    cap = PAGES * object_len(tmp_path)
    with FileStore(tmp_path, namespace(pool), capacity_bytes=cap) as one, \
            FileStore(tmp_path, namespace(pool), capacity_bytes=cap) as two:
        assert one.put(hashes(PAGES, seed=1), views(pool, 0, PAGES)).num_leading_ok == PAGES
        assert two.put(hashes(PAGES, seed=2), views(pool, 0, PAGES)).num_leading_ok == PAGES
        assert pages_on_disk(tmp_path) == PAGES  # the second's first scan saw the first's
        assert one.put(hashes(1, seed=3), views(pool, 0, 1)).num_leading_ok == 1
        assert pages_on_disk(tmp_path) == PAGES + 1  # its next scan is 10 s away


def _writer(root: str, seed: int, opened: object, written: object, first_done: object
            ) -> None:
    pool = make_pool()
    cap = PAGES * object_len(Path(root) / f"p{seed}")
    with FileStore(root, namespace(pool), capacity_bytes=cap, rescan_interval_s=0) as store:
        assert store.get(hashes(1, seed=1000), views(pool, 0, 1)).num_leading_ok == 0
        opened.wait(30)  # type: ignore[attr-defined]
        assert store.put(hashes(PAGES, seed=seed), views(pool, 0, PAGES)).num_leading_ok == PAGES
        written.wait(30)  # type: ignore[attr-defined]
        # one after the other: two puts at once may each pass the cap by the other's page
        # (documented: by what the others wrote since a process's last scan)
        if seed == 2:
            first_done.wait(30)  # type: ignore[attr-defined]
        assert store.put(hashes(1, seed=seed + 50), views(pool, 5, 1)).num_leading_ok == 1
        if seed == 1:
            first_done.wait(30)  # type: ignore[attr-defined]


def test_two_processes_keep_the_directory_within_the_cap(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    opened, written, first_done = ctx.Barrier(2), ctx.Barrier(2), ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), seed, opened, written,
                                               first_done))
             for seed in (1, 2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    assert pages_on_disk(tmp_path) <= PAGES


def _killed_writer(root: str) -> None:
    pool = make_pool()
    with FileStore(root, namespace(pool), num_threads=1) as store:
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # killed inside the write
        store.put(hashes(1, seed=99), views(pool, 0, 1))


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs SIGXFSZ")
def test_a_killed_writers_temporary_file_goes_once_it_is_stale(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_killed_writer, args=(str(tmp_path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGXFSZ  # killed mid-put
    pool = make_pool()
    directory = tmp_path / namespace(pool).hex
    (orphan,) = directory.glob("*/.*.tmp")
    live = orphan.with_name(orphan.name.replace(".tmp", ".live.tmp"))
    live.write_bytes(b"a writer at work")
    with FileStore(tmp_path, namespace(pool), capacity_bytes=10**9) as store:
        assert store.get(hashes(1, seed=99), views(pool, 0, 1)).num_leading_ok == 0
    assert orphan.exists() and live.exists()  # fresh: it may be a live writer's
    old = time.time() - STALE_TMP_MIN_S - 60
    os.utime(orphan, (old, old))
    with FileStore(tmp_path, namespace(pool), capacity_bytes=10**9) as store:
        assert store.get(hashes(1, seed=99), views(pool, 0, 1)).num_leading_ok == 0
        assert not orphan.exists() and live.exists()
        assert store.put(hashes(1, seed=99), views(pool, 0, 1)).statuses == (OK,)

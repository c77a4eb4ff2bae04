"""The file store when its directory is removed by hand or turns read-only while the engine
runs: every call returns one status per page (only a caller's mistake raises), and the next
put makes a removed directory again.

The cap's directory scan let ``OSError`` out of ``put()``/``get()``: a subdirectory removed
between its listing and its scan (``rm -rf``, another process's ``clear()``), a dead writer's
stale temporary file it could not unlink, a page over the cap it could not evict (a read-only
file system); a capped store then never finished its scan and raised on every later put.
``clear()`` of a directory removed by hand raised too. The read-only cases bind-mount the
store's directory read-only, which needs root (they skip otherwise)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from storage_helpers import hashes, make_pool, namespace, views

from hicache.storage import FileStore, PageStatus


def test_a_put_while_the_directory_is_removed_by_hand_returns_statuses(tmp_path: Path) -> None:
    """README: "a store directory removed while the engine runs is made again by the next
    put"; base.py: every call returns one status per page, only caller mistakes raise. A put
    whose rescan runs while `rm -rf` (or another process's clear()) removes the directory
    raised FileNotFoundError out of put() instead."""
    pool = make_pool()
    store = FileStore(tmp_path, namespace(pool), capacity_bytes=10**9, num_threads=1,
                      rescan_interval_s=0)  # a capped store: every put scans again
    directory = str(store.directory)
    raised = []
    try:
        for trial in range(8):
            for i in range(256):  # the page subdirectories an operator's rm -rf walks
                os.makedirs(f"{directory}/{i:02x}", exist_ok=True)
            rm = subprocess.Popen(["rm", "-rf", directory])
            try:
                while rm.poll() is None:
                    try:
                        result = store.put(hashes(1, seed=trial), views(pool, 1, 1))
                    except OSError as exc:
                        raised.append(f"{type(exc).__name__}: {exc}")
                        break
                    assert len(result.statuses) == 1
            finally:
                rm.wait()
            if raised:
                break
        assert not raised, raised[0]
        # and the store recovers: the next put makes the directory again
        assert store.put(hashes(1, seed=99), views(pool, 1, 1)).statuses == (PageStatus.OK,)
    finally:
        store.close()


def test_a_read_only_directory_with_a_dead_writers_temporary_file_gives_statuses(
        tmp_path: Path) -> None:
    """A directory that turns read-only while the engine runs (a disk remounted read-only
    after an error, a bind mount made ro): puts must fail as ERROR statuses and gets still
    read what is there. When a writer killed mid-page left a temporary file (stale), the
    scan's unlink of it raised EROFS out of get()/put() instead (and, the scan never
    finishing, out of every later put of a capped store)."""
    from hicache.storage.file_scan import STALE_TMP_MIN_S

    pool = make_pool()
    root = tmp_path / "l3"
    with FileStore(root, namespace(pool), num_threads=1) as writer:
        assert writer.put(hashes(2), views(pool, 1, 2)).statuses == (PageStatus.OK,) * 2
        orphan = next(writer.directory.glob("*/*.kv")).with_name(".dead-writer.1.tmp")
    orphan.write_bytes(b"half a page")  # what a writer killed mid-page leaves
    old = os.stat(orphan).st_mtime - STALE_TMP_MIN_S - 60
    os.utime(orphan, (old, old))
    store = FileStore(root, namespace(pool), capacity_bytes=10**9, num_threads=1)
    mounted = subprocess.run(["mount", "--bind", str(root), str(root)],
                             capture_output=True).returncode == 0
    if not mounted:
        store.close()
        pytest.skip("needs to bind-mount a directory read-only (root)")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(root)], check=True)
        try:
            got = store.get(hashes(2), views(pool, 10, 2))
        except OSError as exc:
            raise AssertionError(f"get raised {type(exc).__name__}: {exc}") from None
        assert got.statuses == (PageStatus.OK,) * 2
        try:
            put = store.put(hashes(1, seed=5), views(pool, 3, 1))
        except OSError as exc:
            raise AssertionError(f"put raised {type(exc).__name__}: {exc}") from None
        assert put.statuses == (PageStatus.ERROR,)
    finally:
        subprocess.run(["umount", str(root)], check=True)
        store.close()


def test_a_read_only_directory_over_the_cap_still_serves_gets(tmp_path: Path) -> None:
    """The same read-only directory, now over this store's cap (another process wrote 4
    pages, the cap holds 2): the scan's evictions fail with EROFS, which escaped get()
    instead of leaving the pages (or returning statuses)."""
    pool = make_pool()
    root = tmp_path / "l3"
    with FileStore(root, namespace(pool), num_threads=1) as writer:
        assert writer.put(hashes(4), views(pool, 1, 4)).num_leading_ok == 4
        object_len = writer.format.object_len
    store = FileStore(root, namespace(pool), capacity_bytes=2 * object_len, num_threads=1)
    if subprocess.run(["mount", "--bind", str(root), str(root)],
                      capture_output=True).returncode != 0:
        store.close()
        pytest.skip("needs to bind-mount a directory read-only (root)")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(root)], check=True)
        try:
            got = store.get(hashes(4), views(pool, 10, 4))
        except OSError as exc:
            raise AssertionError(f"get raised {type(exc).__name__}: {exc}") from None
        assert len(got.statuses) == 4
    finally:
        subprocess.run(["umount", str(root)], check=True)
        store.close()


def test_clear_of_a_directory_removed_by_hand_returns_zero(tmp_path: Path) -> None:
    """base.StorageBackend.clear: "returns how many objects were removed; raises
    StorageUnavailable if the store does not answer". A store directory removed by hand
    (which README says the next put makes again) made clear() raise FileNotFoundError."""
    pool = make_pool()
    with FileStore(tmp_path / "l3", namespace(pool), num_threads=1) as store:
        assert store.put(hashes(2), views(pool, 1, 2)).num_leading_ok == 2
        shutil.rmtree(tmp_path / "l3")
        assert store.clear() == 0
        assert store.put(hashes(2), views(pool, 1, 2)).num_leading_ok == 2

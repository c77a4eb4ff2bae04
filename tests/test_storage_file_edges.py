"""The file store at its edges: hundreds of pages that share the store's 256 directories,
a store directory removed by hand while the store runs, read-only buffers (a put reads
them, a get refuses them as destinations) and each call's count and time in its stats."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from storage_helpers import check_each_call_timed, hashes, make_pool, namespace, rows, views

from hicache.storage import FileStore, PageStatus

OK = PageStatus.OK


def test_pages_that_share_a_directory_round_trip(tmp_path: Path) -> None:
    pool = make_pool()
    keys = hashes(400)  # 400 pages into 256 directories: many share one
    with FileStore(tmp_path, namespace(pool)) as store:
        assert len({key.hex()[:2] for key in keys}) < len(keys)
        for first in range(0, len(keys), 20):
            assert store.put(keys[first:first + 20], views(pool, 1, 20)).statuses == (OK,) * 20
        assert store.exists(keys).num_leading_ok == len(keys)
        assert store.get(keys[-20:], views(pool, 2, 20)).num_leading_ok == 20


def test_a_store_directory_removed_while_running_is_made_again(tmp_path: Path) -> None:
    pool = make_pool()
    keys = hashes(6)
    with FileStore(tmp_path, namespace(pool)) as store:
        assert store.put(keys[:3], views(pool, 1, 3)).statuses == (OK,) * 3
        shutil.rmtree(store.directory)  # a cache cleaned by hand
        assert store.put(keys[3:], views(pool, 4, 3)).statuses == (OK,) * 3
        assert store.get(keys[3:], views(pool, 10, 3)).statuses == (OK,) * 3
        assert torch.equal(rows(pool, 10, 3), rows(pool, 4, 3))
        assert store.exists(keys[:3]).num_leading_ok == 0


def test_a_put_reads_read_only_buffers_and_a_get_refuses_them(tmp_path: Path) -> None:
    pool = make_pool()
    keys = hashes(2)
    read_only = [[segment.toreadonly() for segment in page] for page in views(pool, 1, 2)]
    with FileStore(tmp_path, namespace(pool)) as store:
        assert store.put(keys, read_only).statuses == (OK, OK)
        with pytest.raises(ValueError, match="read-only"):
            store.get(keys, read_only)
        assert store.stats().get_calls == 0, "refused before the call"


def test_each_call_is_counted_once_with_its_own_time(tmp_path: Path) -> None:
    pool = make_pool()
    keys = hashes(3)
    with FileStore(tmp_path, namespace(pool)) as store:
        check_each_call_timed(store, pool, keys)
        assert store.delete(keys[:2] + hashes(1, seed=9)).statuses == (OK, OK,
                                                                        PageStatus.MISS)
        assert store.stats().delete_calls == 1 and store.stats().pages_deleted == 2


def test_a_page_that_cannot_be_written_is_an_error_named_by_its_key(tmp_path: Path) -> None:
    pool = make_pool()
    keys = hashes(3)
    with FileStore(tmp_path, namespace(pool)) as store:
        store.directory.mkdir(parents=True, exist_ok=True)
        blocked = keys[1].hex()
        (store.directory / blocked[:2]).write_bytes(b"")  # a file where its directory goes
        assert all(key.hex()[:2] != blocked[:2] for key in (keys[0], keys[2]))
        result = store.put(keys, views(pool, 1, 3))
        assert result.statuses == (OK, PageStatus.ERROR, OK)
        assert result.error is not None and result.error.startswith(f"put {blocked[:16]}: ")
        assert store.stats().pages_error == 1

"""A layer_first page moved through one copy (``hicache.storage.page_segments``): its payload
is its segments' bytes in one buffer, a read lands in a buffer and reaches the page's rows
only when landed, each thread stages into its own buffer, and through the file store and
Redis such pages round trip while a damaged one never reaches its slots."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from storage_helpers import fill, hashes, make_pool, namespace, needs_redis, rows, views

from hicache.bench.redis_local import RedisServer
from hicache.pools import HostKVPool, HostLayout
from hicache.storage import FileStore, PageStatus, open_store
from hicache.storage.host_views import check_batch
from hicache.storage.page_segments import (
    PageRows,
    land,
    landing,
    payload,
    worth_one_copy,
)

OK, CORRUPT = PageStatus.OK, PageStatus.CORRUPT


def copied_pool(layout: HostLayout = HostLayout.LAYER_FIRST, num_layers: int = 4) -> HostKVPool:
    """Pages of 16 tokens of 8 x 64 bf16 rows: 2 x ``num_layers`` segments of 16 KiB, enough
    for a layer_first page to go through one copy (``page_segments.worth_one_copy``)."""
    return make_pool(layout, page_size=16, heads=8, head_dim=64, num_layers=num_layers)


def test_a_layer_first_pages_payload_is_its_bytes_in_one_buffer() -> None:
    pool = copied_pool(num_layers=5)
    page = views(pool, 3, 1)[0]
    assert isinstance(page, PageRows) and len(page) == 2 * 5
    moved = payload(page)
    assert len(moved) == 1 and bytes(moved[0]) == b"".join(page)
    swa = memoryview(bytearray(b"swa rows"))
    moved = payload(page.with_segment(swa))
    assert len(moved) == 2 and bytes(moved[0]) == b"".join(page) and moved[1] is swa
    for layout in (HostLayout.PAGE_FIRST, HostLayout.PAGE_FIRST_DIRECT):
        other = views(copied_pool(layout), 3, 1)[0]
        assert payload(other) is other and landing(other) is other
        before = bytes(other[0])
        land(other)  # nothing to land
        assert bytes(other[0]) == before


def test_a_read_reaches_the_rows_only_when_landed() -> None:
    pool = copied_pool()
    page = views(pool, 2, 1)[0]
    before = rows(pool, 0, pool.num_slots // pool.page_size).clone()
    target = landing(page)
    assert len(target) == 1 and target[0].nbytes == sum(s.nbytes for s in page)
    target[0][:] = bytes(target[0].nbytes)
    assert torch.equal(rows(pool, 0, pool.num_slots // pool.page_size), before)
    land(page)
    assert rows(pool, 2, 1).count_nonzero() == 0
    assert torch.equal(rows(pool, 0, 2), before[:2 * pool.page_size])
    assert torch.equal(rows(pool, 3, 3), before[3 * pool.page_size:6 * pool.page_size])


def test_each_thread_stages_into_its_own_buffer() -> None:
    pool = copied_pool()
    first, second = views(pool, 1, 2)
    mine = payload(first)
    seen: list[bytes] = []
    other = threading.Thread(target=lambda: seen.append(bytes(payload(second)[0])))
    other.start()
    other.join()
    assert seen == [b"".join(second)] and bytes(mine[0]) == b"".join(first)


def test_the_file_store_round_trips_layer_first_pages_and_keeps_a_damaged_one_out(
        tmp_path: Path) -> None:
    pool = copied_pool()
    keys = hashes(3)
    with FileStore(tmp_path, namespace(pool)) as store:
        assert store.put(keys, views(pool, 1, 3)).statuses == (OK,) * 3
        name = keys[1].hex() + ".kv"
        path = store.directory / name[:2] / name
        data = bytearray(path.read_bytes())
        data[store.format.header_len + 5] ^= 0x10
        path.write_bytes(bytes(data))
        fill(pool, 11, 3, -5.0)
        assert store.get(keys, views(pool, 11, 3)).statuses == (OK, CORRUPT, OK)
    assert torch.equal(rows(pool, 11, 1), rows(pool, 1, 1))
    assert torch.equal(rows(pool, 13, 1), rows(pool, 3, 1))
    assert (rows(pool, 12, 1) == -5.0).all()  # the damaged page's slots: untouched


def test_o_direct_reads_land_layer_first_pages_too(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer_first page's segments are rows of a few KiB, not 4 KiB aligned; its read lands
    in the page aligned buffer, so O_DIRECT reads it too, bit for bit."""
    import os

    from hicache.storage import file_store

    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        pytest.skip("no O_DIRECT on this platform")
    read_flags: list[int] = []
    real_open = os.open

    def spied_open(path: str, flags: int, *args: int) -> int:
        if path.endswith(".kv"):
            read_flags.append(flags)
        return real_open(path, flags, *args)

    monkeypatch.setattr(file_store.os, "open", spied_open)
    pool = copied_pool()
    keys = hashes(3)
    with FileStore(tmp_path, namespace(pool), direct_io=True) as store:
        store.put(keys, views(pool, 1, 3))
        fill(pool, 11, 3, 2.0)
        assert store.get(keys, views(pool, 11, 3)).statuses == (OK,) * 3
    assert torch.equal(rows(pool, 11, 3), rows(pool, 1, 3))
    assert len(read_flags) == 3 and all(flags & direct for flags in read_flags)


@needs_redis
def test_redis_round_trips_layer_first_pages_and_keeps_a_damaged_one_out(
        redis_server: RedisServer) -> None:
    import redis

    pool = copied_pool()
    keys = hashes(3, seed=5)
    client = redis.Redis(port=redis_server.port)
    with open_store(f"redis://127.0.0.1:{redis_server.port}", namespace(pool, "segments")) \
            as store:
        assert store.put(keys, views(pool, 1, 3)).statuses == (OK,) * 3
        key = store.key(keys[1])  # type: ignore[attr-defined]
        value = bytearray(client.get(key) or b"")
        value[-10] ^= 0x04
        client.set(key, bytes(value))
        fill(pool, 11, 3, -5.0)
        assert store.get(keys, views(pool, 11, 3)).statuses == (OK, CORRUPT, OK)
        store.clear()
    assert torch.equal(rows(pool, 11, 1), rows(pool, 1, 1))
    assert torch.equal(rows(pool, 13, 1), rows(pool, 3, 1))
    assert (rows(pool, 12, 1) == -5.0).all()


def test_the_batch_check_counts_a_layer_first_page_by_its_rows_and_refuses_read_only_ones(
) -> None:
    """A page whose rows are read-only is refused as a destination; one whose SWA segment
    has the wrong size is refused naming its bytes; the pool's own pages pass as they are."""
    pool = copied_pool()
    space, keys = namespace(pool), hashes(1)
    page = views(pool, 1, 1)[0]
    assert check_batch("get", space, keys, [page], writable=True)[0] is page
    frozen = PageRows(np.frombuffer(bytes(b"".join(page)), dtype=np.uint8).reshape(1, -1))
    assert check_batch("put", space, keys, [frozen], writable=False)[0] is frozen
    with pytest.raises(ValueError, match="read-only"):
        check_batch("get", space, keys, [frozen], writable=True)
    with pytest.raises(ValueError, match=f"holds {space.page_bytes + 3} bytes"):
        check_batch("put", space, keys, [page.with_segment(memoryview(b"abc"))],
                    writable=False)


def test_a_page_of_few_or_small_segments_is_moved_as_it_is() -> None:
    """Fewer than 8 segments, or less than 64 KiB of them: the per-segment work is cheaper
    than the copy's calls, and the page is a plain list of its segments."""
    for pool in (copied_pool(num_layers=3), make_pool(HostLayout.LAYER_FIRST, num_layers=8)):
        page = views(pool, 1, 1)[0]
        assert type(page) is list and payload(page) is page and landing(page) is page
    assert isinstance(views(copied_pool(num_layers=4), 1, 1)[0], PageRows)
    edge = make_pool(HostLayout.LAYER_FIRST, page_size=16, heads=4, head_dim=64, num_layers=4)
    assert isinstance(views(edge, 1, 1)[0], PageRows)  # 8 segments of 8 KiB: 64 KiB
    assert worth_one_copy(8, 64 << 10) and not worth_one_copy(8, (64 << 10) - 1)
    assert not worth_one_copy(7, 1 << 30)


def test_a_page_of_rows_is_a_sequence_of_its_segments_made_when_asked_for() -> None:
    """Its segments are the layer_first page's segments in order (component, then layer),
    byte views into the pool that write through; indexing, slicing and iteration agree; its
    extra segments follow its rows."""
    pool = copied_pool(num_layers=4)
    page = views(pool, 2, 1)[0]
    assert isinstance(page, PageRows) and len(page) == 8 and page.rows.shape == (8, 16 << 10)
    data = pool.data  # [components, layers, slots, row]
    expected = [data[c, layer, 32:48].contiguous().view(torch.uint8).numpy().tobytes()
                for c in range(2) for layer in range(4)]
    assert [bytes(segment) for segment in page] == expected
    assert bytes(page[-1]) == expected[-1] and [bytes(s) for s in page[2:4]] == expected[2:4]
    with pytest.raises(IndexError):
        page[8]
    with pytest.raises(IndexError):
        page[-9]
    page[3][:] = bytes(page[3].nbytes)
    assert data[0, 3, 32:48].count_nonzero() == 0 and data[0, 2, 32:48].count_nonzero() > 0
    swa = memoryview(bytearray(b"swa"))
    hybrid = page.with_segment(swa)
    assert len(hybrid) == 9 and hybrid[8] is swa and hybrid[-1] is swa
    assert hybrid.rows is page.rows and hybrid.extra == (swa,) and len(page) == 8

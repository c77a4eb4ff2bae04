"""Audit of the shared store's tier, with reproducers of what it found:

- token ids of ``2**32`` or more, which the tree takes (up to ``2**63``), made the page hash
  raise out of ``step()`` half way through applying acks (a node left locked for good), out
  of ``prefetch()``, and in the storage worker;
- a file store ``put`` released the pins of pages another call was writing (any page it was
  given), so that call's next page could evict one it then reported stored;
- the smallest ``size_cap_gib`` the config took held no page's file (the header was left out);
- ``clear()`` of a cluster none of whose nodes answered reported 0 pages removed;
- store addresses: malformed ones taken, an IPv6 zone left percent-encoded.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from radix_helpers import expected_rows, read_rows
from storage_helpers import hashes, make_pool, namespace, views
from test_l3_tier import MODEL, fetch, make_config, pool_of, put, settle

from hicache.bench.redis_local import free_port
from hicache.config import ConfigError
from hicache.factory import build_service
from hicache.storage import FileStore, PageStatus, RedisStore, StorageUnavailable, parse_address

BIG = [2**32 + 4096 * i for i in range(8)]  # distinct in the fp32 rows of the test engine


def test_a_prefix_of_ids_of_2_32_or_more_is_stored_and_found_by_another_instance(
        tmp_path: Path) -> None:
    a = build_service(make_config(tmp_path / "l3"), **MODEL)
    b = build_service(make_config(tmp_path / "l3"), **MODEL)
    try:
        tokens = [*BIG, 2**62 + 1, 5]
        put(a, tokens)
        settle(a)  # the ack's backup hashes the node: it raised here before
        assert not [n for n in a.tree.nodes() if n.lock_count]
        assert a.storage is not None and a.storage.stats.backup_pages["stored"] == 5
        attached, device = fetch(b, tokens)
        assert attached == 10
        pool = pool_of(b)
        assert torch.equal(read_rows(pool, device.tensor), expected_rows(tokens, pool.num_layers))
        assert b.storage is not None and b.storage.stats.worker_errors == 0
        a.check_integrity()
        b.check_integrity()
    finally:
        a.stop()
        b.stop()


def test_a_prefetch_after_a_device_prefix_of_big_ids_hashes_it(tmp_path: Path) -> None:
    """``prefetch`` hashes the matched node on the scheduler thread (the tail's parent)."""
    service = build_service(make_config(tmp_path / "l3", policy="write_back"), **MODEL)
    try:
        put(service, BIG[:4])
        key = service.key(BIG[:4] + list(range(10, 18)))
        match = service.match(key)
        assert match.device_hit_tokens == 4
        prefetch = service.prefetch(key, match)
        assert prefetch is not None and service.wait_prefetch(prefetch, timeout_s=10.0)
        assert service.finish_prefetch(prefetch) == 0  # nothing stored: a miss, no error
        assert service.storage is not None and service.storage.stats.worker_errors == 0
    finally:
        service.stop()


class PausingStore(FileStore):
    """Holds the write of page ``hold`` until ``go`` is set."""

    def __init__(self, *args: object, hold: bytes, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.hold, self.waiting, self.go = hold, threading.Event(), threading.Event()

    def _write_page(self, key: bytes, segments: Sequence[memoryview],
                    pinned: list[str]) -> PageStatus:
        if key == self.hold:
            self.waiting.set()
            assert self.go.wait(10)
        return super()._write_page(key, segments, pinned)


def test_a_put_that_skips_a_page_leaves_another_puts_pin_on_it(tmp_path: Path) -> None:
    """A cap of one and a half pages: a put of X then Y stores X and refuses Y (X is pinned
    by its call). Another put of X meanwhile (X exists: skipped) unpinned X, and the first
    put's write of Y evicted the X it then reported stored."""
    pool = make_pool()
    ns = namespace(pool)
    x, y = hashes(2)
    with FileStore(tmp_path / "probe", ns) as probe:
        object_len = probe.format.object_len
    store = PausingStore(tmp_path / "l3", ns, hold=y, capacity_bytes=object_len * 3 // 2,
                         num_threads=1)
    results = {}
    writer = threading.Thread(target=lambda: results.setdefault(
        "xy", store.put([x, y], views(pool, 1, 2))))
    writer.start()
    try:
        assert store.waiting.wait(10)  # X written and pinned, Y held
        assert store.put([x], views(pool, 1, 1)).statuses == (PageStatus.OK,)
    finally:
        store.go.set()
        writer.join(10)
    assert results["xy"].statuses == (PageStatus.OK, PageStatus.ERROR)
    assert store.exists([x]).statuses == (PageStatus.OK,)  # not evicted by its own call
    assert store.stats().pages_evicted == 0
    store.close()


def test_the_smallest_cap_the_config_takes_holds_a_page(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="raise it to at least") as refused:
        make_config(tmp_path / "l3", size_cap_gib=1e-10)
    least = float(str(refused.value).rsplit("at least ", 1)[1])
    config = make_config(tmp_path / "l3", size_cap_gib=least)
    service = build_service(config, **MODEL)
    try:
        assert service.storage is not None
        store = service.storage.store
        assert isinstance(store, FileStore) and config.storage.capacity_bytes is not None
        assert config.storage.capacity_bytes >= store.format.object_len
        put(service, [100, 101])  # one page
        settle(service)
        assert service.storage.stats.backup_pages["stored"] == 1
    finally:
        service.stop()


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_clear_of_a_store_that_does_not_answer_raises(cluster: bool) -> None:
    """A cluster with no slot map (no node answered) cleared nothing and said 0."""
    store = RedisStore([("127.0.0.1", free_port())], namespace(make_pool()), cluster=cluster,
                       timeout_s=0.5)
    try:
        with pytest.raises(StorageUnavailable, match=r"Connection refused|no node"):
            store.clear()
    finally:
        store.close()


@pytest.mark.parametrize("item", [
    "h:1:2", "[h:6379", "h]:6379", "[h]:6379", "[]:6379", "a b:6379", "h:\u0663\u0663",
    "h:0", "::1:6379"])
def test_a_malformed_address_is_refused(item: str) -> None:
    with pytest.raises(ValueError, match="is not host:port"):
        parse_address(item)


@pytest.mark.parametrize(("item", "address"), [
    ("127.0.0.1:6379", ("127.0.0.1", 6379)), ("redis-0.local:1", ("redis-0.local", 1)),
    ("[::1]:65535", ("::1", 65535)), ("[fe80::1%25eth0]:7000", ("fe80::1%eth0", 7000))])
def test_an_address_is_parsed_with_an_ipv6_zone_decoded(item: str,
                                                        address: tuple[str, int]) -> None:
    assert parse_address(item) == address

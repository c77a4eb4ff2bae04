"""What a prefetch and a put carry, row by row: a prefetch of more pages than one store read
(three batches) brings every full row and every sliding-window row into the host slots of
the nodes it attaches; a page the store cannot read ends the prefetch there and the operator
reads the store's reason; a prefetch or a put whose store call raises (a bug, not an
OSError) is counted as an error or failed, and the worker goes on to the next (CPU, the real
file store in a temporary directory)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from radix_helpers import expected_rows, write_rows
from test_l3_tier import MODEL, make_config, put, settle

from hicache.controller import HybridCacheController
from hicache.factory import build_service
from hicache.l3.prefetches import BATCH_PAGES
from hicache.pools import HybridSWAPool, IndexSpace, Indices
from hicache.service import HiCacheService
from hicache.storage import FileStore, StorageBackend, chain_page_hashes

LONG = list(range(900, 900 + 2 * (2 * BATCH_PAGES + 4)))  # 36 pages of 2: three reads


def host_rows_of(service: HiCacheService, tokens: list[int]) -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """Full and SWA host rows (``[n, C, L, R]``) of the host-only path that holds
    ``tokens``, root side first."""
    match = service.match(tokens)
    assert match.host_hit_tokens == len(tokens)
    full, swa, node = [], [], match.last_host_node
    while node is not service.tree.root:
        assert node.host is not None and node.host_swa is not None
        full.insert(0, node.host.tensor)
        swa.insert(0, node.host_swa.tensor)
        node = node.parent
    controller = service.controller
    assert isinstance(controller, HybridCacheController)
    return (controller.host_pool.read_rows(Indices(torch.cat(full), IndexSpace.HOST_FULL)),
            controller.host_swa.read_rows(Indices(torch.cat(swa), IndexSpace.HOST_SWA)))


def test_a_prefetch_of_three_reads_brings_every_full_and_swa_row(tmp_path: Path) -> None:
    config = make_config(tmp_path / "l3", hybrid=True, device_tokens=128)
    writer, reader = build_service(config, **MODEL), build_service(config, **MODEL)
    try:
        pool = writer.device_pool
        assert isinstance(pool, HybridSWAPool)
        slots = writer.alloc_device(len(LONG))
        assert slots is not None
        write_rows(pool.full, slots.tensor, expected_rows(LONG, pool.full.num_layers))
        write_rows(pool.swa, pool.swa_slots_of(slots).tensor, expected_rows(LONG, 1, 0.5))
        writer.insert(LONG, slots)
        settle(writer)
        assert writer.storage is not None
        assert writer.storage.stats.backup_pages["stored"] == len(LONG) // 2
        key = reader.key(LONG)
        prefetch = reader.prefetch(key, reader.match(key))
        assert prefetch is not None and reader.wait_prefetch(prefetch, timeout_s=10.0)
        assert reader.finish_prefetch(prefetch) == len(LONG)
        full, swa = host_rows_of(reader, LONG)
        assert torch.equal(full, expected_rows(LONG, pool.full.num_layers))
        assert torch.equal(swa, expected_rows(LONG, 1, 0.5))
        reader.check_integrity()
    finally:
        writer.stop()
        reader.stop()


def test_a_page_the_store_cannot_read_ends_the_prefetch_with_the_store_s_reason(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hicache.l3.stats")
    tokens = LONG[:8]
    config = make_config(tmp_path / "l3")
    writer, reader = build_service(config, **MODEL), build_service(config, **MODEL)
    try:
        put(writer, tokens)
        settle(writer)
        third = chain_page_hashes(tokens, 2)[2]  # its file becomes a directory: open fails
        (page,) = (tmp_path / "l3").rglob(f"{third.hex()}.kv")
        page.unlink()
        page.mkdir()
        key = reader.key(tokens)
        prefetch = reader.prefetch(key, reader.match(key))
        assert prefetch is not None and reader.wait_prefetch(prefetch, timeout_s=10.0)
        assert reader.finish_prefetch(prefetch) == 4, "the pages before it"
        warnings = [r.getMessage() for r in caplog.records if "prefetch reads" in r.getMessage()]
        assert len(warnings) == 1 and "Is a directory" in warnings[0]
        reader.check_integrity()
    finally:
        writer.stop()
        reader.stop()


class FirstCallRaises(FileStore):
    """A file store whose first call of ``op`` raises what no store should (a bug, not an
    OSError); the worker ends the job as failed and goes on."""

    op = "put"

    def _first(self) -> None:
        if not getattr(self, "raised", False):
            self.raised = True
            raise RuntimeError("injected: a bug in the store")

    def exists(self, *args: Any, **kwargs: Any) -> Any:
        if self.op == "exists":
            self._first()
        return super().exists(*args, **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        if self.op == "get":
            self._first()
        return super().get(*args, **kwargs)

    def put(self, *args: Any, **kwargs: Any) -> Any:
        if self.op == "put":
            self._first()
        return super().put(*args, **kwargs)


def raising_store(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    def open_raising(config: Any, ns: Any) -> StorageBackend:
        store = FirstCallRaises(config.storage.path, ns, timeout_s=config.storage.timeout_s)
        store.op = op
        return store

    monkeypatch.setattr("hicache.factory.open_configured_store", open_raising)


@pytest.mark.parametrize("op", ["exists", "get"])
def test_a_prefetch_whose_store_call_raises_counts_its_pages_as_errors(
        op: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = LONG[:8]
    config = make_config(tmp_path / "l3")
    writer = build_service(config, **MODEL)
    try:
        put(writer, tokens)
        settle(writer)
    finally:
        writer.stop()
    raising_store(monkeypatch, op)
    reader = build_service(config, **MODEL)
    try:
        tier = reader.storage
        assert tier is not None
        for attached in (0, len(tokens)):  # the first raises, the second reads
            key = reader.key(tokens)
            prefetch = reader.prefetch(key, reader.match(key))
            assert prefetch is not None and reader.wait_prefetch(prefetch, timeout_s=10.0)
            assert reader.finish_prefetch(prefetch) == attached
        assert tier.stats.worker_errors == 1
        assert tier.stats.prefetch_tokens["error"] == len(tokens), dict(tier.stats.prefetch_tokens)
        reader.check_integrity()
    finally:
        reader.stop()


def test_a_put_that_raises_is_counted_failed_and_the_next_is_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raising_store(monkeypatch, "put")
    service = build_service(make_config(tmp_path / "l3"), **MODEL)
    try:
        tier = service.storage
        assert tier is not None
        put(service, [1, 2, 3, 4])
        settle(service)
        assert tier.stats.backup_pages["failed"] == 2 and tier.stats.worker_errors == 1
        put(service, [5, 6, 7, 8])
        settle(service)
        assert tier.stats.backup_pages["stored"] == 2
        assert service.match([5, 6, 7, 8]).last_device_node.in_storage
        assert not service.match([1, 2, 3, 4]).last_device_node.in_storage
        service.check_integrity()
    finally:
        service.stop()

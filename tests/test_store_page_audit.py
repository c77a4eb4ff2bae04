"""The demo's audit of the shared store (hicache.engine.store_pages): pages one instance
stores carry the digests of their rows to another instance's load check, page by page, for
multi-page puts and arrivals that split them differently; pages nobody watched store, and
pages stored before the audit saw their rows, are never trusted; ``store_config`` names
the store it makes."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from test_l3_tier import MODEL, fetch, make_config, put, settle

from hicache.config import load_default_config
from hicache.config.storage import StorageKind
from hicache.engine.store_pages import StorePageAudit, store_config
from hicache.engine.verify import TransferAudit
from hicache.factory import build_service
from hicache.service import HiCacheService
from hicache.storage import FileStore, PageBuffers, StorageResult


class Watched:
    """A service with its transfer audit, watched by a shared store audit."""

    def __init__(self, service: HiCacheService, pages: StorePageAudit | None) -> None:
        self.service = service
        self.audit = TransferAudit(service.controller)
        assert self.audit.checked_pages == 0 and self.audit.mismatches == []
        if pages is not None:
            pages.watch(service, self.audit)

    def fetch_and_check(self, tokens: list[int]) -> tuple[int, int]:
        """Tokens attached from the store, pages the load check compared."""
        attached, _ = fetch(self.service, tokens)
        before = self.audit.checked_pages
        checked = self.audit.check_loads()
        assert self.audit.checked_pages == before + checked
        return attached, checked


@pytest.fixture
def services(tmp_path: Path) -> Iterator[list[HiCacheService]]:
    made: list[HiCacheService] = []
    yield made
    for service in made:
        service.stop()


def build(services: list[HiCacheService], path: Path, **config: object) -> HiCacheService:
    service = build_service(make_config(path, **config), **MODEL)  # type: ignore[arg-type]
    services.append(service)
    return service


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_a_tail_fetched_alone_is_checked_against_the_multi_page_put(
        tmp_path: Path, services: list[HiCacheService], hybrid: bool) -> None:
    """Instance a stores 10 pages in one put; b computed the first 4 itself and fetches
    pages 4..9 (the put's 5th page is the arrival's 1st): every loaded page matches a's
    rows, SWA rows too."""
    pages = StorePageAudit()
    a = Watched(build(services, tmp_path / "l3", hybrid=hybrid), pages)
    b = Watched(build(services, tmp_path / "l3", hybrid=hybrid), pages)
    tokens = list(range(300, 320))
    put(a.service, tokens)
    settle(a.service)
    assert pages.stored_pages == 10 and len(pages.pages) == 10 and pages.failed_pages == 0
    assert all(len(full) == 2 and (swa is None) is not hybrid
               for full, swa in pages.pages.values())
    put(b.service, tokens[:8])
    settle(b.service)
    b.service.evict(10**6)
    b.service.step()
    attached, checked = b.fetch_and_check(tokens)
    assert attached == 12
    assert checked >= 6 + (6 if hybrid else 0)
    assert b.audit.mismatches == []
    assert pages.arrived_pages == 6 and pages.unknown_pages == 0


def test_bytes_the_store_returns_wrong_are_reported(tmp_path: Path,
                                                   services: list[HiCacheService],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that hands back one flipped byte with a good status (a bug, not a torn
    file): the load check reports exactly that page."""
    pages = StorePageAudit()
    a = Watched(build(services, tmp_path / "l3"), pages)
    b = Watched(build(services, tmp_path / "l3"), pages)
    tokens = list(range(400, 412))
    put(a.service, tokens)
    settle(a.service)
    real_get = FileStore.get

    def flip_third(self: FileStore, page_hashes: Sequence[bytes],
                   buffers: Sequence[PageBuffers], timeout_s: float | None = None
                   ) -> StorageResult:
        result = real_get(self, page_hashes, buffers, timeout_s)
        if len(buffers) > 2:
            view = memoryview(buffers[2][0]).cast("B")
            view[0] ^= 1
        return result

    monkeypatch.setattr(FileStore, "get", flip_third)
    attached, checked = b.fetch_and_check(tokens)
    assert attached == 12 and checked == 6
    assert len(b.audit.mismatches) == 1, b.audit.mismatches
    assert "differs from its backup" in b.audit.mismatches[0]
    assert pages.arrived_pages == 6 and pages.unknown_pages == 0


def test_pages_nobody_watched_store_are_never_trusted(tmp_path: Path,
                                                       services: list[HiCacheService]) -> None:
    """Pages another (unwatched) process stored arrive as unknown: counted, and every one
    of them reported when loaded, since nothing says what they must hold."""
    pages = StorePageAudit()
    stranger = build(services, tmp_path / "l3")
    b = Watched(build(services, tmp_path / "l3"), pages)
    tokens = list(range(500, 508))
    put(stranger, tokens)
    settle(stranger)
    attached, checked = b.fetch_and_check(tokens)
    assert attached == 8 and checked == 4
    assert pages.arrived_pages == 4 and pages.unknown_pages == 4
    assert len(b.audit.mismatches) == 4
    assert pages.stored_pages == 0 and pages.pages == {}


def test_pages_stored_before_the_audit_saw_their_rows_are_not_filed(
        tmp_path: Path, services: list[HiCacheService]) -> None:
    """Write-back: a's rows reached the host before its audit existed, then went to the
    store: nothing is filed for them (their digests are unknown), so their arrival in b is
    unknown, not a comparison with partial digests."""
    pages = StorePageAudit()
    a_service = build(services, tmp_path / "l3", policy="write_back")
    tokens = list(range(600, 606))
    put(a_service, tokens)
    settle(a_service)
    a = Watched(a_service, pages)
    a.service.evict(10**6)
    a.service.step()
    a.service.evict_host(10**6)
    settle(a.service)
    assert pages.stored_pages == 3 and pages.pages == {}
    b = Watched(build(services, tmp_path / "l3", policy="write_back"), pages)
    attached, _ = b.fetch_and_check(tokens)
    assert attached == 6
    assert pages.arrived_pages == 3 and pages.unknown_pages == 3


def test_store_config_names_the_store_it_makes(tmp_path: Path) -> None:
    config = load_default_config()
    with store_config(config, "file") as (made, where):
        assert made.storage.backend is StorageKind.FILE
        temporary = made.storage.path
        assert temporary is not None and os.path.isdir(temporary)
        assert not Path(temporary).is_relative_to(Path.cwd())
        assert where == "file store in a temporary directory"
        assert made.storage.prefetch_threshold_tokens == config.page_size_tokens
    assert not os.path.exists(temporary)
    directory = str(tmp_path / "store")
    for location in (directory, f"file://{directory}"):
        with store_config(config, location) as (made, where):
            assert made.storage.backend is StorageKind.FILE
            assert made.storage.path == directory and where == f"file store in {directory}"
    with store_config(config, "redis://:secret@127.0.0.1:7000") as (made, where):
        assert made.storage.backend is StorageKind.REDIS
        assert made.storage.url == "redis://:secret@127.0.0.1:7000"
        assert where == "Redis at 127.0.0.1:7000"
    with pytest.raises(ValueError, match="unknown storage scheme"), \
            store_config(config, "s3://bucket"):
        pass

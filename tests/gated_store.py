"""A file store whose puts wait at a gate, for tests that need a put to the shared store
held in flight: the real store, the real worker threads, only the timing chosen."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest

from hicache.config import HiCacheConfig
from hicache.factory import build_service
from hicache.service import HiCacheService
from hicache.storage import FileStore, PageBuffers, StorageBackend, StorageResult


class GatedFileStore(FileStore):
    """A file store whose puts wait until ``gate`` is set; ``entered`` is set once a put
    waits there, ``puts`` counts the put calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.puts = 0

    def put(self, page_hashes: Sequence[bytes], pages: Sequence[PageBuffers],
            timeout_s: float | None = None) -> StorageResult:
        self.puts += 1  # the backup worker is the only caller
        self.entered.set()
        assert self.gate.wait(10.0), "the test never opened the gate"
        return super().put(page_hashes, pages, timeout_s)


def gated_service(monkeypatch: pytest.MonkeyPatch, config: HiCacheConfig, model: dict[str, str]
                  ) -> tuple[HiCacheService, GatedFileStore]:
    """A service built from ``config`` (a file store) over a :class:`GatedFileStore`."""
    made: list[GatedFileStore] = []

    def open_gated(config: Any, ns: Any) -> StorageBackend:
        made.append(GatedFileStore(config.storage.path, ns, timeout_s=config.storage.timeout_s))
        return made[-1]

    monkeypatch.setattr("hicache.factory.open_configured_store", open_gated)
    service = build_service(config, **model)
    (store,) = made
    return service, store

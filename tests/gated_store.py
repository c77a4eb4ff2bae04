"""A file store whose calls wait at a gate, for tests that need a call to the shared store
held in flight (a put, a prefetch's query or read): the real store, the real worker threads,
only the timing chosen."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from hicache.config import HiCacheConfig
from hicache.factory import build_service
from hicache.service import HiCacheService
from hicache.storage import FileStore, PageBuffers, StorageBackend, StorageResult


class GatedFileStore(FileStore):
    """A file store whose calls named in ``gated`` (``put`` by default; also ``exists`` and
    ``get``) wait until ``gate`` is set, but for the first ``passed`` of them; ``entered`` is
    set once such a call waits there, ``calls`` counts the calls by name (``puts``: the put
    calls)."""

    def __init__(self, *args: Any, gated: Sequence[str] = ("put",), passed: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gated = frozenset(gated)
        self.passed = passed
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: Counter[str] = Counter()  # exists, get: the prefetch worker; put: backups

    @property
    def puts(self) -> int:
        return self.calls["put"]

    def _pass(self, name: str) -> None:
        self.calls[name] += 1
        if name in self.gated and self.passed:
            self.passed -= 1
        elif name in self.gated:
            self.entered.set()
            assert self.gate.wait(10.0), "the test never opened the gate"

    def exists(self, page_hashes: Sequence[bytes], timeout_s: float | None = None
               ) -> StorageResult:
        self._pass("exists")
        return super().exists(page_hashes, timeout_s)

    def get(self, page_hashes: Sequence[bytes], pages: Sequence[PageBuffers],
            timeout_s: float | None = None) -> StorageResult:
        self._pass("get")
        return super().get(page_hashes, pages, timeout_s)

    def put(self, page_hashes: Sequence[bytes], pages: Sequence[PageBuffers],
            timeout_s: float | None = None) -> StorageResult:
        self._pass("put")
        return super().put(page_hashes, pages, timeout_s)


def gated_service(monkeypatch: pytest.MonkeyPatch, config: HiCacheConfig, model: dict[str, str],
                  gated: Sequence[str] = ("put",), tp_group: object = None, passed: int = 0
                  ) -> tuple[HiCacheService, GatedFileStore]:
    """A service built from ``config`` (a file store) over a :class:`GatedFileStore` that
    holds the calls named in ``gated`` (of a tensor-parallel rank with ``tp_group``)."""
    made: list[GatedFileStore] = []

    def open_gated(config: Any, ns: Any) -> StorageBackend:
        made.append(GatedFileStore(config.storage.path, ns, timeout_s=config.storage.timeout_s,
                                   gated=gated, passed=passed))
        return made[-1]

    monkeypatch.setattr("hicache.factory.open_configured_store", open_gated)
    service = build_service(config, tp_group=tp_group, **model)
    (store,) = made
    return service, store

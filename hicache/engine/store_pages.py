"""The demo's shared store (L3): the match that asks the store for what the tiers miss, and
the check that pages coming from the store hold what another instance backed up.

:func:`match_with_store` is the engine's admission match when the service has a store:
match, prefetch the uncached tail, wait for it (the demo is synchronous), give the tree
what arrived, match again.

:class:`StorePageAudit` extends :class:`~hicache.engine.verify.TransferAudit` across
instances: when an instance sends pages to the store it files the digests of their rows
(taken when they were backed up from the device) under the pages' hashes; when pages arrive
in another instance's host slots, those digests become the expected rows of those slots, so
the audit's load check compares every row that reaches a device from the store with the
rows the first instance computed.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from hicache.config import HiCacheConfig
from hicache.config.storage import StorageConfig, StorageKind
from hicache.radix import MatchResult
from hicache.service import HiCacheService

from .verify import TransferAudit


def match_with_store(service: HiCacheService, tokens: list[int]) -> MatchResult:
    """``service.match(tokens)``, after fetching from the store what the tiers miss."""
    key = service.key(tokens)
    match = service.match(key)
    prefetch = service.prefetch(key, match)
    if prefetch is None:
        return match
    service.wait_prefetch(prefetch)
    if service.finish_prefetch(prefetch):
        match = service.match(key)
    return match


class StorePageAudit:
    """Digests of stored pages by page hash, shared by the audits of several instances."""

    def __init__(self) -> None:
        self.pages: dict[bytes, list[bytes]] = {}
        self.arrived_pages = 0
        self.unknown_pages = 0  # arrived, but no instance of this run stored them

    def watch(self, service: HiCacheService, audit: TransferAudit) -> None:
        """File the pages ``service`` stores; give its audit the digests of pages that
        arrive."""
        tier = service.storage
        if tier is None:
            return
        page = service.tree.page_size
        digests = audit._digests["full"]

        def observe(event: str, hashes: list[bytes], host: torch.Tensor) -> None:
            slots = host.tolist()
            for i, page_hash in enumerate(hashes):
                mine = slots[i * page:(i + 1) * page]
                if event == "put":
                    rows = [digests.get(slot) for slot in mine]
                    if all(row is not None for row in rows):
                        self.pages[page_hash] = [row for row in rows if row is not None]
                    continue
                self.arrived_pages += 1
                known = self.pages.get(page_hash)
                if known is None:
                    self.unknown_pages += 1
                    for slot in mine:
                        digests.pop(slot, None)  # never matches: reported if loaded
                else:
                    digests.update(zip(mine, known, strict=True))

        tier.observers.append(observe)


@contextmanager
def store_config(config: HiCacheConfig, storage: str) -> Iterator[tuple[HiCacheConfig, str]]:
    """``config`` with a ``storage`` section for ``storage`` (``file``: a temporary
    directory, removed afterwards; a directory; or a ``redis://`` / ``redis+cluster://``
    URL), and how to name the store in the report.

    Raises:
        ValueError: a location the store cannot use (one line, from the config's checks).
    """
    base = config.storage
    with ExitStack() as stack:
        if storage.startswith(("redis://", "redis+cluster://")):
            section = StorageConfig(backend=StorageKind.REDIS, url=storage,
                                    prefetch_policy=base.prefetch_policy,
                                    prefetch_threshold_tokens=base.prefetch_threshold_tokens,
                                    timeout_s=base.timeout_s)
            where = f"Redis at {storage.split('@')[-1]}"
        else:
            path = storage
            where = f"file store in {storage}"
            if storage == "file":
                path = stack.enter_context(tempfile.TemporaryDirectory(prefix="hicache-l3-"))
                where = "file store in a temporary directory"
            section = StorageConfig(backend=StorageKind.FILE, path=path,
                                    prefetch_policy=base.prefetch_policy,
                                    prefetch_threshold_tokens=base.prefetch_threshold_tokens,
                                    timeout_s=base.timeout_s)
        yield dataclasses.replace(config, storage=section), where

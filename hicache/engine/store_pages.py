"""The demo's shared store (L3): the match that asks the store for what the tiers miss, and
the check that pages coming from the store hold what another instance backed up.

:func:`match_with_store` is the engine's admission match when the service has a store:
match, prefetch the uncached tail, wait for it (the demo is synchronous), give the tree
what arrived, match again.

:class:`StorePageAudit` extends :class:`~hicache.engine.verify.TransferAudit` across
instances: when an instance sends pages to the store it files the digests of their rows
(taken when they were backed up from the device) under the pages' hashes (a page whose put
then fails is never found, so its digests are never used; :attr:`StorePageAudit.stored_pages`
counts only the pages the store took); when pages arrive
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
from hicache.l3 import StorageTier
from hicache.radix import MatchResult
from hicache.service import HiCacheService
from hicache.storage.store_url import parse_location

from .verify import TransferAudit


def match_with_store(service: HiCacheService, tokens: list[int]) -> tuple[MatchResult, int]:
    """``service.match(tokens)``, after fetching from the store what the tiers miss, and
    how many leading tokens the tiers held before (those after, up to the match's end,
    came from the store)."""
    key = service.key(tokens)
    match = service.match(key)
    cached = match.device_hit_tokens + match.host_hit_tokens
    prefetch = service.prefetch(key, match)
    if prefetch is None:
        return match, cached
    service.wait_prefetch(prefetch)
    if service.finish_prefetch(prefetch):
        match = service.match(key)
    return match, cached


class StorePageAudit:
    """Digests of stored pages by page hash, shared by the audits of several instances."""

    def __init__(self) -> None:
        # page hash -> (digests of its full rows, of its SWA rows or None)
        self.pages: dict[bytes, tuple[list[bytes], list[bytes] | None]] = {}
        self.arrived_pages = 0
        self.unknown_pages = 0  # arrived, but no instance of this run stored them
        self._tiers: list[StorageTier] = []  # of the instances watched

    @property
    def stored_pages(self) -> int:
        """Pages written to the store, over every instance watched (a put of a page the
        store already holds writes nothing: the tier counts it stored, the store skipped)."""
        return sum(tier.store.stats().pages_written for tier in self._tiers)

    @property
    def failed_pages(self) -> int:
        """Pages sent to the store whose put failed (a server gone, a full disk)."""
        return sum(tier.stats.backup_pages["failed"] for tier in self._tiers)

    def watch(self, service: HiCacheService, audit: TransferAudit) -> None:
        """File the pages ``service`` stores; give its audit the digests of pages that
        arrive."""
        tier = service.storage
        if tier is None:
            return
        self._tiers.append(tier)
        page = service.tree.page_size
        full, swa_digests = audit.digests("full"), audit.digests("swa")

        def observe(event: str, hashes: list[bytes], host: torch.Tensor,
                    swa: torch.Tensor | None) -> None:
            slots = host.tolist()
            swa_slots = None if swa is None else swa.tolist()
            for i, page_hash in enumerate(hashes):
                mine = slots[i * page:(i + 1) * page]
                mine_swa = None if swa_slots is None else swa_slots[i * page:(i + 1) * page]
                if event == "put":
                    self._file(page_hash, [full.get(s) for s in mine],
                               None if mine_swa is None else [swa_digests.get(s)
                                                               for s in mine_swa])
                    continue
                self.arrived_pages += 1
                known = self.pages.get(page_hash)
                if known is None:
                    self.unknown_pages += 1
                    for slot in mine:
                        full.pop(slot, None)  # never matches: reported if loaded
                    for slot in mine_swa or []:
                        swa_digests.pop(slot, None)
                    continue
                full.update(zip(mine, known[0], strict=True))
                audit.from_store["full"].update(mine)
                if mine_swa is not None and known[1] is not None:
                    swa_digests.update(zip(mine_swa, known[1], strict=True))
                    audit.from_store["swa"].update(mine_swa)

        tier.observers.append(observe)

    def _file(self, page_hash: bytes, full: list[bytes | None],
              swa: list[bytes | None] | None) -> None:
        """Keep a stored page's digests when all of them are known."""
        if any(d is None for d in full) or (swa is not None and any(d is None for d in swa)):
            return
        self.pages[page_hash] = ([d for d in full if d is not None],
                                 None if swa is None else [d for d in swa if d is not None])


@contextmanager
def store_config(config: HiCacheConfig, storage: str) -> Iterator[tuple[HiCacheConfig, str]]:
    """``config`` with a ``storage`` section for ``storage`` (``file``: a temporary
    directory, removed afterwards; a directory or ``file:///`` URL; or a ``redis://`` /
    ``redis+cluster://`` URL), and how to name the store in the report. The demo's prompts
    are short, so any uncached tail of a page or more is asked for
    (``prefetch_threshold_tokens``: one page).

    Raises:
        ValueError: a location the store cannot use (one line, from the parser of store
            locations or the config's checks).
    """
    base = dataclasses.replace(StorageConfig(), prefetch_policy=config.storage.prefetch_policy,
                               prefetch_threshold_tokens=config.page_size_tokens,
                               timeout_s=config.storage.timeout_s)
    with ExitStack() as stack:
        parsed = None if storage == "file" else parse_location(storage)
        if parsed is None:
            path = stack.enter_context(tempfile.TemporaryDirectory(prefix="hicache-l3-"))
            section = dataclasses.replace(base, backend=StorageKind.FILE, path=path)
            where = "file store in a temporary directory"
        elif parsed.path is None:
            section = dataclasses.replace(base, backend=StorageKind.REDIS, url=storage)
            where = f"Redis at {storage.split('@')[-1]}"
        else:
            section = dataclasses.replace(base, backend=StorageKind.FILE, path=parsed.path)
            where = f"file store in {parsed.path}"
        yield dataclasses.replace(config, storage=section), where

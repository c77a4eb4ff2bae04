"""Tensor-parallel ranks of an MLA model keep one copy of each page in the store
(:mod:`hicache.l3.shared_copy`): real spawned processes, a real gloo group, real file
stores and Redis servers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rank_helpers import run_ranks
from rank_store_helpers import MODEL, store_config, store_traffic
from shared_copy_helpers import PROMPTS, built_share, one_copy
from storage_helpers import needs_redis

from hicache.bench.redis_local import RedisServer
from hicache.factory import build_service
from hicache.l3 import StorageTier
from hicache.l3.shared_copy import WriteShare

PAGES = sum(len(tokens) for tokens in PROMPTS) // 2  # pages of 2 tokens


def _page_files(directory: Path) -> int:
    return sum(1 for _, _, files in os.walk(directory) for name in files
               if name.endswith(".kv"))


def _served_alike(results: list[dict[str, Any]]) -> None:
    """Every rank found and holds every prompt again, as stored on every rank."""
    for result in results:
        assert result["in_storage"] == len(PROMPTS)
        assert result["found"] == result["host_hits"] == [len(t) for t in PROMPTS]


def test_ranks_that_see_one_store_write_each_page_once(tmp_path: Path) -> None:
    """Two ranks share a file store's directory: each writes the pages whose hash falls to
    it, every page is written once (the store holds one file a page and no probe page),
    and each rank still reads every page back."""
    store = str(tmp_path / "l3")
    results = run_ranks(one_copy, 2, tmp_path, [store, store])
    assert [r["share"] for r in results] == [[0, 2], [1, 2]]
    assert [r["gauge"] for r in results] == [2.0, 2.0]  # hicache_l3_write_share_ranks
    _served_alike(results)
    stored = [r["stored"] for r in results]
    assert sum(stored) == PAGES and all(0 < n < PAGES for n in stored)
    # rank 0's store also wrote the probe page (since removed)
    assert [r["written"] for r in results] == [stored[0] + 1, stored[1]]
    assert sum(r["skipped"] for r in results) == 0
    assert _page_files(tmp_path / "l3") == PAGES


def test_ranks_with_stores_of_their_own_each_write_every_page(tmp_path: Path) -> None:
    """Two ranks whose file stores are different directories (as machines with local
    disks): neither sees the other's probe page, so each writes every page to its own."""
    stores = [str(tmp_path / "l3-0"), str(tmp_path / "l3-1")]
    results = run_ranks(one_copy, 2, tmp_path, stores)
    assert [r["share"] for r in results] == [None, None]
    assert [r["gauge"] for r in results] == [0.0, 0.0]
    _served_alike(results)
    assert [r["stored"] for r in results] == [PAGES, PAGES]
    assert [_page_files(Path(s)) for s in stores] == [PAGES, PAGES]


@needs_redis
def test_ranks_on_one_redis_server_write_each_page_once(tmp_path: Path) -> None:
    """The same with a real Redis server for both ranks: each sends its share, no page
    twice, and reads every page back."""
    server = RedisServer(tmp_path / "redis")
    (tmp_path / "redis").mkdir()
    server.start()
    try:
        url = f"redis://127.0.0.1:{server.port}"
        results = run_ranks(one_copy, 2, tmp_path, [url, url])
    finally:
        server.stop()
    assert [r["share"] for r in results] == [[0, 2], [1, 2]]
    _served_alike(results)
    stored = [r["stored"] for r in results]
    assert sum(stored) == PAGES and all(0 < n < PAGES for n in stored)
    assert [r["written"] for r in results] == [stored[0] + 1, stored[1]]  # and the probe
    assert sum(r["skipped"] for r in results) == 0


@needs_redis
def test_a_store_that_fails_the_probe_leaves_every_rank_writing_every_page(
        tmp_path: Path) -> None:
    """No server behind the URL: the probe's put fails, and the build goes on without a
    share of the writes."""
    server = RedisServer(tmp_path / "redis")  # its port, free; the server never started
    url = f"redis://127.0.0.1:{server.port}"
    results = run_ranks(built_share, 2, tmp_path, url)
    assert [r["share"] for r in results] == [None, None]


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_ranks_sharing_one_copy_give_the_same_answers(tmp_path: Path, hybrid: bool) -> None:
    """Random traffic (as in ``test_rank_agreement_l3``) of an MLA model on two ranks that
    share one store, each rank deleting pages of its own choosing now and then: the ranks
    answer alike, and the store was used. ``hybrid``: a sliding-window layer too (a page
    goes to the store with its window rows, when it has them all)."""
    results = run_ranks(store_traffic, 2, tmp_path, str(tmp_path / "l3"),
                        {"mla": True, "hybrid": hybrid}, 5, 120)
    for result in results:
        assert result["diverged"] is None and result["held"] == 0
        assert result["share"] is not None and result["stored"] > 0
        assert result["prefetches"] > 0 and result["dropped"] == 0
    assert results[0]["answers"] == results[1]["answers"]
    assert any(answer[1] > 0 for answer in results[0]["answers"])


@pytest.mark.parametrize("size", [2, 3, 8])
def test_each_page_falls_to_one_rank_and_the_ranks_get_about_as_many(size: int) -> None:
    hashes = [os.urandom(32) for _ in range(4000)]
    written = np.stack([WriteShare(rank, size).written(hashes) for rank in range(size)])
    assert (written.sum(axis=0) == 1).all()  # every page by exactly one rank
    assert written.sum(axis=1).min() > 0.8 * len(hashes) / size
    # the documented rule, the same in every process: the hash's first 8 bytes, LE, mod size
    assert written.argmax(axis=0).tolist() == [int.from_bytes(h[:8], "little") % size
                                               for h in hashes]


def test_a_share_of_the_writes_without_an_agreement_is_refused(tmp_path: Path) -> None:
    """Without the ranks agreeing on each put, a rank's share would mark a node stored
    that other ranks never wrote: refused, and the service's tier is left as it was."""
    config = store_config(str(tmp_path / "l3"), mla=True)
    service = build_service(config, **MODEL)
    tier = service.storage
    assert tier is not None and tier.backups.share is None
    try:
        with pytest.raises(ValueError, match="needs agreed=True"):
            StorageTier(service.tree, tier.store, config.storage, share=WriteShare(0, 2))
        assert service.tree.storage is tier
    finally:
        service.stop()

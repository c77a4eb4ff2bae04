"""Page hashes across a split: a stored node split by a later insert keeps, on each side,
the hashes of its own pages, so what is stored below either side later chains from the
right page and another instance finds it (CPU, the real file store)."""

from __future__ import annotations

from pathlib import Path

import torch
from radix_helpers import expected_rows, read_rows
from test_l3_tier import MODEL, fetch, make_config, pool_of, put, settle

from hicache.factory import build_service
from hicache.service import HiCacheService

X = list(range(400, 416))  # 8 pages of 2
BRANCH = [*X[:6], 900, 901, 902, 903]  # splits X after its third page
LONGER = [*X, 950, 951, 952, 953]  # extends X below its lower half


def test_what_is_stored_below_a_split_node_is_found_by_another_instance(tmp_path: Path
                                                                         ) -> None:
    a = build_service(make_config(tmp_path / "l3"), **MODEL)
    b = build_service(make_config(tmp_path / "l3"), **MODEL)
    try:
        check_split(a, b)
    finally:
        a.stop()
        b.stop()


def check_split(a: HiCacheService, b: HiCacheService) -> None:
    put(a, X)
    settle(a)
    assert a.storage is not None and a.storage.stats.backup_pages["stored"] == 8
    put(a, BRANCH)
    put(a, LONGER)
    settle(a)
    assert a.storage.stats.backup_pages["stored"] == 12
    upper = [n for n in a.tree.nodes() if n.tokens == tuple(X[:6])]
    assert len(upper) == 1 and upper[0].page_hashes is not None
    assert len(upper[0].page_hashes) == 3 * 32, "the upper node keeps its 3 pages' hashes"
    # b has X's first 6 tokens itself once it fetched BRANCH: 14 of LONGER come from the store
    for tokens, from_store in ((BRANCH, 10), (LONGER, 14)):
        attached, device = fetch(b, tokens)
        assert attached == from_store and len(device) == len(tokens), tokens
        pool = pool_of(b)
        assert torch.equal(read_rows(pool, device.tensor),
                           expected_rows(tokens, pool.num_layers))
    b.check_integrity()

"""Host eviction under the store's ``write_back``: a leaf leaves the host only once it is
stored, and the parent it leaves behind becomes the next leaf to store and evict (CPU, the
real file store in a temporary directory)."""

from __future__ import annotations

from pathlib import Path

import torch
from radix_helpers import expected_rows, read_rows
from test_l3_tier import MODEL, fetch, make_config, pool_of, put, settle

from hicache.factory import build_service


def test_a_stored_leaf_leaves_its_parent_next_in_line(tmp_path: Path) -> None:
    """A prefix of 10 tokens and a longer request of 16 sharing it are two host-only nodes,
    parent and child. The first host eviction can only take the child: it is queued for the
    store and leaves once stored. Its parent is then a host leaf, and the next eviction
    stores it and lets it go too; another instance finds all 16 tokens in the store."""
    a = build_service(make_config(tmp_path / "l3", policy="write_back"), **MODEL)
    b = build_service(make_config(tmp_path / "l3", policy="write_back"), **MODEL)
    try:
        prefix, longer = list(range(700, 710)), list(range(700, 716))
        put(a, prefix)
        put(a, longer)
        settle(a)
        assert a.storage is not None
        assert sorted(node.num_tokens for node in a.tree.nodes()) == [6, 10]
        a.evict(10**6)
        a.step()
        assert a.evict_host(10**6) == 0  # the child, queued for the store first
        settle(a)
        assert a.storage.stats.backup_pages["stored"] == 3
        assert [node.num_tokens for node in a.tree.nodes()] == [10], \
            "the child left once stored, its parent stays"
        assert a.evict_host(10**6) == 0  # the parent, now a leaf, queued in its turn
        settle(a)
        assert a.storage.stats.backup_pages["stored"] == 8
        assert not list(a.tree.nodes()), "the parent left once stored"
        a.check_integrity()
        attached, device = fetch(b, longer)
        assert attached == 16
        pool = pool_of(b)
        assert torch.equal(read_rows(pool, device.tensor), expected_rows(longer, pool.num_layers))
    finally:
        a.stop()
        b.stop()

"""Audit of the shared-store tier against the tree.

- Under ``storage.write_policy: write_back``, a host eviction did not count the leaves it
  sends to the store first (they leave once stored): ``evict_host(2)``, or a prefetch short
  of a page of host room, wrote every host-only leaf to the store and emptied the host.
- ``prefetch(tokens, match)`` took a match of other tokens and asked the store for the tail
  of these under the other request's node: now a ``ValueError``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_l3_tier import MODEL, make_config, put, settle

from hicache.factory import build_service


def test_evict_host_of_one_page_evicts_one_leaf_not_the_whole_host(tmp_path: Path) -> None:
    service = build_service(make_config(tmp_path / "l3", policy="write_back"), **MODEL)
    try:
        for r in range(4):  # four unrelated prefixes of 2 pages: four host-only leaves later
            put(service, [100 * (r + 1) + i for i in range(4)])
        settle(service)
        service.evict(10**6)  # every node host-only now
        settle(service)
        assert len(list(service.tree.nodes())) == 4
        host_tokens = sum(n.num_tokens for n in service.tree.nodes())
        assert host_tokens == 16

        service.evict_host(2)  # the engine wants one page of host room
        settle(service)

        left = sum(n.num_tokens for n in service.tree.nodes())
        # one leaf (4 tokens) suffices for the 2 asked; at worst a few more, never all of them
        assert left >= 12, f"evict_host(2) emptied the host: {16 - left} of 16 tokens left it"
        service.check_integrity()
    finally:
        service.stop()


def test_a_prefetch_short_of_host_room_does_not_empty_the_host(tmp_path: Path) -> None:
    """The same through a prefetch: the pages found need 4 host tokens, the host (16 tokens)
    is full of 4 host-only leaves; making room for 4 tokens sends all 16 to the store and
    evicts them all."""
    writer = build_service(make_config(tmp_path / "l3", policy="write_through"), **MODEL)
    reader = build_service(make_config(tmp_path / "l3", policy="write_back", device_tokens=8),
                           **MODEL)
    try:
        wanted = [900, 901, 902, 903]
        put(writer, wanted)
        settle(writer)
        assert writer.storage is not None and writer.storage.stats.backup_pages["stored"] == 2
        for r in range(4):  # fill the reader's host (2 x 8 tokens) with 4 leaves of 4 tokens
            put(reader, [100 * (r + 1) + i for i in range(4)])
            settle(reader)
            reader.evict(10**6)
            settle(reader)
        assert reader.tree.io.host_free_tokens() == 0
        assert sum(n.num_tokens for n in reader.tree.nodes()) == 16

        key = reader.key(wanted)
        prefetch = reader.prefetch(key, reader.match(key))
        assert prefetch is not None
        reader.wait_prefetch(prefetch, timeout_s=10.0)
        reader.finish_prefetch(prefetch)
        settle(reader)

        left = sum(n.num_tokens for n in reader.tree.nodes() if n.host is not None)
        assert left >= 12, f"making room for 4 tokens evicted {16 - left} of 16 host tokens"
        reader.check_integrity()
    finally:
        writer.stop()
        reader.stop()


def test_a_match_of_other_tokens_is_refused(tmp_path: Path) -> None:
    service = build_service(make_config(tmp_path / "l3"), **MODEL)
    try:
        put(service, [1, 2, 3, 4])
        settle(service)
        match_a = service.match(service.key([1, 2, 3, 4, 5, 6]))  # 4 tokens on the device
        assert match_a.device_hit_tokens == 4
        key_b = service.key([9, 9, 9, 9, 5, 6, 7, 8])  # another request, nothing cached
        with pytest.raises(ValueError, match="the match is not of these tokens"):
            service.prefetch(key_b, match_a)
        assert not service.tree.root.children[next(iter(service.tree.root.children))] \
            .lock_count  # nothing locked for it
        prefetch = service.prefetch(service.key([1, 2, 3, 4, 5, 6, 7, 8]), match_a)
        if prefetch is not None:  # the same request's longer tokens: taken
            service.finish_prefetch(prefetch)
        service.check_integrity()
    finally:
        service.stop()

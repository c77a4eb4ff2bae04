"""A load-back's window at its edges (``host.swa_history: all``): a host span as long as the
window restores nothing from the device prefix; at pages of one token, a window that ends
one token into a shallower device node, or one token before the host span, is restored to
that token; a prefix whose window's SWA rows left the device with no host copy is not
reused; a recomputed host-only node takes the copies it lacked (CPU, a hybrid model)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_service import make_config
from test_step_backups_hybrid import hybrid_pool
from test_swa_history import serve, swa_rows

from hicache.config import config_from_dict
from hicache.controller import HybridCacheController
from hicache.factory import build_service
from hicache.pools import IndexSpace, Indices
from hicache.radix.node import Refusal, TreeNode
from hicache.radix.window_tail import evict_host_swa
from hicache.service import HiCacheService

T = list(range(1, 13))  # 12 tokens: serve() copies the SWA rows of the first 8 to the host
OTHER_TAIL = [50, 51, 52, 53]


@pytest.fixture
def service() -> Iterator[HiCacheService]:
    svc = build_service(make_config(hybrid=True))  # window 3 in pages of 2: a 4-token tail
    yield svc
    svc.stop()


def test_a_host_span_as_long_as_the_window_restores_nothing(service: HiCacheService) -> None:
    serve(service, T)
    service.step()
    serve(service, [*T[:8], *OTHER_TAIL])  # splits T's node after 8 tokens
    service.step()
    service.evict(4)  # T's last 4 tokens, the least recently used leaf: host-only
    pool = hybrid_pool(service)
    match = service.match(T)
    assert (match.device_hit_tokens, match.host_hit_tokens) == (8, 4)
    loaded = service.load_back(match, 32)
    assert loaded.queued and loaded.num_tokens == 4
    assert loaded.restored_swa_tokens == 0, "the window lies in the host span"
    service.start_loading()
    service.step()
    assert service.tree.stats.restored_swa_tokens == 0
    window = Indices(loaded.device_indices.tensor, IndexSpace.DEVICE_FULL)
    want = torch.arange(8, 12, dtype=torch.float32)[None, None, :, None] + 1000.0
    assert torch.equal(swa_rows(pool, window),
                       want.expand(*pool.swa.data.shape[:2], -1, pool.swa.data.shape[-1]))
    service.check_integrity()


def one_token_pages() -> HiCacheService:
    """A service of pages of one token, a window of 3 (the tail: 3 tokens)."""
    model: dict[str, Any] = {"num_layers": 2, "attention": "mha", "num_kv_heads": 1,
                             "head_dim": 2, "dtype": "float32", "swa_layers": [1],
                             "window_tokens": 3}
    return build_service(config_from_dict({
        "page_size_tokens": 1, "model": model,
        "device_pool": {"num_tokens": 32, "swa_num_tokens": 16, "device": "cpu"},
        "host": {"ratio": 2.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 60.0},
    }))


def serve_window_3(service: HiCacheService, tokens: list[int]) -> None:
    """:func:`serve` for a window of 3 tokens in pages of one: all but the last 3 tokens
    leave the window before the insert; the step backs the rest up."""
    pool = hybrid_pool(service)
    slots = service.alloc_device(len(tokens))
    assert slots is not None
    swa = pool.swa_slots_of(slots).tensor
    pool.swa.data[:, :, swa] = torch.arange(len(tokens), dtype=torch.float32)[None, None, :,
                                                                               None] + 1000.0
    service.release_window(Indices(slots.tensor[:-3], IndexSpace.DEVICE_FULL))
    service.insert(tokens, slots)
    service.step()


@pytest.fixture
def split_at_4() -> Iterator[HiCacheService]:
    """Nodes ``[1..4]`` and ``[5, 6]`` (and a leaf ``[9, 9]``), every SWA row backed up and
    none left on the device."""
    svc = one_token_pages()
    try:
        serve_window_3(svc, [1, 2, 3, 4, 5, 6])
        serve_window_3(svc, [1, 2, 3, 4, 9, 9])
        yield svc
    finally:
        svc.stop()


def restored_rows_ok(service: HiCacheService, tokens: list[int], count: int) -> None:
    """Load with nothing more than the window to restore: ``count`` tokens, whose rows come
    back as written."""
    match = service.match(tokens)
    loaded = service.load_back(match, 32)
    assert loaded.queued and loaded.restored_swa_tokens == count
    service.start_loading()
    service.step()
    pool = hybrid_pool(service)
    full = service.tree.device_prefix(tokens)
    window = Indices(full.tensor[-3:], IndexSpace.DEVICE_FULL)
    want = torch.arange(len(tokens) - 3, len(tokens), dtype=torch.float32)[None, None, :, None]
    assert torch.equal(swa_rows(pool, window), (want + 1000.0).expand(
        *pool.swa.data.shape[:2], -1, pool.swa.data.shape[-1]))
    service.check_integrity()


def test_a_window_one_token_into_a_shallower_device_node_restores_that_token(
        split_at_4: HiCacheService) -> None:
    service = split_at_4
    assert service.evict_swa(10**6) > 0
    match = service.match([1, 2, 3, 4, 5, 6, 77])
    assert (match.device_hit_tokens, match.host_hit_tokens) == (6, 0)
    restored_rows_ok(service, [1, 2, 3, 4, 5, 6], count=3)  # [5, 6] and token 4


def test_a_host_span_one_token_short_of_the_window_restores_one(split_at_4: HiCacheService
                                                                ) -> None:
    service = split_at_4
    assert service.evict(2) == 2  # [5, 6], the least recently used leaf
    assert service.evict_swa(10**6) > 0
    match = service.match([1, 2, 3, 4, 5, 6])
    assert (match.device_hit_tokens, match.host_hit_tokens) == (4, 2)
    restored_rows_ok(service, [1, 2, 3, 4, 5, 6], count=1)


def squat_host_swa(service: HiCacheService) -> Indices:
    """Take every free SWA host slot (give them back with ``free``)."""
    controller = service.controller
    assert isinstance(controller, HybridCacheController)
    allocator = controller.host_swa.allocator
    squatter = allocator.try_alloc(allocator.num_free_tokens)
    assert squatter is not None and allocator.num_free_tokens == 0
    return squatter


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_window_rows_that_left_with_no_host_copy_make_the_prefix_not_reusable(policy: str
                                                                              ) -> None:
    """With the SWA host pool full (and nothing to evict there), the window backup of the
    released pages is refused (counted) and their SWA rows are gone: the node has no host
    copy yet (``write_back``) or one without those rows (``write_through``, backed up once
    the pool had room again). A prefix whose window lies in them is refused, not loaded."""
    service = build_service(make_config(policy=policy, hybrid=True))
    try:
        squatter = squat_host_swa(service)
        serve(service, T)  # releases the SWA rows of its first 8 tokens
        stats = service.tree.stats
        assert stats.refused_backups["host_swa_full"] == 8
        service.controller.host_swa.allocator.free(squatter)
        service.step()
        node = service.match(T).last_device_node
        if policy == "write_back":
            assert node.host is None and node.host_swa is None
        else:
            assert node.host is not None and node.host_swa is not None
            assert node.host_swa.tensor.ne(0).tolist() == [False] * 8 + [True] * 4
        match = service.match([*T[:8], 99, 98])
        assert match.device_hit_tokens == 8
        loaded = service.load_back(match, 32)
        assert loaded.refused is Refusal.SWA_TAIL_MISSING
        assert stats.restored_swa_tokens == 0
        service.check_integrity()
    finally:
        service.stop()


def test_recomputed_pages_give_a_host_only_node_the_swa_copies_it_lacked(
        service: HiCacheService) -> None:
    """A node backed up without the SWA rows of its first 8 tokens (their window backup was
    refused) and then evicted takes those copies when the engine recomputes it; it keeps
    its own copies of the others."""
    squatter = squat_host_swa(service)
    serve(service, T)
    service.controller.host_swa.allocator.free(squatter)
    service.step()
    service.evict(10**6)
    (node,) = service.tree.nodes()
    assert node.is_host_only and node.host_swa is not None
    own = node.host_swa.tensor.clone()
    assert own.ne(0).tolist() == [False] * 8 + [True] * 4
    serve(service, T)  # recomputed: the window backup of its first 8 tokens succeeds now
    service.step()
    assert node.on_device and bool(node.host_swa.tensor.ne(0).all())
    assert torch.equal(node.host_swa.tensor[8:], own[8:])
    assert service.controller.host_swa.allocator.num_used_tokens == len(T)
    service.check_integrity()
    # the copies taken restore the window of a prefix that ends in them
    service.evict_swa(10**6)
    match = service.match([*T[:8], 99, 98])
    loaded = service.load_back(match, 32)
    assert loaded.queued and loaded.restored_swa_tokens == 4
    service.start_loading()
    service.step()
    pool = hybrid_pool(service)
    window = Indices(match.device_indices.tensor[4:8], IndexSpace.DEVICE_FULL)
    want = torch.arange(4, 8, dtype=torch.float32)[None, None, :, None] + 1000.0
    assert torch.equal(swa_rows(pool, window),
                       want.expand(*pool.swa.data.shape[:2], -1, pool.swa.data.shape[-1]))
    service.check_integrity()


def two_backed_up_nodes(service: HiCacheService) -> tuple[TreeNode, TreeNode]:
    """``T`` and then ``U`` served and backed up, SWA rows of their last 4 tokens on the
    device and of all 12 on the host; (older, newer)."""
    older = list(T)
    newer = [t + 100 for t in T]
    for tokens in (older, newer):
        serve(service, tokens)
        service.step()
    return (service.match(older).last_device_node, service.match(newer).last_device_node)


def test_evict_swa_frees_nodes_until_it_has_enough_and_no_more(service: HiCacheService
                                                               ) -> None:
    older, newer = two_backed_up_nodes(service)
    swa_of = service.tree.io.swa_of
    assert service.evict_swa(4) == 4  # the older node's 4 rows are exactly enough
    assert not bool(swa_of(older.device).tensor.ne(0).any())
    assert int(swa_of(newer.device).tensor.ne(0).sum()) == 4, "the newer one keeps its rows"
    assert service.evict_swa(1) == 4  # a whole node's rows for one token
    assert not bool(swa_of(newer.device).tensor.ne(0).any())
    assert service.evict_swa(1) == 0  # nothing left with a host copy to fall back on
    service.check_integrity()


def test_host_swa_copies_leave_node_by_node_until_enough_are_free(service: HiCacheService
                                                                  ) -> None:
    older, newer = two_backed_up_nodes(service)
    assert older.host_swa is not None and newer.host_swa is not None
    assert evict_host_swa(service.tree, 12) == 12
    assert older.host_swa is not None and not bool(older.host_swa.tensor.ne(0).any())
    assert bool(newer.host_swa.tensor.ne(0).all()), "the newer node keeps its copies"
    # the older node's device SWA rows have no copy now: evict_swa passes it by
    swa_of = service.tree.io.swa_of
    assert service.evict_swa(1) == 4
    assert int(swa_of(older.device).tensor.ne(0).sum()) == 4
    assert not bool(swa_of(newer.device).tensor.ne(0).any())
    assert evict_host_swa(service.tree, 1) == 12
    assert not bool(newer.host_swa.tensor.ne(0).any())
    assert evict_host_swa(service.tree, 1) == 0
    assert older.host is not None and newer.host is not None, "full rows stay on the host"
    service.check_integrity()


def test_a_node_without_some_swa_copies_frees_only_those_it_has() -> None:
    service = build_service(make_config(hybrid=True))
    try:
        squatter = squat_host_swa(service)
        serve(service, T)  # the window backup of its first 8 tokens is refused
        service.controller.host_swa.allocator.free(squatter)
        service.step()  # backed up: SWA copies of its last 4 tokens only
        assert service.tree.stats.window_backup_tokens == 0
        assert evict_host_swa(service.tree, 1) == 4
        assert service.controller.host_swa.allocator.num_used_tokens == 0
        service.check_integrity()
    finally:
        service.stop()

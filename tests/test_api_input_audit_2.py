"""Audit of bad input, second part: refusals that no test reached before. Each one's
``raise`` was skipped without any test failing, or never ran in the suite (found by
disabling every ``raise`` of the API-edge modules in turn and running the tests that name
its message, then checking the coverage of those left). Each is called here with the bad
input it names, and the state it guards is checked unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from radix_helpers import GEOMETRY, HybridRig, Rig, ids
from test_api_input_audit import MODEL, _store_config, make_config
from test_service_refusals import put, refused

from hicache import HiCacheService, IndexSpace, Indices, PageTable, TokenKey, build_service
from hicache.config import EvictionPolicy, WritePolicy
from hicache.pools import HostKVPool, HostLayout
from hicache.radix import HiRadixCache
from hicache.radix.tree import RadixTree

FULL = IndexSpace.DEVICE_FULL
A = [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.fixture
def service() -> Iterator[HiCacheService]:
    built = build_service(make_config())
    put(built, [1, 1, 2, 2, 3, 3])
    yield built
    built.stop()


# ---- the device pool an engine writes through ----------------------------------------------


def test_page_slots_refuse_what_is_no_page_table(service: HiCacheService) -> None:
    pool = service.controller.device_pool
    refused(service, TypeError, r"^page_slots on pool 'full': expected a PageTable, got Tensor$",
            pool.page_slots, torch.tensor([[1]]), 0)


def test_page_slots_refuse_a_table_of_another_page_size(service: HiCacheService) -> None:
    pool = service.controller.device_pool
    table = PageTable(torch.tensor([[1]]), FULL, 4)
    refused(service, ValueError, r"^page_slots: a table of pages of 4 tokens, pool 'full' has "
            r"pages of 2$", pool.page_slots, table, 0)


def test_page_slots_refuse_a_table_on_another_device(service: HiCacheService) -> None:
    pool = service.controller.device_pool
    table = PageTable(torch.tensor([[1]], device="meta"), FULL, 2)
    refused(service, ValueError, r"^page_slots: the table is on meta, pool 'full' on cpu$",
            pool.page_slots, table, 0)


def test_set_kv_refuses_rows_that_are_no_tensor(service: HiCacheService) -> None:
    pool = service.controller.device_pool
    slots = service.alloc_device(2)
    assert slots is not None
    before = pool.data.clone()
    v = torch.ones(2, 1, 2)
    with pytest.raises(TypeError, match=r"^set_kv on pool 'full': k must be a torch.Tensor, "
                                        r"got list$"):
        pool.set_kv(0, slots, [[1.0, 2.0]] * 2, v)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^set_kv on pool 'full': v must be a torch.Tensor, "
                                        r"got tuple$"):
        pool.set_kv(0, slots, v, (1.0, 2.0))  # type: ignore[arg-type]
    assert torch.equal(pool.data, before)
    service.free_device(slots)
    service.check_integrity()


def test_set_kv_refuses_forward_slots_of_another_pool(service: HiCacheService) -> None:
    other = build_service(make_config())
    try:
        pool, foreign = service.controller.device_pool, other.controller.device_pool
        slots = other.alloc_device(2)
        assert slots is not None
        locs = foreign.forward_locs(slots)
        before = pool.data.clone()
        rows = torch.ones(2, 1, 2)
        with pytest.raises(ValueError, match=r"^set_kv\(layer=0\): these ForwardLocs were made "
                                             r"by another pool"):
            pool.set_kv(0, locs, rows, rows)
        assert torch.equal(pool.data, before)
        other.free_device(slots)
    finally:
        other.stop()
    service.check_integrity()


def test_a_page_first_direct_host_pool_has_no_layer_records() -> None:
    host = HostKVPool(name="full", space=IndexSpace.HOST_FULL, num_layers=2, num_pages=4,
                      page_size=2, geometry=GEOMETRY,
                      layout=HostLayout.PAGE_FIRST_DIRECT, pin=False)
    with pytest.raises(ValueError, match=r"^layer_records: host pool 'full' is "
                                         r"page_first_direct.*use read_layer_rows"):
        host.layer_records(0, 0)


# ---- keys and the tree ---------------------------------------------------------------------


def test_a_token_key_cannot_be_changed() -> None:
    key = TokenKey([1, 2, 3, 4, 5], 2)
    data = key.data
    for name, value in (("data", b""), ("num_tokens", 0), ("page_size", 1), ("other", 1)):
        with pytest.raises(AttributeError, match=rf"^TokenKey is read-only: make a new key "
                                                 rf"for other tokens \(tried to set {name}\)$"):
            setattr(key, name, value)
    assert key.data == data and key.num_tokens == 5 and key.page_size == 2
    assert key.tokens == (1, 2, 3, 4, 5)


@pytest.mark.parametrize("page_size", [0, -2])
def test_a_radix_tree_needs_pages_of_a_token_or_more(page_size: int) -> None:
    with pytest.raises(ValueError, match=rf"^page_size must be >= 1, got {page_size}$"):
        RadixTree(page_size)


def _tree(controller: object, **overrides: object) -> HiRadixCache:
    kwargs: dict[str, object] = {"write_policy": WritePolicy.WRITE_THROUGH,
                                 "eviction_policy": EvictionPolicy.LRU}
    kwargs.update(overrides)
    return HiRadixCache(controller, **kwargs)  # type: ignore[arg-type]


def test_a_tree_refuses_a_window_for_a_full_attention_model() -> None:
    with pytest.raises(ValueError, match=r"^window_tokens is for hybrid \(SWA\) models; "
                                         r"pass None$"):
        _tree(Rig().controller, window_tokens=4)


def test_a_hybrid_tree_needs_a_window_of_a_token_or_more() -> None:
    controller = HybridRig().controller
    with pytest.raises(ValueError, match=r"^a hybrid controller needs window_tokens"):
        _tree(controller)
    with pytest.raises(ValueError, match=r"^window_tokens must be >= 1 for a hybrid model, "
                                         r"got 0$"):
        _tree(controller, window_tokens=0)


def test_a_tree_refuses_what_is_no_controller() -> None:
    with pytest.raises(TypeError, match=r"^expected a CacheController or "
                                        r"HybridCacheController, got str$"):
        _tree("controller")


@pytest.mark.parametrize("hits", [0, -1])
def test_a_tree_needs_one_hit_or_more_before_a_selective_backup(hits: int) -> None:
    with pytest.raises(ValueError, match=rf"^write_through_hits must be >= 1, got {hits}$"):
        _tree(Rig().controller, write_through_hits=hits)


def test_insert_refuses_slots_of_another_space() -> None:
    rig = Rig()
    slots = rig.alloc(4)
    host = Indices(slots.tensor.clone(), IndexSpace.HOST_FULL)
    with pytest.raises(ValueError, match=r"^insert: device_indices must be DEVICE_FULL "
                                         r"hicache\.pools\.Indices$"):
        rig.tree.insert(A[:4], host)
    with pytest.raises(ValueError, match=r"^insert: device_indices must be DEVICE_FULL"):
        rig.tree.insert(A[:4], slots.tensor)  # type: ignore[arg-type]
    assert rig.tree.match_prefix(A).device_hit_tokens == 0
    rig.tree.check_integrity(engine_device=slots)
    rig.tree.insert(A[:4], slots)
    assert ids(rig.tree.match_prefix(A).device_indices) == slots.tensor.tolist()


# ---- the hybrid controller ---------------------------------------------------------------


def test_a_hybrid_load_refuses_a_negative_window_tail() -> None:
    rig = HybridRig()
    rig.put(A[:4])
    rig.tree.issue_queued_backups()
    rig.ack()
    node = rig.tree.match_prefix(A[:4]).last_device_node
    assert node.host is not None and node.host_swa is not None
    free = rig.controller.device_allocator.num_free_tokens
    with pytest.raises(ValueError, match=r"^load: swa_tail_tokens must be >= 0, got -1$"):
        rig.controller.load(node.host, node.host_swa, -1)
    assert rig.controller.device_allocator.num_free_tokens == free
    assert rig.controller.num_in_flight == 0
    rig.tree.check_integrity()


# ---- prefetches from the shared store ---------------------------------------------------------


def test_a_service_without_a_store_refuses_a_prefetch(service: HiCacheService,
                                                     tmp_path: Path) -> None:
    """A prefetch made by a service with a store, handed to one without: named, nothing
    changed on either side."""
    stored = build_service(_store_config(tmp_path / "store"), **MODEL)
    try:
        key = stored.key(list(range(40, 50)))
        prefetch = stored.prefetch(key, stored.match(key))
        assert prefetch is not None
        refused(service, ValueError, r"^finish_prefetch: this service has no store",
                service.finish_prefetch, prefetch)
        assert not prefetch.finished
        stored.finish_prefetch(prefetch)
    finally:
        stored.stop()

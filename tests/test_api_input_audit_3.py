"""Audit of bad input at the pools' and controller's edges, third round: each call refuses a
bad argument with an error naming it, before it changes anything (an allocator's free-run
index, a host pool's pages, the load queue), and the service's ``wait_prefetch`` refuses a
timeout that is not a number of seconds.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from controller_helpers import make_controller, make_hybrid
from gated_store import gated_service
from test_api_input_audit import MODEL, make_config

from hicache.controller import TorchBackend
from hicache.pools import IndexSpace, Indices, PageAllocator


@pytest.mark.parametrize("count", [4.0, True, "4"], ids=["float", "bool", "str"])
def test_try_alloc_refuses_a_count_that_is_not_an_int_and_keeps_the_allocator(
        count: object) -> None:
    """4.0 passes the page-multiple check; it used to change the free-run index before a
    slice refused it, leaving an allocator that failed its own integrity check."""
    allocator = PageAllocator(8, 2, IndexSpace.DEVICE_FULL, "full")
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        allocator.try_alloc(count)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        allocator.try_alloc_pages(count)  # type: ignore[arg-type]
    allocator.check_integrity()
    assert allocator.try_alloc(16) is not None  # the whole pool is still there


def test_a_numpy_integer_count_is_taken() -> None:
    allocator = PageAllocator(8, 2, IndexSpace.DEVICE_FULL, "full")
    got = allocator.try_alloc(torch.tensor(4).numpy()[()])  # a numpy int64 scalar
    assert got is not None and got.tensor.tolist() == [2, 3, 4, 5]
    allocator.check_integrity()


def test_the_hybrid_pool_refuses_a_float_count_and_keeps_its_allocators() -> None:
    pool = make_hybrid(TorchBackend()).hybrid_pool
    with pytest.raises(TypeError, match="num_tokens"):
        pool.try_alloc(4.0)  # type: ignore[arg-type]
    pool.check_integrity()


def test_a_negative_count_is_named_negative() -> None:
    """With 1-token pages -2 is a whole number of pages; the error said it was not."""
    allocator = PageAllocator(8, 1, IndexSpace.DEVICE_FULL, "full")
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -2"):
        allocator.try_alloc(-2)


def _backed_up_hybrid(num_tokens: int = 4):
    ctrl = make_hybrid(TorchBackend())
    full = ctrl.hybrid_pool.try_alloc(num_tokens)
    assert full is not None
    host = ctrl.write(full)
    assert host is not None
    ctrl.drain()
    return ctrl, full, host


def test_hybrid_evict_host_with_bad_swa_slots_frees_no_full_page() -> None:
    """Both parts are checked before either is freed (the full pages went first before)."""
    ctrl, _, host = _backed_up_hybrid()
    free_full = ctrl.host_pool.allocator.num_free_tokens
    free_swa = ctrl.host_swa.allocator.num_free_tokens
    with pytest.raises(ValueError, match="twice"):
        ctrl.evict_host(host.full, Indices(torch.tensor([2, 3, 2, 3]), IndexSpace.HOST_SWA))
    assert ctrl.host_pool.allocator.num_free_tokens == free_full
    assert ctrl.host_swa.allocator.num_free_tokens == free_swa
    ctrl.host_pool.allocator.check_integrity()


def test_hybrid_evict_host_of_freed_swa_slots_frees_no_full_page() -> None:
    ctrl, _, host = _backed_up_hybrid()
    ctrl.host_swa_evict(host.swa)
    free_full = ctrl.host_pool.allocator.num_free_tokens
    with pytest.raises(ValueError, match="not allocated"):
        ctrl.evict_host(host.full, host.swa)
    assert ctrl.host_pool.allocator.num_free_tokens == free_full
    ctrl.evict_host(host.full)  # still the tree's to free, once
    assert ctrl.host_pool.allocator.num_free_tokens == free_full + 4


def test_hybrid_evict_host_of_both_parts_frees_both() -> None:
    ctrl, _, host = _backed_up_hybrid()
    free_full = ctrl.host_pool.allocator.num_free_tokens
    free_swa = ctrl.host_swa.allocator.num_free_tokens
    ctrl.evict_host(host.full, host.swa)
    assert ctrl.host_pool.allocator.num_free_tokens == free_full + 4
    assert ctrl.host_swa.allocator.num_free_tokens > free_swa


@pytest.mark.parametrize("event_set", [-1, 3, True, "0", 1.0],
                         ids=["negative", "past-the-ring", "bool", "str", "float"])
def test_set_consumer_refuses_a_set_the_ring_lacks(event_set: object) -> None:
    """The ring has 3 sets: -1 aliased the last set, 3 failed at the next ``wait_until``."""
    ctrl = make_controller(TorchBackend())
    with pytest.raises((TypeError, ValueError), match="event_set"):
        ctrl.set_consumer(event_set)  # type: ignore[arg-type]
    assert ctrl.layer_events.consumer is None


def test_set_consumer_takes_each_set_and_none() -> None:
    ctrl = make_controller(TorchBackend())
    for event_set in (0, 2, None):
        ctrl.set_consumer(event_set)
        assert ctrl.layer_events.consumer == event_set


def test_move_indices_of_bare_tensors_is_a_type_error_naming_the_call() -> None:
    ctrl = make_controller(TorchBackend())
    slots = Indices(torch.tensor([2, 3]), IndexSpace.HOST_FULL)
    with pytest.raises(TypeError, match=r"move_indices: expected hicache\.pools\.Indices"):
        ctrl.move_indices(torch.tensor([2, 3]), torch.tensor([2, 3]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"move_indices: expected hicache\.pools\.Indices"):
        ctrl.move_indices(slots, torch.tensor([2, 3]))  # type: ignore[arg-type]


@pytest.mark.parametrize("tail", [math.nan, 2.5, True, 2.0, "2"],
                         ids=["nan", "fraction", "bool", "float", "str"])
def test_hybrid_load_refuses_a_tail_that_is_not_an_int(tail: object) -> None:
    """NaN meant "every token" (a load with SWA slots for all was queued), 2.5 was rounded
    up, True taken as 1, 2.0 failed in a slice naming nothing."""
    ctrl, full, host = _backed_up_hybrid(8)
    ctrl.evict_device(full)
    free = ctrl.device_allocator.num_free_tokens
    with pytest.raises(TypeError, match="swa_tail_tokens"):
        ctrl.load(host.full, host.swa, tail)  # type: ignore[arg-type]
    assert ctrl.device_allocator.num_free_tokens == free
    assert ctrl.num_in_flight == 0
    assert ctrl.load(host.full, host.swa, 2) is not None  # an int tail still loads


@pytest.mark.parametrize("timeout_s", ["1", math.nan, -1.0, 1e10, True],
                         ids=["str", "nan", "negative", "past-the-longest-wait", "bool"])
def test_wait_prefetch_refuses_a_timeout_that_is_not_seconds(
        timeout_s: object, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A string failed in an addition naming nothing; NaN was no timeout at all (the call
    blocked until the store answered)."""
    config = make_config(storage={"backend": "file", "path": str(tmp_path / "l3"),
                                  "prefetch_threshold_tokens": 0,
                                  "prefetch_policy": "wait_complete"})
    service, store = gated_service(monkeypatch, config, MODEL, gated=("exists",))
    opener = threading.Timer(5.0, store.gate.set)
    try:
        key = service.key(list(range(40, 50)))
        prefetch = service.prefetch(key, service.match(key))
        assert prefetch is not None and store.entered.wait(5.0)
        opener.start()
        with pytest.raises((TypeError, ValueError), match="wait_prefetch: timeout_s"):
            service.wait_prefetch(prefetch, timeout_s)  # type: ignore[arg-type]
        assert not store.gate.is_set()  # refused at once, not after the store answered
    finally:
        opener.cancel()
        store.gate.set()
        service.stop()

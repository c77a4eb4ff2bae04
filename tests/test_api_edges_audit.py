"""Page ids handed to the frees that take them (``free_pages``, ``evict_*(pages=...)``) and
the demo's options, at the edge of the API.

- Page ids were not range-checked: page 0 (the padding page, reserved) read as allocated and
  was freed, so the next allocation handed out slot 0, which every padded row writes and every
  ``set_kv`` clears (seeds 002/004's class); page -1 indexed the free map from its end and
  freed the pool's last page; an out-of-range page raised a bare ``IndexError``. A hybrid
  pool's ``free_pages([0, p])`` freed page p's SWA page before failing.
- ``DemoOptions`` checked only its counts: a policy given as text failed deep in the run,
  a seed of "x" in torch, and a flag of "no" (true) corrupted a host byte.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hicache import IndexSpace, build_service, config_from_dict, load_default_config
from hicache.engine import DemoOptions, run_demo
from hicache.pools import PageAllocator

FULL = IndexSpace.DEVICE_FULL


def _allocator_state(a: PageAllocator) -> tuple[int, bytes, tuple[bytes, ...]]:
    return a.num_free_tokens, a.free_map().tobytes(), tuple(x.tobytes() for x in a.free_runs())




@pytest.mark.parametrize("pages", [
    np.array([0]), np.array([0, 1]), np.array([-1]), np.array([5]), np.array([4, 5]),
    np.array([1, 3, 9]), np.array([2, -1])],
    ids=["padding-page", "padding-and-1", "negative", "past-the-end", "run-past-the-end",
         "gather-past-the-end", "gather-negative"])
def test_free_pages_refuses_page_ids_no_allocation_handed_out(pages: np.ndarray) -> None:
    """free_pages frees only allocated pages (its docstring); page 0 is reserved padding
    and -1 is no page. Both must be refused with ValueError, freeing nothing."""
    a = PageAllocator(4, 2, FULL, "full")
    a.try_alloc(8)  # every page allocated
    before = _allocator_state(a)
    with pytest.raises(ValueError, match=r"page -?\d+ is (the padding page|outside the pool)"):
        a.free_pages(pages)
    assert _allocator_state(a) == before
    a.check_integrity()
    assert a.first_unallocated_page(pages) is not None  # what check_allocated raises on
    with pytest.raises(ValueError, match=r"its pages are 1 \.\. 4"):
        a.check_allocated(pages)


def _service():
    """A 2-layer model, 32-token device pool in pages of 2 (as tests/test_api_input_audit)."""
    return build_service(config_from_dict({
        "page_size_tokens": 2,
        "model": {"num_layers": 2, "attention": "mha", "num_kv_heads": 1, "head_dim": 2,
                  "dtype": "float32"},
        "device_pool": {"num_tokens": 32, "device": "cpu"},
        "host": {"ratio": 2.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 60.0},
    }, check_ram=False))


def test_controller_evict_device_with_page_0_does_not_free_the_padding_page() -> None:
    """CacheController.evict_device(..., pages=) runs 'the allocation and in-flight checks
    always'; page 0 passes the allocation check and is freed, so the next allocation hands
    out slot 0 (the padding slot every padded row writes and every set_kv clears)."""
    service = _service()
    try:
        own = service.alloc_device(2)
        c = service.controller
        before = _allocator_state(c.device_allocator)
        with pytest.raises(ValueError):
            c.evict_device(own, pages=np.array([0]))
        assert _allocator_state(c.device_allocator) == before
        c.device_allocator.check_integrity()
    finally:
        service.stop()


def test_padding_page_freed_through_free_pages_is_handed_out_again() -> None:
    """What the missing check leads to: slot 0 handed out as a live slot."""
    a = PageAllocator(1, 2, FULL, "full")
    a.try_alloc(2)
    try:
        a.free_pages(np.array([0]))
    except ValueError:
        return  # fixed
    got = a.try_alloc(2)
    assert got is None or 0 not in got.tensor.tolist(), "the padding slot was handed out"




@pytest.mark.parametrize("field, value", [("write_policy", "write_back"), ("seed", "x"),
                                          ("corrupt_host_byte", "no")])
def test_demo_options_refuse_bad_values_by_name(field: str, value: object) -> None:
    """DemoOptions checks its counts by name; other fields of the wrong type fail later
    with AttributeError ('str' object has no attribute 'value'), torch's RuntimeError
    (manual_seed expected a long), or silently corrupt a host byte ('no' is truthy)."""
    config = load_default_config()
    config = dataclasses.replace(config, service=dataclasses.replace(
        config.service, metrics_enabled=False))
    with pytest.raises((TypeError, ValueError), match=field):
        options = DemoOptions(quick=True, conversations=1, turns=1, **{field: value})
        run_demo(config, options)


def test_hybrid_free_pages_with_page_0_changes_nothing() -> None:
    """HybridSWAPool.free_pages checks 'every page allocated before anything is freed';
    page 0 passes, so a [0, p] call frees page p's SWA page (and, unfixed, page 0)."""
    from hicache.pools import HybridSWAPool, RowGeometry
    from hicache.pools.base import AttentionKind
    pool = HybridSWAPool(num_layers=2, swa_layers=[1], full_pages=4, swa_pages=4, page_size=2,
                         geometry=RowGeometry(AttentionKind.MHA, 1, 2, 0, torch.float32),
                         device="cpu")
    full = pool.try_alloc(2)
    page = int(full.tensor[0]) // 2
    before = (_allocator_state(pool.full_allocator), _allocator_state(pool.swa_allocator),
              pool.map_version)
    with pytest.raises(ValueError):
        pool.free_pages(np.array([0, page]))
    assert (_allocator_state(pool.full_allocator), _allocator_state(pool.swa_allocator),
            pool.map_version) == before
    pool.check_integrity()


def test_forward_locs_takes_the_same_keyword_on_both_pool_kinds() -> None:
    """``forward_locs(locs=...)`` on a plain pool, ``out_cache_loc=`` on a hybrid one: a
    keyword call broke on one of them."""
    import inspect

    from hicache.pools import DeviceKVPool, HybridSWAPool
    names = {list(inspect.signature(cls.forward_locs).parameters)[1]
             for cls in (DeviceKVPool, HybridSWAPool)}
    assert names == {"out_cache_loc"}

"""Controller calls that would corrupt bookkeeping are refused with every count unchanged;
in-flight counts balance across merged ops; reading a layer before its load started raises."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from controller_helpers import make_controller, make_hybrid

from hicache.config import config_from_dict
from hicache.controller import (
    CacheController,
    Event,
    HybridCacheController,
    KernelBackend,
    TorchBackend,
    make_backend,
)
from hicache.factory import build_service
from hicache.pools import IndexSpace, Indices, PageAllocator

CPU = torch.device("cpu")
PAGE = 2


def full(*slots: int) -> Indices:
    return Indices(torch.tensor(slots, dtype=torch.int64), IndexSpace.DEVICE_FULL)


def host(*slots: int) -> Indices:
    return Indices(torch.tensor(slots, dtype=torch.int64), IndexSpace.HOST_FULL)


def allocators(ctrl: CacheController) -> list[PageAllocator]:
    found = [ctrl.device_allocator, ctrl.host_pool.allocator]
    if isinstance(ctrl, HybridCacheController):
        found += [ctrl.hybrid_pool.swa_allocator, ctrl.host_swa.allocator]
    return found


def state(ctrl: CacheController) -> tuple[list[int], int, list[list[int]]]:
    """Free tokens of every pool, ops not yet acknowledged, busy slots of every space."""
    pools = allocators(ctrl)
    return ([a.num_free_tokens for a in pools], ctrl.num_in_flight,
            [ctrl.busy_slots(a.space).tolist() for a in pools])


def assert_sound(ctrl: CacheController) -> None:
    """After drain(): every allocator consistent and no slot left in flight."""
    ctrl.drain()
    for allocator in allocators(ctrl):
        allocator.check_integrity()
        assert ctrl.busy_slots(allocator.space).size == 0, allocator.space
    if isinstance(ctrl, HybridCacheController):
        ctrl.hybrid_pool.check_integrity()


def plain() -> CacheController:
    """Pages of 2; device slots 0..161, host slots 0..321."""
    return make_controller(TorchBackend(), page_size=PAGE)


def backed_up(ctrl: CacheController, num_tokens: int = 4) -> tuple[Indices, Indices]:
    """Device slots written to the host and acknowledged: (device, host)."""
    device = ctrl.device_allocator.try_alloc(num_tokens)
    assert device is not None
    written = ctrl.write(device)
    assert isinstance(written, Indices)
    ctrl.drain()
    return device, written


@pytest.fixture
def pending_events(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Issued ops stay in flight until the test restores ``Event.query``."""
    monkeypatch.setattr(Event, "query", lambda self: False)
    yield


# ---- in-flight counts balance -------------------------------------------------------------


def test_merged_loads_of_one_host_page_release_it_on_ack() -> None:
    """Two queued loads of the same host page merge into one op whose ack frees the page."""
    ctrl = plain()
    _, host_slots = backed_up(ctrl)
    first, second = ctrl.load(host_slots, tag="a"), ctrl.load(host_slots, tag="b")
    assert first is not None and second is not None
    ctrl.start_loading()
    assert [a.tags for a in ctrl.poll()] == [["a", "b"]]
    assert not ctrl.is_in_flight(host_slots)
    assert ctrl.busy_slots(IndexSpace.HOST_FULL).size == 0
    ctrl.evict_host(host_slots)
    assert_sound(ctrl)


def test_merged_writes_release_every_slot_on_ack() -> None:
    """Writes merged into one op give back every device and host slot on its ack."""
    ctrl = plain()
    devices = [ctrl.device_allocator.try_alloc(4) for _ in range(3)]
    hosts = [ctrl.write(d) for d in devices if d is not None]
    ctrl.start_writing()
    assert len(ctrl.poll()) == 1
    assert ctrl.busy_slots(IndexSpace.DEVICE_FULL).size == 0
    assert ctrl.busy_slots(IndexSpace.HOST_FULL).size == 0
    assert len(hosts) == 3
    assert_sound(ctrl)


def test_caller_changing_its_indices_after_a_call_changes_nothing() -> None:
    """The controller keeps its own copies of a call's slots: a caller that refills the
    index tensor it passed (or the host slots it got back) between ``write`` and
    ``start_writing`` neither redirects the copy nor unbalances the in-flight counts."""
    ctrl = plain()
    device = ctrl.device_allocator.try_alloc(4)
    other = ctrl.device_allocator.try_alloc(4)
    assert device is not None and other is not None
    expected = ctrl.device_pool.data[:, :, device.tensor].clone()
    host_slots = ctrl.write(device)
    assert host_slots is not None
    kept_host = host_slots.tensor.clone()
    device.tensor.copy_(other.tensor)  # the engine reuses its buffer
    host_slots.tensor.fill_(0)
    assert ctrl.is_in_flight(Indices(kept_host, IndexSpace.HOST_FULL))
    assert not ctrl.is_in_flight(other)
    ctrl.start_writing()
    assert len(ctrl.poll()) == 1
    assert ctrl.busy_slots(IndexSpace.DEVICE_FULL).size == 0
    assert ctrl.busy_slots(IndexSpace.HOST_FULL).size == 0
    for layer in range(ctrl.device_pool.num_layers):
        for component in range(expected.shape[0]):
            assert torch.equal(ctrl.host_pool.layer_rows(component, layer)[kept_host],
                               expected[component, layer])
    assert_sound(ctrl)


def test_hybrid_merged_loads_of_one_host_page_release_it_on_ack() -> None:
    """The hybrid controller's two loads of one backup balance the full and SWA counts."""
    ctrl = make_hybrid(TorchBackend())
    device = ctrl.hybrid_pool.try_alloc(4)
    assert device is not None
    slots = ctrl.write(device)
    assert slots is not None
    ctrl.drain()
    assert ctrl.load(slots.full, slots.swa, 4) is not None
    assert ctrl.load(slots.full, slots.swa, 4) is not None
    ctrl.start_loading()
    assert len(ctrl.poll()) == 1
    assert not ctrl.is_in_flight(slots.full) and not ctrl.is_in_flight(slots.swa)
    assert_sound(ctrl)


# ---- write / load conflicts with ops in flight --------------------------------------------


def test_second_write_of_queued_slots_is_refused() -> None:
    """A page whose backup is queued cannot be backed up again."""
    ctrl = plain()
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None and ctrl.write(device) is not None
    before = state(ctrl)
    with pytest.raises(ValueError, match=r"^write: DEVICE_FULL slot 2 of pool 'full' is already "
                       r"being backed up by a queued or in-flight write; back a page up once"):
        ctrl.write(device)
    assert state(ctrl) == before
    assert_sound(ctrl)
    ctrl.evict_device(device)  # balanced: the page is evictable after the one ack


def test_second_write_of_in_flight_slots_is_refused(pending_events: None) -> None:
    """A page whose backup is issued but not acknowledged cannot be backed up again, even
    beside a page that is not in flight; the error names the first busy slot."""
    ctrl = plain()
    assert ctrl.device_allocator.try_alloc(6) is not None  # slots 2..7
    assert ctrl.write(full(2, 3, 4, 5)) is not None
    ctrl.start_writing()
    before = state(ctrl)
    with pytest.raises(ValueError, match="slot 2 of pool 'full' is already being backed up"):
        ctrl.write(full(6, 7, 2, 3))
    assert state(ctrl) == before


def test_write_of_slots_a_load_fills_is_refused() -> None:
    """Device pages a queued load is filling cannot be backed up before its ack."""
    ctrl = plain()
    device, host_slots = backed_up(ctrl)
    ctrl.evict_device(device)
    loaded = ctrl.load(host_slots)
    assert loaded is not None
    before = state(ctrl)
    first = int(loaded.tensor[0])
    with pytest.raises(ValueError, match=rf"^write: DEVICE_FULL slot {first} of pool 'full' is "
                       r"still being filled by a queued or in-flight load; back it up after "
                       r"poll\(\) acknowledged that load"):
        ctrl.write(loaded)
    assert state(ctrl) == before
    assert_sound(ctrl)


def test_load_of_host_slots_a_write_fills_is_refused() -> None:
    """Host pages a queued write is filling cannot be loaded before its ack; after it, they can."""
    ctrl = plain()
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    host_slots = ctrl.write(device)
    assert host_slots is not None
    before = state(ctrl)
    first = int(host_slots.tensor[0])
    with pytest.raises(ValueError, match=rf"^load: HOST_FULL slot {first} of pool 'full' is "
                       r"still being filled by a queued or in-flight write; load it after "
                       r"poll\(\) acknowledged that write"):
        ctrl.load(host_slots)
    assert state(ctrl) == before
    ctrl.drain()
    assert ctrl.load(host_slots) is not None
    assert_sound(ctrl)


def test_hybrid_load_of_host_slots_a_write_fills_is_refused() -> None:
    """The hybrid controller refuses the same load, with nothing allocated."""
    ctrl = make_hybrid(TorchBackend())
    device = ctrl.hybrid_pool.try_alloc(4)
    assert device is not None
    slots = ctrl.write(device)
    assert slots is not None
    before = state(ctrl)
    with pytest.raises(ValueError, match="load: HOST_FULL slot 2 of pool 'full' is still being "
                       "filled by a queued or in-flight write"):
        ctrl.load(slots.full, slots.swa, 4)
    assert state(ctrl) == before
    assert_sound(ctrl)


def test_hybrid_second_write_is_refused() -> None:
    """The hybrid controller refuses a second backup of a queued page."""
    ctrl = make_hybrid(TorchBackend())
    device = ctrl.hybrid_pool.try_alloc(4)
    assert device is not None and ctrl.write(device) is not None
    before = state(ctrl)
    with pytest.raises(ValueError, match="write: DEVICE_FULL slot 2 of pool 'full' is already "
                       "being backed up"):
        ctrl.write(device)
    assert state(ctrl) == before
    assert_sound(ctrl)


# ---- slots the caller does not own ---------------------------------------------------------


def test_write_of_never_allocated_slots_is_refused() -> None:
    """Device pages nobody allocated cannot be backed up (they would leak host pages)."""
    ctrl = plain()
    assert ctrl.device_allocator.try_alloc(2) is not None  # slots 2, 3
    before = state(ctrl)
    with pytest.raises(ValueError, match=r"^write: DEVICE_FULL slot 4 of pool 'full' is not "
                       r"allocated \(never allocated, or already freed\); back up only device "
                       r"slots that are allocated and hold rows$"):
        ctrl.write(full(2, 3, 4, 5))
    assert state(ctrl) == before


def test_write_of_freed_slots_is_refused() -> None:
    """Device pages already freed cannot be backed up."""
    ctrl = plain()
    device = ctrl.device_allocator.try_alloc(4)
    assert device is not None
    ctrl.device_allocator.free(device)
    before = state(ctrl)
    with pytest.raises(ValueError, match="write: DEVICE_FULL slot 2 of pool 'full' is not "
                       "allocated"):
        ctrl.write(device)
    assert state(ctrl) == before


def test_load_of_never_allocated_host_slots_is_refused() -> None:
    """Host pages no write returned cannot be loaded (they would leak device pages)."""
    ctrl = plain()
    before = state(ctrl)
    with pytest.raises(ValueError, match=r"^load: HOST_FULL slot 8 of pool 'full' is not "
                       r"allocated \(never allocated, or already freed\); load only host slots "
                       r"that write\(\) returned and were not evicted$"):
        ctrl.load(host(8, 9))
    assert state(ctrl) == before


def test_load_of_evicted_host_slots_is_refused() -> None:
    """Host pages evicted after their write cannot be loaded."""
    ctrl = plain()
    _, host_slots = backed_up(ctrl)
    ctrl.evict_host(host_slots)
    before = state(ctrl)
    first = int(host_slots.tensor[0])
    with pytest.raises(ValueError, match=f"load: HOST_FULL slot {first} of pool 'full' is not "
                       "allocated"):
        ctrl.load(host_slots)
    assert state(ctrl) == before
    assert_sound(ctrl)


def test_hybrid_write_of_unallocated_slots_is_refused() -> None:
    """The hybrid controller refuses device pages nobody allocated."""
    ctrl = make_hybrid(TorchBackend())
    before = state(ctrl)
    with pytest.raises(ValueError, match="write: DEVICE_FULL slot 6 of pool 'full' is not "
                       "allocated"):
        ctrl.write(full(6, 7))
    assert state(ctrl) == before


def test_hybrid_load_of_freed_swa_host_slots_is_refused() -> None:
    """A window tail whose SWA host pages were freed is refused before anything is allocated."""
    ctrl = make_hybrid(TorchBackend())
    device = ctrl.hybrid_pool.try_alloc(4)
    assert device is not None
    slots = ctrl.write(device)
    assert slots is not None
    ctrl.drain()
    ctrl.host_swa.allocator.free(slots.swa)
    before = state(ctrl)
    first = int(slots.swa.tensor[0])
    with pytest.raises(ValueError, match=f"load: HOST_SWA slot {first} of pool 'swa' is not "
                       "allocated"):
        ctrl.load(slots.full, slots.swa, 4)
    assert state(ctrl) == before


# ---- malformed slots are refused before anything is allocated -----------------------------


@pytest.mark.parametrize("slots,message", [
    ((-2, -1), r"slot -2 is (negative|out of range) for pool 'full' \(valid slots are 0\.\.161\)"),
    ((162, 163), r"slot 163 is out of range for pool 'full' \(valid slots are 0\.\.161\)"),
    ((2, 3, 2, 3), "the same page appears twice"),
    ((0, 1), "page 0 of pool 'full' is reserved for padding"),
    ((3, 4), "slots must come in whole, ordered pages of 2"),
    ((2,), "1 slots is not a whole number of pages of 2"),
])
def test_write_refuses_malformed_slots(slots: tuple[int, ...], message: str) -> None:
    """Negative, out-of-range, repeated, padding and partial pages: nothing allocated."""
    ctrl = plain()
    assert ctrl.device_allocator.try_alloc(4) is not None  # slots 2..5 are allocated
    before = state(ctrl)
    with pytest.raises(ValueError, match=f"^write: {message}"):
        ctrl.write(full(*slots))
    assert state(ctrl) == before


@pytest.mark.parametrize("slots,message", [
    ((-2, -1), r"slot -2 is (negative|out of range) for pool 'full' \(valid slots are 0\.\.321\)"),
    ((322, 323), r"slot 323 is out of range for pool 'full' \(valid slots are 0\.\.321\)"),
    ((2, 3, 2, 3), "the same page appears twice"),
    ((0, 1), "page 0 of pool 'full' is reserved for padding"),
])
def test_load_refuses_malformed_slots(slots: tuple[int, ...], message: str) -> None:
    """The same validation for host slots, before a device page is allocated."""
    ctrl = plain()
    backed_up(ctrl)  # host slots 2..5 are allocated
    before = state(ctrl)
    with pytest.raises(ValueError, match=f"^load: {message}"):
        ctrl.load(host(*slots))
    assert state(ctrl) == before


def test_hybrid_load_refuses_negative_slot() -> None:
    """The hybrid controller refuses a negative host slot with nothing allocated."""
    ctrl = make_hybrid(TorchBackend())
    before = state(ctrl)
    swa = Indices(torch.tensor([2, 3]), IndexSpace.HOST_SWA)
    with pytest.raises(ValueError, match=r"slot -2 is (negative|out of range) for pool 'full'"):
        ctrl.load(host(-2, -1), swa, 2)
    assert state(ctrl) == before


# ---- is_in_flight and eviction validate their indices -------------------------------------


def test_is_in_flight_refuses_a_space_without_pool() -> None:
    """A plain controller has no SWA pool: the error names the space and the spaces it has."""
    ctrl = plain()
    swa = Indices(torch.tensor([2, 3]), IndexSpace.DEVICE_SWA)
    with pytest.raises(ValueError, match=r"^is_in_flight: this controller has no pool in index "
                       r"space DEVICE_SWA; it has DEVICE_FULL, HOST_FULL$"):
        ctrl.is_in_flight(swa)


@pytest.mark.parametrize("slot,what", [(-1, "negative"), (162, "out of range")])
def test_is_in_flight_refuses_slots_out_of_range(slot: int, what: str) -> None:
    """A negative slot would wrap around in numpy; one past the end would index nothing."""
    ctrl = plain()
    with pytest.raises(ValueError, match=rf"^is_in_flight: slot {slot} is {what} for pool "
                       r"'full' \(valid slots are 0\.\.161\)"):
        ctrl.is_in_flight(full(2, slot))


def test_is_in_flight_refuses_a_bare_tensor() -> None:
    """A tensor without a space is a TypeError."""
    ctrl = plain()
    with pytest.raises(TypeError, match=r"is_in_flight: expected hicache\.pools\.Indices"):
        ctrl.is_in_flight(torch.tensor([2, 3]))  # type: ignore[arg-type]


def test_evict_device_refuses_negative_slot() -> None:
    """Eviction validates slots before reading the in-flight counts."""
    ctrl = plain()
    before = state(ctrl)
    with pytest.raises(ValueError, match="evict_device: slot -2 is negative for pool 'full'"):
        ctrl.evict_device(full(-2, -1))
    assert state(ctrl) == before


# ---- backends that cannot serve the pools' device -----------------------------------------


def test_make_backend_refuses_staged_for_cpu_pools() -> None:
    """'staged' needs CUDA pools; the error names the device and the fix."""
    with pytest.raises(ValueError, match=r"^io_backend 'staged' cannot serve pools on device "
                       r"cpu: .*choose io_backend: torch or auto for CPU pools$"):
        make_backend("staged", CPU)


def test_make_backend_refuses_kernel_for_cpu_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    """'kernel' on CPU pools outside the Triton interpreter is refused at once."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"^io_backend 'kernel' cannot serve pools on device "
                       r"cpu: .*choose io_backend: torch or auto for CPU pools$"):
        make_backend("kernel", CPU)


def test_make_backend_accepts_kernel_in_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TRITON_INTERPRET=1 (the tests' setting) 'kernel' serves CPU pools."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert make_backend("kernel", CPU).name == "kernel"


def test_controller_refuses_a_backend_for_another_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A controller built with a backend that cannot serve its pools raises at construction."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="io_backend 'kernel' cannot serve pools on device cpu"):
        make_controller(KernelBackend())


# ---- reading a layer before its load was started ------------------------------------------


def queued_load(ctrl: CacheController) -> Indices:
    """A load of a backed-up page, queued and not started."""
    device, host_slots = backed_up(ctrl)
    ctrl.evict_device(device)
    loaded = ctrl.load(host_slots)
    assert loaded is not None
    return loaded


def test_wait_until_refuses_queued_loads() -> None:
    """wait_until raises while a load is queued, and waits normally once it started."""
    ctrl = plain()
    queued_load(ctrl)
    with pytest.raises(RuntimeError, match=r"^layer 1 is read while 1 queued load\(s\) have not "
                       r"been started; call start_loading\(\) \(service.start_loading\(\)\) "
                       r"before the forward that reads them$"):
        ctrl.wait_until(1)
    ctrl.start_loading()
    ctrl.wait_until(1)
    assert_sound(ctrl)


def test_pool_accessor_refuses_queued_loads() -> None:
    """key_buffer through the registered layer waiter raises instead of returning stale rows."""
    ctrl = plain()
    ctrl.device_pool.register_layer_waiter(ctrl.wait_until)
    queued_load(ctrl)
    with pytest.raises(RuntimeError, match="layer 0 is read while 1 queued load"):
        ctrl.device_pool.key_buffer(0)
    ctrl.start_loading()
    assert ctrl.device_pool.key_buffer(0).shape == (ctrl.device_pool.num_slots, 2, 4)


def service_config() -> dict[str, Any]:
    """A 2-layer model, 32 device tokens in pages of 2, host twice as large, no metrics."""
    return {
        "page_size_tokens": PAGE,
        "model": {"num_layers": 2, "attention": "mha", "num_kv_heads": 1, "head_dim": 2,
                  "dtype": "float32"},
        "device_pool": {"num_tokens": 32, "device": "cpu"},
        "host": {"ratio": 2.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 1.0},
    }


def test_service_read_before_start_loading_raises() -> None:
    """After load_back, reading a layer before service.start_loading() raises."""
    service = build_service(config_from_dict(service_config()))
    try:
        tokens = [5, 6, 7, 8]
        slots = service.alloc_device(len(tokens))
        assert slots is not None
        service.insert(tokens, slots)
        service.step()  # applies the write-through ack
        assert service.evict(10**6) == 4
        match = service.match(tokens)
        assert match.host_hit_tokens == 4
        assert service.load_back(match, 16).queued
        with pytest.raises(RuntimeError, match="layer 1 is read while 1 queued load"):
            service.device_pool.value_buffer(1)
        with pytest.raises(RuntimeError, match="call start_loading"):
            service.wait_until(0)
        service.start_loading()
        service.wait_until(0)
        service.device_pool.value_buffer(1)
        service.step()
        service.check_integrity()
    finally:
        service.stop()


# ---- the allocator method the checks use --------------------------------------------------


def test_first_unallocated_names_the_first_free_page() -> None:
    """first_unallocated returns the first slot of the first free page, or None."""
    allocator = PageAllocator(8, PAGE, IndexSpace.DEVICE_FULL, "full")
    taken = allocator.try_alloc(4)
    assert taken is not None and taken.tensor.tolist() == [2, 3, 4, 5]
    assert allocator.first_unallocated(full(4, 5, 2, 3), op="t") is None
    assert allocator.first_unallocated(full(4, 5, 8, 9, 6, 7), op="t") == 8
    assert allocator.first_unallocated(full(), op="t") is None
    assert np.array_equal(allocator.used_pages(), [1, 2])


def test_given_page_ids_skip_only_the_form_check_of_a_tree_caller() -> None:
    """``write``/``evict_*`` with ``pages`` (the radix tree's path for its own slots) still
    refuse a page that is free or in flight, with every count unchanged."""
    ctrl = make_controller(TorchBackend(), page_size=PAGE)
    device = ctrl.device_allocator.try_alloc(2 * PAGE)
    assert device is not None
    pages = device.tensor.numpy()[::PAGE] // PAGE
    slots = ctrl.write(device, pages=pages)
    assert slots is not None
    before = state(ctrl)
    with pytest.raises(ValueError, match="is already being backed up"):
        ctrl.write(device, pages=pages)
    with pytest.raises(ValueError, match="belongs to a transfer in flight"):
        ctrl.evict_device(device, pages=pages)
    with pytest.raises(ValueError, match="belongs to a transfer in flight"):
        ctrl.evict_host(slots, pages=slots.tensor.numpy()[::PAGE] // PAGE)
    assert state(ctrl) == before
    ctrl.start_writing()
    ctrl.drain()
    ctrl.evict_device(device, pages=pages)
    after = state(ctrl)
    for call in (lambda: ctrl.evict_device(device, pages=pages),
                 lambda: ctrl.write(device, pages=pages)):
        with pytest.raises(ValueError, match="not allocated"):
            call()
        assert state(ctrl) == after
    assert_sound(ctrl)

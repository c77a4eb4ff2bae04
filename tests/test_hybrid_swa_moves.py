"""SWA-only backups (``write_swa``) and SWA restores in a load (``load(..., restore=)``): the
SWA rows of a page leave the device while its full rows stay, and come back for the part of a
window that lies in a device-resident prefix."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import SENTINEL, device_rows, host_rows, make_hybrid

from hicache.controller import HybridSlots, TorchBackend
from hicache.pools import IndexSpace, Indices


def test_write_swa_backs_up_only_mapped_swa_rows_then_restore_brings_them_back() -> None:
    ctrl = make_hybrid(TorchBackend())
    pool = ctrl.hybrid_pool
    pool.try_alloc(4)  # offset slot ids so spaces cannot be confused
    full = pool.try_alloc(8)
    assert full is not None
    pool.free_swa(Indices(full.tensor[:2], IndexSpace.DEVICE_FULL))  # one page without SWA
    swa_before = pool.swa_slots_of(full).tensor
    swa_rows = device_rows(pool.swa)[swa_before[2:]]
    host_swa = ctrl.write_swa(full, tag="swa")
    assert host_swa is not None and host_swa.space is IndexSpace.HOST_SWA
    assert host_swa.tensor.tolist()[:2] == [0, 0] and bool((host_swa.tensor[2:] != 0).all())
    ctrl.start_writing()
    acks = ctrl.poll()
    assert [a.tokens_by_pool for a in acks] == [{"full": 0, "swa": 6}]
    assert torch.equal(host_rows(ctrl.host_swa)[host_swa.tensor[2:]], swa_rows)
    pool.free_swa(full)  # the SWA rows leave the device; the full rows stay
    pool.swa.data.fill_(SENTINEL)
    back = ctrl.load(
        Indices(torch.empty(0, dtype=torch.int64), IndexSpace.HOST_FULL),
        Indices(torch.empty(0, dtype=torch.int64), IndexSpace.HOST_SWA), swa_tail_tokens=0,
        tag="restore",
        restore=HybridSlots(Indices(full.tensor[2:], IndexSpace.DEVICE_FULL),
                            Indices(host_swa.tensor[2:], IndexSpace.HOST_SWA)))
    assert back is not None and len(back.full) == 0
    ctrl.start_loading()
    assert [a.tokens_by_pool for a in ctrl.poll()] == [{"full": 0, "swa": 6}]
    mapped = pool.swa_slots_of(full).tensor
    assert mapped.tolist()[:2] == [0, 0] and bool((mapped[2:] != 0).all())
    assert torch.equal(device_rows(pool.swa)[mapped[2:]], swa_rows)
    pool.check_integrity()


def test_load_with_restore_fills_span_and_prefix_window_in_one_op() -> None:
    ctrl = make_hybrid(TorchBackend())
    pool = ctrl.hybrid_pool
    prefix = pool.try_alloc(4)
    span = pool.try_alloc(4)
    assert prefix is not None and span is not None
    prefix_swa = ctrl.write_swa(prefix)
    host = ctrl.write(span)
    assert prefix_swa is not None and host is not None
    ctrl.drain()
    want_prefix = device_rows(pool.swa)[pool.swa_slots_of(prefix).tensor]
    pool.free_swa(prefix)
    ctrl.evict_device(span)
    back = ctrl.load(host.full, host.swa, swa_tail_tokens=4,
                     restore=HybridSlots(prefix, prefix_swa))
    assert back is not None
    ctrl.start_loading()
    acks = ctrl.poll()
    assert [a.tokens_by_pool for a in acks] == [{"full": 4, "swa": 8}]
    restored = pool.swa_slots_of(prefix).tensor
    assert torch.equal(device_rows(pool.swa)[restored], want_prefix)
    pool.check_integrity()


def test_restore_refusals_leave_nothing_allocated() -> None:
    ctrl = make_hybrid(TorchBackend())
    pool = ctrl.hybrid_pool
    prefix = pool.try_alloc(4)
    assert prefix is not None
    prefix_swa = ctrl.write_swa(prefix)
    assert prefix_swa is not None
    ctrl.drain()
    empty_full = Indices(torch.empty(0, dtype=torch.int64), IndexSpace.HOST_FULL)
    empty_swa = Indices(torch.empty(0, dtype=torch.int64), IndexSpace.HOST_SWA)
    free = (pool.full_allocator.num_free_tokens, pool.swa_allocator.num_free_tokens)
    with pytest.raises(ValueError, match="already has an SWA slot"):
        ctrl.load(empty_full, empty_swa, 0, restore=HybridSlots(prefix, prefix_swa))
    pool.free_swa(prefix)
    with pytest.raises(ValueError, match="no SWA host slot"):
        ctrl.load(empty_full, empty_swa, 0, restore=HybridSlots(
            prefix, Indices(torch.zeros(4, dtype=torch.int64), IndexSpace.HOST_SWA)))
    with pytest.raises(ValueError, match="aligned"):
        ctrl.load(empty_full, empty_swa, 0, restore=HybridSlots(
            prefix, Indices(prefix_swa.tensor[:2], IndexSpace.HOST_SWA)))
    assert (pool.full_allocator.num_free_tokens,
            pool.swa_allocator.num_free_tokens) == (free[0], free[1] + 4)
    assert ctrl.num_in_flight == 0


def test_write_swa_refuses_unallocated_and_in_flight_pages() -> None:
    ctrl = make_hybrid(TorchBackend())
    full = ctrl.hybrid_pool.try_alloc(4)
    assert full is not None
    assert ctrl.write_swa(full) is not None
    with pytest.raises(ValueError, match="already being backed up"):
        ctrl.write_swa(full)
    ctrl.drain()
    ctrl.hybrid_pool.free(full)
    with pytest.raises(ValueError, match="not allocated"):
        ctrl.write_swa(full)


def test_write_with_a_bad_swa_skip_is_refused_before_allocating() -> None:
    ctrl = make_hybrid(TorchBackend())
    full = ctrl.hybrid_pool.try_alloc(4)
    assert full is not None
    used = (ctrl.host_pool.allocator.num_used_tokens, ctrl.host_swa.allocator.num_used_tokens)
    with pytest.raises(ValueError, match="swa_skip must be a bool tensor of shape"):
        ctrl.write(full, swa_skip=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="swa_skip must be a bool tensor"):
        ctrl.write(full, swa_skip=torch.zeros(4, dtype=torch.int64))
    page = ctrl.host_swa.page_size
    if page > 1:  # a skip that splits an SWA page: refused before host_full is allocated
        split = torch.zeros(4, dtype=torch.bool)
        split[0] = True
        with pytest.raises(ValueError, match=r"skips part of the SWA page of tokens 0\.\.1"):
            ctrl.write(full, swa_skip=split)
    assert (ctrl.host_pool.allocator.num_used_tokens,
            ctrl.host_swa.allocator.num_used_tokens) == used
    assert ctrl.num_in_flight == 0


def test_write_skips_swa_rows_that_already_have_a_host_copy() -> None:
    ctrl = make_hybrid(TorchBackend())
    full = ctrl.hybrid_pool.try_alloc(4)
    assert full is not None
    skip = torch.tensor([True, True, False, False])
    host = ctrl.write(full, swa_skip=skip)
    assert host is not None
    assert host.swa.tensor.tolist()[:2] == [0, 0] and bool((host.swa.tensor[2:] != 0).all())
    ctrl.start_writing()
    assert [a.tokens_by_pool for a in ctrl.poll()] == [{"full": 4, "swa": 2}]


def test_observer_sees_every_queued_call_until_removed() -> None:
    ctrl = make_hybrid(TorchBackend())
    seen: list[tuple[str, dict[str, int], object]] = []

    def observe(direction: object, transfers: object, tag: object) -> None:
        assert isinstance(transfers, list)
        seen.append((getattr(direction, "value", ""),
                     {t.name: t.num_tokens for t in transfers}, tag))

    ctrl.add_observer(observe)
    full = ctrl.hybrid_pool.try_alloc(4)
    assert full is not None
    assert ctrl.write_swa(full, tag="swa") is not None
    ctrl.drain()
    assert seen == [("device_to_host", {"full": 0, "swa": 4}, "swa")]
    ctrl.remove_observer(observe)
    ctrl.hybrid_pool.free_swa(full)
    assert ctrl.write(full, tag="after") is not None
    assert len(seen) == 1
    with pytest.raises(ValueError):
        ctrl.remove_observer(observe)


def test_an_observer_that_fails_a_window_backup_leaves_nothing_allocated() -> None:
    """The observer's exception reaches the caller of ``write_swa``; the SWA host pages it
    allocated are free again, nothing is queued, and the next call goes through."""
    ctrl = make_hybrid(TorchBackend())
    full = ctrl.hybrid_pool.try_alloc(4)
    assert full is not None

    def refuse(direction: object, transfers: object, tag: object) -> None:
        raise RuntimeError("observer refused")

    ctrl.add_observer(refuse)
    with pytest.raises(RuntimeError, match="observer refused"):
        ctrl.write_swa(full, tag="swa")
    assert ctrl.host_swa.allocator.num_used_tokens == 0
    assert ctrl.host_pool.allocator.num_used_tokens == 0
    assert not ctrl.has_queued_writes and ctrl.num_in_flight == 0
    ctrl.remove_observer(refuse)
    assert ctrl.write_swa(full, tag="swa") is not None
    assert ctrl.host_swa.allocator.num_used_tokens == 4


def test_write_swa_of_pages_out_of_order_keeps_each_tokens_host_slot() -> None:
    """Pages given out of order, one of them without SWA rows: each token's host slot holds
    that token's SWA rows (the copy is planned page by page); a full SWA host pool refuses
    the next one with nothing allocated or queued."""
    ctrl = make_hybrid(TorchBackend(), host_pages=4)
    pool = ctrl.hybrid_pool
    pool.try_alloc(4)  # offset slot ids so spaces cannot be confused
    full = pool.try_alloc(8)
    assert full is not None
    pool.free_swa(Indices(full.tensor[2:4], IndexSpace.DEVICE_FULL))  # page 2 of 4: no SWA
    order = Indices(full.tensor.view(4, 2)[[3, 1, 0, 2]].reshape(-1), IndexSpace.DEVICE_FULL)
    swa = pool.swa_slots_of(order).tensor
    host_swa = ctrl.write_swa(order, tag="swa")
    assert host_swa is not None
    assert ((host_swa.tensor == 0) == (swa == 0)).all() and int((swa == 0).sum()) == 2
    ctrl.start_writing()
    assert [a.tokens_by_pool for a in ctrl.poll()] == [{"full": 0, "swa": 6}]
    mapped = swa != 0
    assert torch.equal(host_rows(ctrl.host_swa)[host_swa.tensor[mapped]],
                       device_rows(pool.swa)[swa[mapped]])
    used = ctrl.host_swa.allocator.num_used_tokens  # 6 of 8: one page left
    assert ctrl.write_swa(full) is None
    assert ctrl.host_swa.allocator.num_used_tokens == used and not ctrl.has_queued_writes


def test_an_observer_sees_the_bytes_each_pool_transfer_moves() -> None:
    """``size_bytes`` of every transfer an observer gets is what the op's acknowledgement
    reports for that pool: tokens times every component of the pool's moved layers."""
    ctrl = make_hybrid(TorchBackend())
    sizes: dict[str, int] = {}

    def observe(direction: object, transfers: object, tag: object) -> None:
        assert isinstance(transfers, list)
        sizes.update({t.name: t.size_bytes for t in transfers})

    ctrl.add_observer(observe)
    full = ctrl.hybrid_pool.try_alloc(4)
    assert full is not None
    assert ctrl.write(full) is not None
    ctrl.start_writing()
    (ack,) = ctrl.poll()
    assert sizes == ack.bytes_by_pool
    pool = ctrl.hybrid_pool
    assert sizes["full"] == 4 * pool.full.geometry.token_bytes(pool.full.num_layers) > 0
    assert sizes["swa"] == 4 * pool.swa.geometry.token_bytes(pool.swa.num_layers) > 0

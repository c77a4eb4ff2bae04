"""HybridCacheController on a CPU: full + SWA rows in one op, window tails and rollback."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import SENTINEL, device_rows, host_rows, make_hybrid, untouched

from hicache.controller import Direction, HybridCacheController, HybridSlots, TorchBackend
from hicache.controller.load_groups import local_groups
from hicache.pools import IndexSpace, Indices


def alloc_sequence(ctrl: HybridCacheController, num_tokens: int, window_tokens: int) -> Indices:
    """Full + SWA slots for a sequence whose tokens before the window lost their SWA slots."""
    full = ctrl.hybrid_pool.try_alloc(num_tokens)
    assert full is not None
    left = num_tokens - window_tokens
    if left > 0:
        ctrl.hybrid_pool.free_swa(Indices(full.tensor[:left], IndexSpace.DEVICE_FULL))
    return full


def backed_up_and_evicted(ctrl: HybridCacheController, num_tokens: int, window_tokens: int
                          ) -> HybridSlots:
    """:func:`alloc_sequence`, written to the host and evicted from the device: the host
    copies."""
    full = alloc_sequence(ctrl, num_tokens, window_tokens)
    host = ctrl.write(full)
    assert host is not None
    ctrl.drain()
    ctrl.evict_device(full)
    return host


def test_write_evict_load_restores_full_and_swa_rows() -> None:
    """Write, evict, load back: every full row and every SWA row of the tail, bit for bit."""
    ctrl = make_hybrid(TorchBackend())
    ctrl.hybrid_pool.try_alloc(4)  # offset slot ids so spaces cannot be confused
    full = alloc_sequence(ctrl, 10, window_tokens=4)
    swa_before = ctrl.hybrid_pool.swa_slots_of(full).tensor
    full_rows = device_rows(ctrl.hybrid_pool.full)[full.tensor]
    swa_rows = device_rows(ctrl.hybrid_pool.swa)
    host = ctrl.write(full, tag="node")
    assert host is not None
    assert host.swa.tensor.tolist()[:6] == [0] * 6 and (host.swa.tensor[6:] != 0).all()
    ctrl.start_writing()
    assert [a.tokens_by_pool for a in ctrl.poll()] == [{"full": 10, "swa": 4}]
    ctrl.evict_device(full)
    ctrl.hybrid_pool.full.data.fill_(SENTINEL)
    ctrl.hybrid_pool.swa.data.fill_(SENTINEL)
    back = ctrl.load(host.full, host.swa, swa_tail_tokens=4, tag="load")
    assert back is not None
    ctrl.start_loading()
    assert len(ctrl.poll()) == 1
    after_full = device_rows(ctrl.hybrid_pool.full)
    assert torch.equal(after_full[back.full.tensor], full_rows)
    tail = back.swa.tensor != 0
    assert tail.tolist() == [False] * 6 + [True] * 4
    after_swa = device_rows(ctrl.hybrid_pool.swa)
    assert torch.equal(after_swa[back.swa.tensor[tail]], swa_rows[swa_before[tail]])
    assert (untouched(after_swa, back.swa.tensor[tail]) == SENTINEL).all()
    ctrl.hybrid_pool.check_integrity()


def test_load_tail_rounds_up_to_pages_and_updates_map() -> None:
    """A 3-token tail with 2-token pages gets two pages of SWA slots, mapped from full."""
    ctrl = make_hybrid(TorchBackend())
    host = backed_up_and_evicted(ctrl, 8, window_tokens=8)
    back = ctrl.load(host.full, host.swa, swa_tail_tokens=3)
    assert back is not None
    assert (back.swa.tensor != 0).tolist() == [False] * 4 + [True] * 4
    mapped = ctrl.hybrid_pool.swa_slots_of(back.full)
    assert torch.equal(mapped.tensor, back.swa.tensor)
    ctrl.drain()
    ctrl.hybrid_pool.check_integrity()


def test_load_rolls_back_when_swa_pool_is_full() -> None:
    """SWA device pool exhausted: load returns None and the full allocation is undone."""
    ctrl = make_hybrid(TorchBackend(), swa_pages=3)
    host = backed_up_and_evicted(ctrl, 6, window_tokens=6)
    hog = ctrl.hybrid_pool.try_alloc(4)  # leaves one free SWA page
    assert hog is not None
    free_full = ctrl.device_allocator.num_free_tokens
    free_swa = ctrl.hybrid_pool.swa_allocator.num_free_tokens
    assert ctrl.load(host.full, host.swa, swa_tail_tokens=6) is None
    assert ctrl.device_allocator.num_free_tokens == free_full
    assert ctrl.hybrid_pool.swa_allocator.num_free_tokens == free_swa
    assert ctrl.num_in_flight == 0
    ctrl.hybrid_pool.check_integrity()


def test_write_rolls_back_when_swa_host_is_full() -> None:
    """SWA host pool exhausted: write returns None and frees the full host slots it took."""
    ctrl = make_hybrid(TorchBackend(), host_pages=3)
    full = alloc_sequence(ctrl, 4, window_tokens=4)
    assert ctrl.host_swa.allocator.try_alloc(4) is not None  # 1 free SWA host page left
    assert ctrl.write(full) is None
    assert ctrl.host_pool.allocator.num_used_tokens == 0
    assert ctrl.num_in_flight == 0


def test_load_refuses_tail_without_swa_backup() -> None:
    """A window tail whose SWA rows were never backed up cannot be restored."""
    ctrl = make_hybrid(TorchBackend())
    full = alloc_sequence(ctrl, 6, window_tokens=2)
    host = ctrl.write(full)
    assert host is not None
    ctrl.drain()
    with pytest.raises(ValueError, match="no SWA host slot"):
        ctrl.load(host.full, host.swa, swa_tail_tokens=4)


def test_load_rejects_misaligned_swa_slots() -> None:
    """host_swa must be aligned with host_full."""
    ctrl = make_hybrid(TorchBackend())
    host_full = Indices(torch.tensor([2, 3]), IndexSpace.HOST_FULL)
    with pytest.raises(ValueError, match="aligned"):
        ctrl.load(host_full, Indices(torch.tensor([2]), IndexSpace.HOST_SWA), 2)


def test_move_hybrid_indices_covers_every_pool() -> None:
    """Every pool transfer of an op gets moved indices, in the op's own order."""
    ctrl = make_hybrid(TorchBackend())
    full = alloc_sequence(ctrl, 4, window_tokens=2)
    assert ctrl.write(full) is not None
    op = ctrl._ops.merge(Direction.DEVICE_TO_HOST, ctrl.backend)
    assert op is not None
    moved = ctrl.move_hybrid_indices(op)
    assert [m.source.name for m in moved] == ["full", "swa"]
    assert [m.host_index.numel() for m in moved] == [4, 2]
    assert all(m.device_index.dtype == torch.int64 for m in moved)


def test_per_layer_load_routes_layers_to_their_pools() -> None:
    """Model layers 0 and 2 load from the full pools, 1 and 3 from the SWA pools."""
    ctrl = make_hybrid(TorchBackend())
    host = backed_up_and_evicted(ctrl, 2, window_tokens=2)
    assert ctrl.load(host.full, host.swa, 2) is not None
    op = ctrl._ops.merge(Direction.HOST_TO_DEVICE, ctrl.backend)
    assert op is not None
    per_layer = tuple(range(layer, layer + 1) for layer in range(4))
    layers = [local_groups(m.source.layers, per_layer) for m in op.moved]
    assert layers == [((0,), (), (1,), ()), ((), (0,), (), (1,))]
    assert ctrl.num_layers == 4


def test_evict_host_frees_both_pools() -> None:
    """evict_host frees the full and the non-zero SWA host slots."""
    ctrl = make_hybrid(TorchBackend())
    full = alloc_sequence(ctrl, 6, window_tokens=2)
    host = ctrl.write(full)
    assert host is not None
    ctrl.drain()
    ctrl.evict_host(host.full, host.swa)
    assert ctrl.host_pool.allocator.num_used_tokens == 0
    assert ctrl.host_swa.allocator.num_used_tokens == 0
    rows = host_rows(ctrl.host_swa)
    assert rows.shape[1:] == (2, 2, 8)


def test_evict_host_refuses_slots_a_load_still_reads() -> None:
    """Host slots (full, then SWA alone) that a queued load reads are refused by ``evict_host``
    (and ``host_swa_evict``),
    naming the first busy slot of the pool, both allocators unchanged; once the load is
    acknowledged, they go."""
    ctrl = make_hybrid(TorchBackend())
    host = backed_up_and_evicted(ctrl, 6, window_tokens=6)
    assert ctrl.load(host.full, host.swa, swa_tail_tokens=6) is not None
    used = (ctrl.host_pool.allocator.num_used_tokens, ctrl.host_swa.allocator.num_used_tokens)
    first_full, first_swa = int(host.full.tensor[0]), int(host.swa.tensor[0])
    with pytest.raises(ValueError, match=rf"evict_host: slot {first_full} of pool 'full' "
                                         r"belongs to a transfer in flight"):
        ctrl.evict_host(host.full, host.swa)
    later = Indices(host.swa.tensor[2:], IndexSpace.HOST_SWA)
    with pytest.raises(ValueError, match=rf"host_swa_evict: slot {int(later.tensor[0])} of "
                                         r"pool 'swa' belongs to a transfer in flight"):
        ctrl.host_swa_evict(later)  # SWA copies alone (evict_host takes them aligned)
    assert (ctrl.host_pool.allocator.num_used_tokens,
            ctrl.host_swa.allocator.num_used_tokens) == used
    assert first_swa != 0
    ctrl.start_loading()
    ctrl.poll()
    ctrl.evict_host(host.full, host.swa)
    assert ctrl.host_pool.allocator.num_used_tokens == 0
    assert ctrl.host_swa.allocator.num_used_tokens == 0


def test_evict_device_refuses_pages_whose_swa_rows_are_being_copied() -> None:
    """A page whose SWA rows a window backup still reads is refused by ``evict_device``,
    with or without the tree's page ids (its form then unchecked), every count and the map
    unchanged; once the copy is acknowledged, both pages go."""
    ctrl = make_hybrid(TorchBackend())
    pool = ctrl.hybrid_pool
    ctrl.hybrid_pool.try_alloc(4)  # offset the ids so full and SWA slots differ
    full = alloc_sequence(ctrl, 6, window_tokens=4)  # pages 3, 4, 5: SWA slots 8..11 on 4, 5
    assert ctrl.write_swa(full, "window") is not None
    pages = full.tensor.numpy()[::2] // 2

    def state() -> tuple[int, int, list[int]]:
        return (ctrl.device_allocator.num_free_tokens, pool.swa_allocator.num_free_tokens,
                pool.swa_slots_of(full).tensor.tolist())

    before = state()
    for call in (lambda: ctrl.evict_device(full), lambda: ctrl.evict_device(full, pages=pages)):
        with pytest.raises(ValueError, match=r"slot 8 of pool 'swa' belongs to a transfer in "
                                             r"flight"):
            call()
        assert state() == before
    ctrl.start_writing()
    ctrl.poll()
    ctrl.evict_device(full, pages=pages)
    assert state() == (before[0] + 6, before[1] + 4, [0] * 6)
    pool.check_integrity()


def test_evict_device_refuses_the_first_swa_page_while_it_is_copied() -> None:
    """The first pages of a fresh pool (full and SWA page 1, slots 2, 3): a window backup
    of them still reads SWA page 1, so ``evict_device`` refuses it, naming SWA slot 2."""
    ctrl = make_hybrid(TorchBackend())
    full = alloc_sequence(ctrl, 2, window_tokens=2)
    assert ctrl.hybrid_pool.swa_slots_of(full).tensor.tolist() == [2, 3]
    assert ctrl.write_swa(full, "window") is not None
    with pytest.raises(ValueError, match=r"slot 2 of pool 'swa' belongs to a transfer in "
                                         r"flight"):
        ctrl.evict_device(full)
    ctrl.start_writing()
    ctrl.poll()
    ctrl.evict_device(full)
    ctrl.hybrid_pool.check_integrity()


@pytest.mark.parametrize("tail", [0, 4, 10], ids=["no-tail", "part", "all"])
def test_load_keeps_its_own_slots_when_the_caller_changes_its_tensors(tail: int) -> None:
    """The caller overwrites the host slots it passed (full and SWA) and the device slots it
    got back before the op runs: the op still moves the rows it was given, into the slots it
    returned, and the pages held in flight are the ones it allocated."""
    ctrl = make_hybrid(TorchBackend())
    full = alloc_sequence(ctrl, 10, window_tokens=10)
    full_rows = device_rows(ctrl.hybrid_pool.full)[full.tensor]
    swa_rows = device_rows(ctrl.hybrid_pool.swa)[ctrl.hybrid_pool.swa_slots_of(full).tensor]
    host = ctrl.write(full)
    assert host is not None
    ctrl.drain()
    ctrl.evict_device(full)
    host_full, host_swa = host.full.tensor.clone(), host.swa.tensor.clone()
    back = ctrl.load(Indices(host_full, IndexSpace.HOST_FULL),
                     Indices(host_swa, IndexSpace.HOST_SWA), swa_tail_tokens=tail)
    assert back is not None
    returned_full, returned_swa = back.full.tensor.clone(), back.swa.tensor.clone()
    with pytest.raises(ValueError, match="in flight"):
        ctrl.evict_device(Indices(returned_full, IndexSpace.DEVICE_FULL))
    host_full.fill_(host_full[0].item())  # all the first page's slot: wrong rows if read
    host_swa.zero_()
    back.full.tensor.fill_(returned_full[0].item())
    back.swa.tensor.zero_()
    ctrl.start_loading()
    assert len(ctrl.poll()) == 1
    assert torch.equal(device_rows(ctrl.hybrid_pool.full)[returned_full], full_rows)
    start = 10 - tail
    assert (returned_swa[:start] == 0).all() and (returned_swa[start:] != 0).all()
    assert torch.equal(device_rows(ctrl.hybrid_pool.swa)[returned_swa[start:]],
                       swa_rows[start:])
    ctrl.evict_device(Indices(returned_full, IndexSpace.DEVICE_FULL))  # no longer in flight
    ctrl.hybrid_pool.check_integrity()


def test_host_runs_of_each_pool_are_counted_from_its_own_host_pages() -> None:
    """A hybrid write's host-run figures read each pool's host pages: the SWA rows of two
    device pages apart land in one run of fresh host pages, counted as one run."""
    ctrl = make_hybrid(TorchBackend())  # pages of 2 slots
    pool = ctrl.hybrid_pool
    assert pool.try_alloc(4) is not None
    first, gap, last = pool.try_alloc(4), pool.try_alloc(4), pool.try_alloc(4)
    assert first is not None and gap is not None and last is not None
    pool.free_swa(gap)  # the SWA pages of ``first`` and ``last`` are apart
    full = Indices(torch.cat([first.tensor, last.tensor]), IndexSpace.DEVICE_FULL)
    device_swa_pages = pool.swa_slots_of(full).tensor[::2] // 2
    assert (device_swa_pages.diff() != 1).any()
    host = ctrl.write(full)
    assert host is not None
    assert (host.swa.tensor[::2] // 2).diff().eq(1).all()
    ctrl.drain()
    stats = ctrl.stats
    for name in ("full", "swa"):
        key = ("device_to_host", name)
        assert (stats.host_runs[key], stats.host_run_tokens[key]) == (1, 8)

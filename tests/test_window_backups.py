"""Window backups (``release_window`` under ``host.swa_history: all``) wait in the
controller's queue and go with the step's write: one op for every request that released
window pages in a step, and for the step's node backups. Their device SWA slots stay until
that op is acknowledged; ``alloc_device`` short of SWA slots issues them first, and a quiet
scheduler's background thread issues them too. :class:`WindowBackups`, the table of those
copies by device page, is checked against a plain dictionary model."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_service import make_config, needs_cuda
from test_step_backups import wait_for
from test_step_backups_hybrid import hybrid_pool, submitted, write_swa
from test_swa_history import serve

from hicache.controller import Direction
from hicache.factory import build_service
from hicache.pools import IndexSpace, Indices
from hicache.radix.window_backups import WindowBackupOp, WindowBackups
from hicache.service import HiCacheService

FULL = IndexSpace.DEVICE_FULL


@pytest.fixture
def service() -> HiCacheService:
    svc = build_service(make_config(hybrid=True))  # 32 device tokens (16 SWA), pages of 2
    yield svc
    svc.stop()


def first(slots: Indices, num_tokens: int) -> Indices:
    return Indices(slots.tensor[:num_tokens], FULL)


def two_requests(service: HiCacheService) -> tuple[Indices, Indices]:
    """Two running requests of 8 tokens with distinct SWA rows: the SWA pool is full."""
    a, b = service.alloc_device(8), service.alloc_device(8)
    assert a is not None and b is not None
    write_swa(service, a, 30)
    write_swa(service, b, 40)
    assert hybrid_pool(service).swa_allocator.num_free_tokens == 0
    return a, b


def host_swa_values(service: HiCacheService, host_swa: Indices) -> torch.Tensor:
    """The first SWA layer's K rows at ``host_swa`` (one value per token)."""
    controller = service.controller
    rows = controller.host_swa.read_layer_rows(0, 0, host_swa.tensor)
    return rows[:, 0]


def test_a_steps_window_backups_are_one_write_with_its_node_backups(
        service: HiCacheService) -> None:
    a, b = two_requests(service)
    service.release_window(first(a, 4))
    service.release_window(first(b, 4))
    assert submitted(service) == 0  # queued, not issued
    assert hybrid_pool(service).swa_allocator.num_free_tokens == 0  # held until the ack
    service.step()
    assert submitted(service) == 1  # both requests' copies in one op
    assert hybrid_pool(service).swa_allocator.num_free_tokens == 8
    service.insert([*range(1, 9)], a)
    service.insert([*range(11, 19)], b)
    service.step()
    assert submitted(service) == 2  # the two nodes' backups: one more op
    for tokens, base in (([*range(1, 9)], 30), ([*range(11, 19)], 40)):
        node = service.match(tokens).last_device_node
        assert node.is_backed_up and node.host_swa is not None
        assert bool((node.host_swa.tensor != 0).all())
        want = torch.arange(8, dtype=torch.float32) + 1000.0 * base
        assert torch.equal(host_swa_values(service, node.host_swa), want)
    service.check_integrity()


def test_release_then_insert_in_one_step_waits_for_the_copy(service: HiCacheService) -> None:
    """The engine's last step of a request: its window pages released, then its insert
    before any step. The insert issues the queued copy and takes it complete."""
    a, b = two_requests(service)
    service.release_window(first(a, 4))
    service.release_window(first(b, 4))
    service.insert([*range(1, 9)], a)  # issues both queued copies, as one op
    assert submitted(service) == 1
    node = service.match([*range(1, 9)]).last_device_node
    assert node.host_swa is not None and bool((node.host_swa.tensor[:4] != 0).all())
    want = torch.arange(4, dtype=torch.float32) + 1000.0 * 30
    assert torch.equal(host_swa_values(service, first(node.host_swa, 4)), want)
    service.free_device(b)  # drops b's window copy
    service.step()
    assert len(service.tree.window_backups) == 0
    service.check_integrity()


def test_alloc_short_of_swa_slots_issues_the_queued_window_backups(
        service: HiCacheService) -> None:
    a, b = two_requests(service)
    service.release_window(first(a, 4))
    slots = service.alloc_device(4)  # the SWA pool is full until a's copy is acknowledged
    assert slots is not None
    stats = service.tree.stats
    assert stats.evicted_swa_tokens == 0 and stats.evicted_device_tokens == 0
    assert submitted(service) == 1
    for held in (a, b, slots):
        service.free_device(held)
    service.check_integrity()


def test_the_thread_issues_window_backups_when_no_step_comes() -> None:
    service = build_service(make_config(hybrid=True, interval_s=0.01))
    service.start()
    try:
        a = service.alloc_device(8)
        assert a is not None
        write_swa(service, a, 30)
        service.release_window(first(a, 4))
        wait_for(lambda: submitted(service) == 1 and not service.controller.num_in_flight)
        service.step()  # applies the ack: the SWA slots are free
        assert hybrid_pool(service).swa_allocator.num_free_tokens == 12
        service.free_device(a)
        service.check_integrity()
    finally:
        service.stop()


def fill_host_swa(service: HiCacheService) -> Indices:
    """Take every free SWA host slot (a squatter the test frees at its end)."""
    allocator = service.controller.host_swa.allocator
    squatter = allocator.try_alloc(allocator.num_free_tokens)
    assert squatter is not None and allocator.num_free_tokens == 0
    return squatter


def test_a_window_backup_short_of_swa_host_room_evicts_a_host_only_leaf_first(
        service: HiCacheService) -> None:
    old = list(range(1, 13))
    serve(service, old)
    service.step()
    assert service.evict(12) == 12  # host-only now: full and SWA host copies
    squatter = fill_host_swa(service)
    a = service.alloc_device(8)
    assert a is not None
    write_swa(service, a, 30)
    service.release_window(first(a, 4))  # needs 4 SWA host tokens
    stats = service.tree.stats
    assert stats.evicted_host_tokens == 12 and stats.evicted_host_swa_tokens == 0
    assert stats.refused_backups.get("host_swa_full", 0) == 0
    service.step()
    assert service.match([*old, 99]).host_hit_tokens == 0
    service.controller.host_swa.allocator.free(squatter)
    service.free_device(a)
    service.check_integrity()


def test_a_second_release_of_the_same_pages_evicts_nothing(service: HiCacheService) -> None:
    """Pages whose SWA slots are already given back need no SWA host room: a full SWA host
    pool evicts nothing for them, and nothing is queued or counted."""
    old = list(range(1, 13))
    serve(service, old)
    service.step()
    assert service.evict(12) == 12
    a = service.alloc_device(8)
    assert a is not None
    write_swa(service, a, 30)
    stats = service.tree.stats
    backed = stats.window_backup_tokens
    service.release_window(first(a, 4))
    service.step()
    assert stats.window_backup_tokens == backed + 4
    queued = len(service.tree.window_backups)
    squatter = fill_host_swa(service)
    service.release_window(first(a, 4))
    assert stats.evicted_host_tokens == 0 and stats.evicted_host_swa_tokens == 0
    assert len(service.tree.window_backups) == queued, "nothing to copy: nothing queued"
    assert stats.window_backup_tokens == backed + 4
    assert service.match([*old, 99]).host_hit_tokens == 12
    service.controller.host_swa.allocator.free(squatter)
    service.release_window(first(a, 8))  # copies the 4 tokens not given back before
    assert stats.window_backup_tokens == backed + 8
    service.free_device(a)
    service.check_integrity()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["torch", "staged"])
def test_a_window_backup_issued_at_the_step_reads_the_releasing_streams_rows(
        backend: str) -> None:
    """SWA rows written on a side stream that first sleeps on the GPU, their pages
    released there; the step issues the copy with the default stream current: the host gets
    the rows that stream wrote (the release's mark orders the copy after them)."""
    service = build_service(make_config(hybrid=True, device="cuda", io_backend=backend))
    try:
        pool = hybrid_pool(service)
        slots = service.alloc_device(8)
        assert slots is not None
        device = pool.swa.data.device
        swa_index = pool.swa_slots_of(slots).tensor.to(device)
        values = torch.arange(8, dtype=torch.float32, device=device) + 7000.0
        torch.cuda.synchronize()
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)  # about 0.1 s: the rows land long after the step
            pool.swa.data[:, :, swa_index] = values[None, None, :, None]
            service.release_window(first(slots, 4))
        assert submitted(service) == 0
        service.step()  # issues the copy with the default stream current
        torch.cuda.synchronize()
        service.step()  # its ack frees the SWA slots
        assert pool.swa_allocator.num_free_tokens == 12
        service.insert([*range(1, 9)], slots)
        node = service.match([*range(1, 9)]).last_device_node
        assert node.host_swa is not None
        assert torch.equal(host_swa_values(service, first(node.host_swa, 4)),
                           values[:4].cpu())
        service.check_integrity()
    finally:
        service.stop()


def _op(pages: list[int], page_size: int) -> WindowBackupOp:
    slots = torch.tensor([p * page_size + i for p in pages for i in range(page_size)],
                         dtype=torch.int64)
    return WindowBackupOp(Direction.DEVICE_TO_HOST, [], [], device=Indices(slots, FULL))


@pytest.mark.parametrize("seed", range(6))
def test_window_backups_agree_with_a_dictionary_model(seed: int) -> None:
    """Random adds (some pages without a copy, some added again), acknowledgements, takes
    and in-flight questions, on pages up to 200 (the arrays grow): every answer equals a
    per-page dictionary's."""
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4])
    table = WindowBackups(page_size)
    model: dict[int, tuple[list[int], WindowBackupOp | None]] = {}
    ops: list[WindowBackupOp] = []
    next_slot = 1
    for _ in range(300):
        action = rng.random()
        pages = rng.sample(range(200 if rng.random() < 0.2 else 40), rng.randint(1, 6))
        if action < 0.35:
            op = _op(pages, page_size)
            host = []
            for page in pages:
                copied = rng.random() < 0.8
                row = list(range(next_slot, next_slot + page_size)) if copied else [0] * page_size
                next_slot += page_size
                host += row
                if copied:
                    model[page] = (row, op)
            table.add(op.device, Indices(torch.tensor(host, dtype=torch.int64),
                                         IndexSpace.HOST_SWA), op)
            ops.append(op)
        elif action < 0.55 and ops:
            op = ops.pop(rng.randrange(len(ops)))
            table.finish(op)
            for page, (row, writer) in list(model.items()):
                if writer is op:
                    model[page] = (row, None)
        elif action < 0.75:
            device = _op(pages, page_size).device
            assert table.in_flight(device) == any(
                model.get(p, (None, None))[1] is not None for p in pages)
        else:
            device = _op(pages, page_size).device
            if any(model.get(p, (None, None))[1] is not None for p in pages):
                continue  # take() is for acknowledged copies only
            got = table.take(device)
            rows = [model.pop(p, (None, None))[0] for p in pages]
            if all(row is None for row in rows):
                assert got is None
            else:
                assert got is not None and got.space is IndexSpace.HOST_SWA
                want = [s for row in rows for s in (row if row is not None else
                                                    [0] * page_size)]
                assert got.tensor.tolist() == want
        assert len(table) == len(model)
        held = sorted(np.asarray(table.host_slots().tensor).tolist())
        assert held == sorted(s for row, _ in model.values() for s in row)


def test_take_of_a_copy_in_flight_is_refused() -> None:
    table = WindowBackups(2)
    op = _op([3], 2)
    table.add(op.device, Indices(torch.tensor([5, 6]), IndexSpace.HOST_SWA), op)
    with pytest.raises(RuntimeError, match="in flight"):
        table.take(op.device)
    assert len(table) == 1 and table.in_flight(op.device)


def test_the_engine_reusing_its_released_slots_changes_nothing(service: HiCacheService) -> None:
    """The engine writes into the tensor it gave ``release_window`` right after the call
    (its own buffer): the queued window backup owns a copy, so its ack releases the SWA
    slots of the pages released, and no others."""
    a, b = two_requests(service)
    released = Indices(a.tensor[:4].clone(), FULL)
    service.release_window(released)
    released.tensor.copy_(b.tensor[:4])  # now names b's pages, which keep their SWA slots
    service.step()
    assert hybrid_pool(service).swa_allocator.num_free_tokens == 4  # a's first 4 tokens
    swa_b = hybrid_pool(service).swa_slots_of(b).tensor
    assert bool((swa_b != 0).all())  # b's window untouched
    service.check_integrity()
    service.insert([*range(1, 9)], a)
    service.insert([*range(11, 19)], b)
    service.step()
    service.check_integrity()

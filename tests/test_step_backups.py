"""Backups a service queues at ``insert`` (and ``match``) and issues at ``step()``: one write
op per scheduler step, whatever number of requests it inserted; ``alloc_device`` and
``stop`` issue what is still queued; a tree used without a service issues at once. On the
GPU, a backup issued at a step reads the rows the inserting caller's stream wrote, even when
another stream is current at the step."""

from __future__ import annotations

import pytest
import torch
from radix_helpers import expected_rows
from test_service import PAGE, full_pool, make_config, needs_cuda, put, wait_for

from hicache.factory import build_service
from hicache.pools import IndexSpace, Indices
from hicache.service import HiCacheService

WRITES = "device_to_host"


def submitted(service: HiCacheService) -> int:
    return service.controller.stats.ops_submitted[WRITES]


def test_insert_queues_the_backup_and_step_issues_it() -> None:
    service = build_service(make_config())
    try:
        assert put(service, [1, 1, 2, 2])
        node = service.match([1, 1, 2, 2]).last_device_node
        assert submitted(service) == 0 and service.controller.num_in_flight == 1
        assert node.write_op is not None and not node.is_backed_up
        assert service.step() == 1  # issued, done on a CPU and applied in the same step
        assert submitted(service) == 1 and service.controller.num_in_flight == 0
        assert node.write_op is None and node.is_backed_up and node.lock_count == 0
        service.check_integrity()
    finally:
        service.stop()


def test_the_inserts_of_one_step_are_one_write() -> None:
    service = build_service(make_config())
    try:
        prompts = [[first, first, 5, 5, 6, 6] for first in (1, 2, 3)]
        for tokens in prompts:
            assert put(service, tokens)
        assert submitted(service) == 0
        assert service.step() == 1  # one op, one ack, three nodes backed up
        assert submitted(service) == 1
        nodes = [service.match(tokens).last_device_node for tokens in prompts]
        assert all(node.is_backed_up and node.lock_count == 0 for node in nodes)
        assert service.tree.stats.backed_up_tokens == 18
        service.check_integrity()
    finally:
        service.stop()


def test_selective_backups_of_a_match_wait_for_the_step() -> None:
    service = build_service(make_config("write_through_selective"))  # backed up at hit 2
    try:
        assert put(service, [4, 4, 8, 8])
        service.match([4, 4, 8, 8])
        assert submitted(service) == 0 and service.controller.num_in_flight == 0
        match = service.match([4, 4, 8, 8])  # the second hit queues its backup
        assert service.controller.num_in_flight == 1 and submitted(service) == 0
        service.step()
        assert submitted(service) == 1 and match.last_device_node.is_backed_up
    finally:
        service.stop()


def test_alloc_device_short_of_room_leaves_the_backups_to_the_step() -> None:
    """An allocation that must evict does not issue the step's backups one by one (they
    stay one op): their nodes are locked until acknowledged, so issuing them could not
    make room now. The allocation fails as it did when they were issued at insert, and
    succeeds after the step."""
    service = build_service(make_config())
    try:
        for first in range(4):  # 24 of the 32 device tokens, their backups queued
            assert put(service, [first, first, 9, 9, 8, 8])
        assert service.alloc_device(16) is None  # every node is locked by its backup
        assert submitted(service) == 0
        assert service.step() == 1 and submitted(service) == 1
        got = service.alloc_device(16)  # the nodes were unlocked by the step's ack
        assert got is not None and len(got) == 16
        service.free_device(got)
        service.check_integrity()
    finally:
        service.stop()


def test_stop_issues_and_applies_the_queued_backups() -> None:
    service = build_service(make_config())
    service.start()
    assert put(service, [6, 6, 7, 7])
    service.stop()
    (node,) = service.tree.nodes()
    assert node.is_backed_up and node.lock_count == 0 and submitted(service) == 1
    assert service.controller.num_in_flight == 0
    service.check_integrity()


def test_the_thread_issues_backups_when_no_step_comes() -> None:
    """A quiet scheduler: the backup its last insert queued is issued and polled by the
    background thread; the next step applies the ack."""
    service = build_service(make_config(interval_s=0.01))
    service.start()
    try:
        assert put(service, [2, 2, 3, 3])
        wait_for(lambda: submitted(service) == 1 and not service.controller.num_in_flight)
        assert service.stats.polls >= 1
        assert service.step() == 1
        assert service.match([2, 2, 3, 3]).last_device_node.is_backed_up
    finally:
        service.stop()


def test_a_tree_without_a_service_issues_at_insert() -> None:
    service = build_service(make_config())
    try:
        tree = service.tree
        tree.issue_backups = True  # as a tree built on its own
        slots = service.alloc_device(4)
        assert slots is not None
        tree.insert([3, 3, 4, 4], Indices(slots.tensor, IndexSpace.DEVICE_FULL))
        assert submitted(service) == 1
    finally:
        service.stop()


# ---- GPU: the inserting caller's stream -------------------------------------------------------


def _backup_after_a_busy_stream(service: HiCacheService, tokens: list[int]) -> torch.Tensor:
    """Write ``tokens``' rows on a side stream that first sleeps on the GPU, insert them
    there, then step with the default stream current; the host rows of the backup."""
    pool = full_pool(service)
    slots = service.alloc_device(len(tokens))
    assert slots is not None
    # the rows and their index on the device first: a copy from pageable host memory
    # would make the CPU wait for the side stream, and the race would never be open
    index = slots.tensor.to(pool.device)
    rows = expected_rows(tokens, pool.num_layers).permute(1, 2, 0, 3).to(pool.device)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream(pool.device)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: the rows land long after the step
        pool.data[:, :, index] = rows
        service.insert(tokens, slots)
    service.step()  # issues the backup with the default stream current
    torch.cuda.synchronize()
    service.step()  # its ack
    node = service.match(tokens).last_device_node
    assert node.is_backed_up and node.host is not None
    host = service.controller.host_pool
    return torch.stack([
        torch.stack([host.read_layer_rows(c, layer, node.host.tensor)
                     for layer in range(pool.num_layers)], dim=1)
        for c in range(pool.geometry.num_components)], dim=1)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["torch", "kernel", "staged", "auto"])
def test_a_backup_issued_at_the_step_reads_the_inserting_streams_rows(backend: str) -> None:
    service = build_service(make_config(device="cuda", io_backend=backend))
    try:
        tokens = [5, 5, 6, 6, 7, 7, 8, 8][:4 * PAGE]
        rows = _backup_after_a_busy_stream(service, tokens)
        assert torch.equal(rows, expected_rows(tokens, full_pool(service).num_layers))
        service.check_integrity()
    finally:
        service.stop()


@pytest.mark.gpu
@needs_cuda
def test_without_the_callers_mark_the_backup_would_read_stale_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: with no event on the inserting stream, the write issued at the step
    waits only on the default stream and copies the rows before the side stream wrote them
    (what the mark prevents)."""
    service = build_service(make_config(device="cuda", io_backend="torch"))
    try:
        streams = service.controller._streams
        monkeypatch.setattr(streams, "mark_caller", lambda: None)
        tokens = [9, 9, 3, 3]
        rows = _backup_after_a_busy_stream(service, tokens)
        assert not torch.equal(rows, expected_rows(tokens, full_pool(service).num_layers))
    finally:
        service.stop()

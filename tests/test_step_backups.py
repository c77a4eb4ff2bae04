"""Backups a service queues at ``insert`` (and ``match``) and issues at ``step()``: one write
op per scheduler step, whatever number of requests it inserted; ``alloc_device`` and
``stop`` issue what is still queued; a tree used without a service issues at once. On the
GPU, a backup issued at a step reads the rows the inserting caller's stream wrote, even when
another stream is current at the step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from radix_helpers import expected_rows
from test_service import PAGE, full_pool, make_config, needs_cuda, put, wait_for

from hicache.config import HiCacheConfig
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
        assert submitted(service) == 0 and service.controller.num_in_flight == 0
        assert node.write_op is not None and node.write_op.queued and node.host is None
        assert node.lock_count == 1 and service.tree.has_queued_backups
        host_free = service.controller.host_pool.allocator.num_free_tokens
        service.check_integrity()  # a queued backup: a locked device node, no host slots
        assert service.step() == 1  # issued, done on a CPU and applied in the same step
        assert submitted(service) == 1 and service.controller.num_in_flight == 0
        assert service.controller.host_pool.allocator.num_free_tokens == host_free - 4
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
        assert service.tree.has_queued_backups and submitted(service) == 0
        service.step()
        assert submitted(service) == 1 and match.last_device_node.is_backed_up
    finally:
        service.stop()


def small_host_config(host_tokens: int) -> HiCacheConfig:
    """:func:`make_config` with a host of ``host_tokens`` tokens (the device keeps 32)."""
    config = make_config()
    return dataclasses.replace(config, host=dataclasses.replace(config.host,
                                                                ratio=host_tokens / 32))


def host_free(service: HiCacheService) -> int:
    return service.controller.host_pool.allocator.num_free_tokens


def test_a_step_evicts_host_leaves_once_for_all_its_backups() -> None:
    """The host short of room for a step's backups: the step evicts host-only leaves for
    the whole shortfall (least recently used first), then backs them all up in one op."""
    service = build_service(make_config())  # host 64 tokens
    try:
        for batch in range(2):  # 48 host tokens in host-only nodes
            for first in range(4):
                assert put(service, [10 * batch + first, 1, 2, 2, 3, 3])
            service.step()
            assert service.evict(24) == 24
        assert host_free(service) == 16 and service.tree.stats.evicted_host_tokens == 0
        for first in range(4):  # 24 tokens queued: 8 short
            assert put(service, [20 + first, 1, 2, 2, 3, 3])
        assert host_free(service) == 16 and submitted(service) == 2  # nothing allocated yet
        assert service.step() == 1 and submitted(service) == 3  # one op for the four
        assert service.tree.stats.evicted_host_tokens == 12  # two 6-token leaves, the oldest
        assert host_free(service) == 4
        assert service.match([0, 1, 2, 2]).host_hit_tokens == 0  # evicted
        assert service.match([10, 1, 2, 2]).host_hit_tokens == 4  # kept
        for first in range(4):
            node = service.match([20 + first, 1, 2, 2, 3, 3]).last_device_node
            assert node.is_backed_up and node.lock_count == 0
        service.check_integrity()
    finally:
        service.stop()


def test_a_step_backs_up_what_the_host_can_take_and_refuses_the_rest() -> None:
    """Three 4-token backups for a host of 8 tokens with nothing to evict: the first two
    are written (one op), the third is refused: counted, its node unlocked and left on the
    device without a copy, the integrity whole. (A later match of it queues it again.)"""
    service = build_service(small_host_config(8))
    try:
        for first in range(3):
            assert put(service, [first, first, 7, 7])
        assert service.step() == 1 and submitted(service) == 1
        nodes = sorted(service.tree.nodes(), key=lambda node: node.node_id)
        assert [node.is_backed_up for node in nodes] == [True, True, False]
        assert nodes[2].write_op is None and nodes[2].host is None
        assert all(node.lock_count == 0 for node in nodes)
        assert service.tree.stats.refused_backups["host_full"] == 4
        assert host_free(service) == 0
        service.check_integrity()
        service.match([2, 2, 7, 7])
        assert nodes[2].write_op is not None and nodes[2].write_op.queued
    finally:
        service.stop()


def test_a_node_split_before_the_step_is_backed_up_in_both_halves() -> None:
    """An insert that diverges inside a node whose backup is still queued splits it; the
    step allocates host slots for both halves (and the new branch) and the ack unlocks
    them all."""
    service = build_service(make_config())
    try:
        assert put(service, [1, 1, 2, 2, 3, 3])
        assert put(service, [1, 1, 2, 2, 5, 5])  # splits [1 1 2 2 | 3 3]
        upper = service.match([1, 1, 2, 2]).last_device_node
        assert upper.write_op is not None and upper.write_op.queued and upper.host is None
        service.check_integrity()
        assert service.step() == 1 and submitted(service) == 1
        for tokens in ([1, 1, 2, 2], [1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 5, 5]):
            node = service.match(tokens).last_device_node
            assert node.is_backed_up and node.lock_count == 0 and node.host is not None
        assert service.tree.stats.backed_up_tokens == 8
        assert host_free(service) == 64 - 8
        service.check_integrity()
    finally:
        service.stop()


def test_the_integrity_check_knows_a_queued_backup() -> None:
    """A queued backup is a locked device node without host slots; host slots on it (or
    no lock) are reported."""
    service = build_service(make_config())
    try:
        assert put(service, [3, 3, 4, 4])
        node = service.match([3, 3, 4, 4]).last_device_node
        service.check_integrity()
        node.host = Indices(torch.tensor([2, 3, 4, 5]), IndexSpace.HOST_FULL)
        with pytest.raises(RuntimeError, match="queued backup needs a locked device node"):
            service.tree.check_integrity()
        node.host = None
        node.lock_count -= 1
        with pytest.raises(RuntimeError, match="queued backup needs a locked device node"):
            service.tree.check_integrity()
        node.lock_count += 1
        service.step()
        service.check_integrity()
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


def _backup_after_a_busy_stream(service: HiCacheService, tokens: list[int],
                                by_thread: bool = False) -> torch.Tensor:
    """Write ``tokens``' rows on a side stream that first sleeps on the GPU, insert them
    there, then step with the default stream current (or, ``by_thread``, let the started
    background thread issue the backup); the host rows of the backup."""
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
    if by_thread:  # a quiet scheduler: the background thread issues it, on its own stream
        service.start()
        wait_for(lambda: not service.tree.has_queued_backups)
    else:
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
@pytest.mark.parametrize(("backend", "by_thread"), [
    ("torch", False), ("kernel", False), ("staged", False), ("auto", False),
    ("torch", True), ("staged", True)])
def test_a_backup_issued_later_reads_the_inserting_streams_rows(backend: str,
                                                               by_thread: bool) -> None:
    """Issued at the step (the default stream current) or by the background thread of a
    quiet scheduler (its own current stream): either way after the inserting stream."""
    service = build_service(make_config(device="cuda", io_backend=backend, interval_s=0.01))
    try:
        tokens = [5, 5, 6, 6, 7, 7, 8, 8][:4 * PAGE]
        rows = _backup_after_a_busy_stream(service, tokens, by_thread)
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
        monkeypatch.setattr(streams, "mark_caller", lambda earlier=(): tuple(earlier))
        tokens = [9, 9, 3, 3]
        rows = _backup_after_a_busy_stream(service, tokens)
        assert not torch.equal(rows, expected_rows(tokens, full_pool(service).num_layers))
    finally:
        service.stop()

"""The device slots handed between the engine and the tree: an allocation that evicts."""

from __future__ import annotations

from hicache.bench.scheduler import PAGE, ChatWorkload, admit, fill, make_service


def test_an_evicting_allocation_applies_the_acks_the_thread_took() -> None:
    """With no op in flight, an allocation that evicts still applies the acks the
    background thread polled and queued: the backup's lock drops before the retry."""
    service = make_service(capacity_tokens=8192)
    try:
        workload = ChatWorkload(seed=3, num_systems=4)
        fill(service, workload, 4096)
        service.step()
        key, match, slots = admit(service, workload.next_prompt())
        service.insert(key, slots)  # its backup queued, no step after it
        node = service.match(key).last_device_node
        service.release(match.last_device_node)
        service._poller._poll_once()  # the thread's pass: issues the backup, polls
        assert node.write_op is not None and service.controller.num_in_flight == 0
        free = service.controller.device_allocator.num_free_tokens
        got = service.alloc_device(free + PAGE)  # evicts
        assert got is not None and node.write_op is None
        assert service._poller.drain() == []
        service.free_device(got)
        service.check_integrity()
    finally:
        service.stop()

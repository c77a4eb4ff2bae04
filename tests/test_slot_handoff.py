"""The device slots handed between the engine and the tree: an allocation that evicts, and
the check of the counts the engine passes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from hicache.bench.scheduler import PAGE, ChatWorkload, admit, fill, make_service
from hicache.pools import IndexSpace, Indices
from hicache.slot_handoff import check_count


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


class _Count(int):
    """An int subclass: not the fast path's exact int."""


@pytest.mark.parametrize("value", [0, 1, 2048, 2**70, -1, True, False, np.int64(16),
                                   np.int32(-3), np.bool_(True), _Count(32), _Count(-2),
                                   1.0, float("nan"), "16", None])
def test_a_count_is_checked_as_the_general_check_does(value: object) -> None:
    """``check_count`` answers an exact non-negative int at once, and everything else as
    its general checks do: the same int (an int, never a subclass), or the same error."""
    def general(value: object) -> int:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"op: num_tokens must be an int, got {type(value).__name__} "
                            f"{value!r:.40}")
        if value < 0:
            raise ValueError(f"op: num_tokens must be >= 0, got {value}")
        return int(value)

    def answer(check: Callable[[object], int]) -> tuple[str, object]:
        try:
            result = check(value)
        except (TypeError, ValueError) as exc:
            return type(exc).__name__, str(exc)
        return type(result).__name__, result

    assert answer(lambda v: check_count("op", v)) == answer(general)


def test_insert_refuses_slots_that_are_not_indices_before_anything_changes() -> None:
    """A raw tensor (or list) of slots is refused by ``insert`` with a ``TypeError``, the
    engine's pages and the tree as they were: the handoff after it reads them as
    ``Indices``."""
    service = make_service(capacity_tokens=1024)
    try:
        held = service.alloc_device(2 * PAGE + 1)
        assert held is not None
        tokens = list(range(1, 2 * PAGE + 2))
        for raw in (held.tensor, held.tensor.tolist()):
            with pytest.raises(TypeError, match="insert: expected DEVICE_FULL Indices"):
                service.insert(tokens, raw)  # type: ignore[arg-type]
            assert service.engine_held_tokens == 3 * PAGE
            assert service.tree.num_nodes == 0
        assert service.insert(tokens, held) == 0  # a whole page and the partial one's slots
        service.free_device(Indices(held.tensor[2 * PAGE:], IndexSpace.DEVICE_FULL))
        service.check_integrity()
    finally:
        service.stop()

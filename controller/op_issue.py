"""Issuing a controller's queued calls: writes, layer-wise loads, and both at once.

A staged 32k-token op takes a couple of milliseconds of CPU to issue, and the copy engine
starts on its first chunk at once. Issued one after the other, a write and a load therefore
overlap only once the first is issued: the second's copies start that much later, which is
the share of the two-way ceiling that two separate calls lose. :meth:`OpIssue.start_transfers`
issues them together: the load's first layer groups, as many as the link takes longer to
move than the write takes to issue (:func:`write_issue_s`; one or two of a 32k-token load,
whose layer 0 alone is a few milliseconds of the link), then the write, then the load's
other groups. Each direction's copies then start within a few groups' issue of the call,
and the load's layers are not late for the write's issue: a forward waits on them, the
write's rows wait for no one.
"""

from __future__ import annotations

import logging

from .base import Direction, TransferBackend, TransferOp
from .events import LayerEventRing
from .load_groups import LINK_BYTES_PER_S
from .op_queue import OpQueue
from .side_streams import SideStreams
from .stats import TransferStats

logger = logging.getLogger(__name__)

# CPU time to issue a write op, the most a backend takes (``staged``, whose chunks cost
# 50-80 us each): a fixed part (merge, stream waits, events) and a part per byte (its
# chunks), measured on H100 and H200 hosts: 0.15-0.3 ms for a small op, 2-3 ms for 4 GiB.
WRITE_ISSUE_S = 250e-6
WRITE_ISSUE_S_PER_BYTE = 0.6e-12


def write_issue_s(op: TransferOp) -> float:
    """The CPU seconds issuing write ``op`` may take (an upper estimate: see above)."""
    return WRITE_ISSUE_S + WRITE_ISSUE_S_PER_BYTE * sum(op.bytes_by_pool.values())


class OpIssue:
    """The issuing half of :class:`~hicache.controller.core.TransferCore` (which holds
    what these methods use)."""

    backend: TransferBackend
    layer_events: LayerEventRing
    stats: TransferStats
    _ops: OpQueue
    _streams: SideStreams

    def _submitted(self, op: TransferOp) -> None:
        """Count ``op`` as issued: in flight until acknowledged, in the stats."""
        self._ops.issued(op)
        self.stats.on_submit(op)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("issued %s op %d: %d tokens, %d pools, backend %s", op.direction.value,
                         op.op_id, op.num_tokens, len(op.transfers), op.backend)

    def start_writing(self) -> None:
        """Merge queued writes into one all-layer op and issue it on the write stream.

        When the issue raises (a staging buffer's allocation, a Ctrl-C between copies), the
        writes are queued again as they were, their pages still held, and the next call
        issues them (the copies already made are repeated after them on the stream)."""
        op = self._ops.merge(Direction.DEVICE_TO_HOST, self.backend)
        if op is None:
            return
        try:
            self._streams.issue_write(op)
        except BaseException:
            self._ops.requeue(op)
            raise
        self._submitted(op)

    def start_loading(self) -> int | None:
        """Issue queued loads on the load stream in layer groups (:mod:`.load_groups`).

        Returns:
            the event set id now consumed by :meth:`wait_until`, or ``None`` when nothing
            was queued (then ``wait_until`` keeps its previous consumer).
        Raises:
            RuntimeError: the ring's next event set is still in flight.
            Any error of the issue itself: the loads are queued again as after a failed
            :meth:`start_writing`, and the consumer set is the one before.
        """
        if not self._ops.num_queued(Direction.HOST_TO_DEVICE):
            return None
        set_id, op = self._merged_load()
        try:
            self._streams.issue_load(op, op.layer_events)
        except BaseException:
            self._failed_load(op)
            raise
        self.layer_events.consumer = set_id
        self._submitted(op)
        return set_id

    def start_transfers(self) -> int | None:
        """Issue queued writes and loads together, neither waiting for the other's issue:
        the load's first layer groups, the write, then the load's other groups (the
        module's docstring says how many and why). With only writes or only loads queued it is
        :meth:`start_writing` or :meth:`start_loading`. Each op keeps its stream, events
        and acknowledgement as if issued alone.

        Returns and raises as :meth:`start_loading` (a refused call issues nothing). An
        error of the write's issue is raised once the load is issued and submitted (the
        write is then as after a failed :meth:`start_writing`).
        """
        if not self._ops.num_queued(Direction.HOST_TO_DEVICE):
            self.start_writing()
            return None
        if not self._ops.num_queued(Direction.DEVICE_TO_HOST):
            return self.start_loading()
        set_id, load = self._merged_load()
        try:
            write = self._ops.merge(Direction.DEVICE_TO_HOST, self.backend)
        except BaseException:
            self._failed_load(load)
            raise
        assert write is not None

        failed: list[BaseException] = []
        issued = []

        def issue_write() -> None:
            try:
                self._streams.issue_write(write)
            except BaseException as error:  # raised once the load is issued and submitted
                self._ops.requeue(write)
                failed.append(error)
                return
            issued.append(write)
            self._submitted(write)

        try:
            self._streams.issue_load(load, load.layer_events, between=issue_write,
                                     cover_bytes=int(write_issue_s(write) * LINK_BYTES_PER_S))
        except BaseException:
            self._failed_load(load)
            if not issued and not failed:  # the load raised before the write's turn
                self._ops.requeue(write)
            raise
        self.layer_events.consumer = set_id
        self._submitted(load)
        if failed:
            raise failed[0]
        return set_id

    def _failed_load(self, op: TransferOp) -> None:
        """The issue of load ``op`` raised: its calls are queued again (the next
        ``start_loading`` issues them) and its event set is free again; the consumer set is
        still the one before, so a forward must not run on this load's layers until a
        ``start_loading`` returned."""
        assert op.event_set is not None
        self.layer_events.release(op.event_set, op.event_ticket)
        self._ops.requeue(op)

    def _merged_load(self) -> tuple[int, TransferOp]:
        """The next event set (raises while it is in flight) and the queued loads merged
        into one op that signals it."""
        set_id, events = self.layer_events.acquire()
        try:
            op = self._ops.merge(Direction.HOST_TO_DEVICE, self.backend)
        except BaseException:  # the calls are still queued; the set is free again
            self.layer_events.release(set_id, self.layer_events.taken(set_id))
            raise
        assert op is not None
        op.event_set, op.layer_events = set_id, events
        op.event_ticket = self.layer_events.taken(set_id)
        return set_id, op

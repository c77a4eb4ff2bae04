"""A call's pages spread over worker threads, each on its own connection to the page's server.

A single-threaded Redis server writes to several clients per event-loop turn, and a client
thread blocked in ``recv_into`` releases the GIL: with the pages of one call split into
stripes (every ``n``-th page of a server's share) on ``n`` connections, the server and the
client work at the same time instead of taking turns. Measured with 2 MiB pages on loopback
(2 cores): 4 connections read 0-70% faster than one (about 20% in most runs); writes gain
little, the server's page faults on fresh memory bound them.

:meth:`Stripes.run` returns only when no worker touches the call's buffers any more: a stripe
still queued at the deadline (behind another call's) is cancelled, a running one stops at the
deadline by itself (every socket wait is bounded by what remains of it). Each server's circuit
is asked once per call, before its stripes start, and told once per call how they ended, so
``n`` failing stripes count as one failure (one backoff step), not ``n``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from .base import Deadline, PageStatus
from .redis_nodes import Address, RedisNodes
from .redis_pages import Statuses, fill
from .resp import RespConnection, RespError

NodeWork = Callable[[RespConnection, list[int], Deadline], None]
Stripe = tuple[Address, list[int], "Future[Exception | None]"]


class _NotStarted(TimeoutError):
    """A stripe the deadline passed before a worker took it: not the server's fault."""


class Stripes:
    """The worker threads of one store (made on first use, shared by concurrent calls).

    Args:
        nodes: routing, per-thread connections and circuits.
        num_threads: workers, and the most stripes one call makes (split over its servers).
    """

    def __init__(self, nodes: RedisNodes, num_threads: int) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.nodes = nodes
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="hicache-redis")

    def run(self, page_hashes: Sequence[bytes], statuses: Statuses, deadline: Deadline,
            work: NodeWork, only: list[int] | None) -> str | None:
        """``work(connection, positions, deadline)`` on stripes of each server's share of the
        pages (``only``: of these positions); pages a failed stripe left unset become
        ``TIMEOUT`` (deadline) or ``ERROR``. Returns the first error message."""
        stripes, error = self._start(page_hashes, statuses, deadline, work, only)
        if not stripes:
            return error
        _, late = wait([future for *_, future in stripes], timeout=deadline.remaining())
        for future in late:
            future.cancel()  # queued behind other calls; a running stripe ends by itself
        return self._finish(stripes, statuses) or error

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _start(self, page_hashes: Sequence[bytes], statuses: Statuses, deadline: Deadline,
               work: NodeWork, only: list[int] | None) -> tuple[list[Stripe], str | None]:
        groups = self.nodes.group([h.hex().encode() for h in page_hashes], deadline)
        wanted = None if only is None else set(only)
        per_server = max(1, self.num_threads // max(1, len(groups)))
        stripes: list[Stripe] = []
        error = None
        for address, positions in groups.items():
            if wanted is not None:
                positions = [i for i in positions if i in wanted]
            if not positions:
                continue
            if address is None or not self.nodes.allow(address):
                fill(statuses, positions, PageStatus.ERROR)
                error = error or self.nodes.unreachable(address)
                continue
            count = min(per_server, len(positions))
            for first in range(count):
                stripe = positions[first::count]
                stripes.append((address, stripe, self._pool.submit(
                    self._stripe, address, stripe, deadline, work)))
        return stripes, error

    def _finish(self, stripes: list[Stripe], statuses: Statuses) -> str | None:
        """Wait for the running stripes, fill in what they left, tell each circuit."""
        failures: dict[Address, Exception] = {}
        ran: set[Address] = set()
        for address, stripe, future in stripes:
            exc = _NotStarted() if future.cancelled() else future.result()
            if exc is not None:
                timed_out = isinstance(exc, TimeoutError)
                fill(statuses, stripe, PageStatus.TIMEOUT if timed_out else PageStatus.ERROR)
            if not isinstance(exc, _NotStarted):
                ran.add(address)
                if exc is not None:
                    failures.setdefault(address, exc)
        error = None
        for address in ran:
            if address in failures:
                self.nodes.failed(address, failures[address])
                error = error or f"redis {address[0]}:{address[1]}: {failures[address]}"
            else:
                self.nodes.succeeded(address)
        return error

    def _stripe(self, address: Address, positions: list[int], deadline: Deadline,
                work: NodeWork) -> Exception | None:
        """In a worker: ``work`` on this thread's connection; the exception that ended it
        (the connection then closed), or ``None``."""
        if deadline.expired():
            return _NotStarted()
        try:
            work(self.nodes.connect(address, deadline), positions, deadline)
        except (OSError, RespError) as exc:
            self.nodes.drop(address)
            return exc
        return None

"""Which Redis server holds a key, and a connection to it: one per server per thread, behind
a circuit breaker per server.

Standalone: every key lives on the one server. Cluster: a key's slot is the CRC16 of its
hash tag (the text between ``{`` and ``}``, here the page hash) modulo 16384, and the slot map
comes from ``CLUSTER SLOTS`` (asked of any reachable node; asked again after a ``MOVED`` reply
or a failed server, at most every ``refresh_interval_s``). The page hash as the tag spreads
pages over the masters and keeps each page on one of them.
"""

from __future__ import annotations

import binascii
import logging
import threading
import time
from collections.abc import Sequence

from .base import Deadline, StatsRecorder
from .circuit import Circuit
from .resp import RespConnection, RespError, command

logger = logging.getLogger(__name__)
Address = tuple[str, int]
NUM_SLOTS = 16384


def key_slot(tag: bytes) -> int:
    """Redis Cluster slot of a key whose hash tag is ``tag`` (CRC16-XMODEM mod 16384)."""
    return binascii.crc_hqx(tag, 0) % NUM_SLOTS


class RedisNodes:
    """Routing, connections and circuits of one Redis deployment.

    Args:
        seeds: the standalone server, or any nodes of the cluster.
        cluster: route by slot (Redis Cluster) instead of sending everything to ``seeds[0]``.
        password: sent with ``AUTH`` on connect.
        stats: where circuit openings are counted.
    """

    def __init__(self, seeds: Sequence[Address], *, cluster: bool, password: str | None,
                 stats: StatsRecorder, base_backoff_s: float = 0.1,
                 max_backoff_s: float = 5.0, refresh_interval_s: float = 0.2) -> None:
        if not seeds:
            raise ValueError("a Redis store needs at least one host:port")
        self.seeds = list(seeds)
        self.cluster = cluster
        self.password = password
        self.refresh_interval_s = refresh_interval_s
        self._stats = stats
        self._backoff = (base_backoff_s, max_backoff_s)
        self._circuits: dict[Address, Circuit] = {}
        self._slots: list[Address | None] | None = None
        self._stale = False
        self._refreshed_at = -float("inf")
        self._local = threading.local()
        self._all: list[RespConnection] = []
        self._generation: dict[Address, int] = {}  # bumped when a server fails
        self._errors: dict[Address, str] = {}  # each failing server's last error
        self._lock = threading.Lock()

    # ---- routing ---------------------------------------------------------------------------

    def group(self, tags: Sequence[bytes], deadline: Deadline) -> dict[Address | None, list[int]]:
        """Positions of ``tags`` grouped by the server that holds them (``None``: no server
        known for the slot, e.g. the whole cluster unreachable)."""
        if not self.cluster:
            return {self.seeds[0]: list(range(len(tags)))}
        if self._slots is None or self._stale:
            self.refresh(deadline)
        slots = self._slots
        groups: dict[Address | None, list[int]] = {}
        for i, tag in enumerate(tags):
            owner = None if slots is None else slots[key_slot(tag)]
            groups.setdefault(owner, []).append(i)
        return groups

    def masters(self, deadline: Deadline) -> list[Address]:
        if not self.cluster:
            return [self.seeds[0]]
        self.refresh(deadline)
        return sorted({a for a in self._slots or [] if a is not None})

    def refresh(self, deadline: Deadline, *, force: bool = False) -> None:
        """Reload the cluster's slot map from the first node that answers (rate limited)."""
        if not self.cluster:
            return
        with self._lock:
            if not force and time.monotonic() - self._refreshed_at < self.refresh_interval_s:
                return
            self._refreshed_at = time.monotonic()
        known = sorted({a for a in self._slots or [] if a is not None})
        for address in [*self.seeds, *known]:
            connection = self.connection(address, deadline)
            if connection is None:
                continue
            try:
                connection.send([command(b"CLUSTER", b"SLOTS")], deadline)
                reply = connection.read_reply(deadline)
            except (OSError, RespError) as exc:
                self.failed(address, exc)
                continue
            self.succeeded(address)
            self._slots = slot_map(reply, address[0])
            self._stale = False
            return

    # ---- connections and circuits ------------------------------------------------------------

    def connection(self, address: Address, deadline: Deadline) -> RespConnection | None:
        """This thread's connection to ``address``; ``None`` if its circuit is open or the
        connection attempt failed (counted)."""
        existing = self._current(address)
        if existing is not None:
            return existing
        if not self.allow(address):
            return None
        try:
            return self.connect(address, deadline)
        except (OSError, RespError) as exc:
            self.failed(address, exc)
            return None

    def allow(self, address: Address) -> bool:
        """True if a call may talk to ``address`` now (its circuit is closed, or this call is
        the one trial after the backoff)."""
        return self._circuit(address).allow()

    def connect(self, address: Address, deadline: Deadline) -> RespConnection:
        """This thread's connection to ``address``, made if needed, whatever its circuit says
        (for a worker of a call that :meth:`allow` let through). Raises ``OSError`` or
        :class:`RespError` if it cannot be made."""
        existing = self._current(address)
        if existing is not None:
            return existing
        generation = self._generation.get(address, 0)
        connection = RespConnection(*address, deadline, self.password)
        self._connections()[address] = (connection, generation)
        with self._lock:
            self._all = [c for c in self._all if not c.closed]
            self._all.append(connection)
        return connection

    def drop(self, address: Address) -> None:
        """Close this thread's connection to ``address`` (its state is unknown after a
        failure or a timeout); the circuit is the caller's business (:meth:`failed`)."""
        entry = self._connections().pop(address, None)
        if entry is not None:
            entry[0].close()

    def failed(self, address: Address, error: Exception) -> None:
        """Drop this thread's connection to ``address`` and open its circuit."""
        self.drop(address)
        with self._lock:  # other threads' connections to it are stale too (a restarted
            self._generation[address] = self._generation.get(address, 0) + 1  # server)
            self._errors[address] = str(error) or type(error).__name__
        if self._circuit(address).failed():
            logger.warning("redis %s:%d failed (%s); its pages are misses until it answers",
                           *address, error)
            self._stats.add(circuit_opens=1)
        self._stats.set("open_circuits", self.open_circuits())
        if self.cluster:
            self.mark_stale()

    def succeeded(self, address: Address) -> None:
        with self._lock:
            self._errors.pop(address, None)
        if self._circuit(address).succeeded():
            logger.info("redis %s:%d answers again", *address)
            self._stats.set("open_circuits", self.open_circuits())

    def unreachable(self, address: Address | None) -> str:
        """Why :meth:`connection` gave no connection to ``address``, for an error message:
        the server's last error (a refused connection, a refused password), and whether its
        circuit is open (calls skip it until its backoff passes). ``None``: no server is known
        for the pages' slots (no node of the cluster answered)."""
        if address is None:
            return "no redis server known for these pages (no node gave the slot map)"
        with self._lock:
            error = self._errors.get(address, "no error recorded")
        where = f"redis {address[0]}:{address[1]}"
        if self._circuit(address).is_open:
            return f"{where}: circuit open (calls skip it until its backoff passes) after: {error}"
        return f"{where}: {error}"

    def open_circuits(self) -> int:
        return sum(1 for c in list(self._circuits.values()) if c.is_open)

    def close(self) -> None:
        with self._lock:
            connections, self._all = self._all, []
        for connection in connections:
            connection.close()

    def _connections(self) -> dict[Address, tuple[RespConnection, int]]:
        """This thread's connections, each with the server's generation when it was made."""
        connections: dict[Address, tuple[RespConnection, int]] = \
            self._local.__dict__.setdefault("c", {})
        return connections

    def _current(self, address: Address) -> RespConnection | None:
        """This thread's open connection to ``address`` made since the server last failed;
        an older one is closed (it may lead to a server that was restarted since), and so is
        one the server closed (an idle timeout, a restart): reused, it would fail the call
        and open the circuit of a server that answers."""
        entry = self._connections().get(address)
        if entry is None:
            return None
        connection, generation = entry
        if (not connection.closed and generation == self._generation.get(address, 0)
                and not connection.peer_closed()):
            return connection
        self.drop(address)
        return None

    def _circuit(self, address: Address) -> Circuit:
        circuit = self._circuits.get(address)
        if circuit is None:
            with self._lock:
                circuit = self._circuits.setdefault(address, Circuit(*self._backoff))
        return circuit

    def mark_stale(self) -> None:
        """After a failed server or a ``MOVED`` reply: the next routing reloads the map (a
        replica may own the slots now)."""
        self._stale = True


def slot_map(reply: object, default_host: str) -> list[Address | None]:
    """Slot -> master address from a ``CLUSTER SLOTS`` reply (``None``: slot not served)."""
    if not isinstance(reply, list):
        raise ValueError(f"unexpected CLUSTER SLOTS reply {reply!r:.80}")
    owners: list[Address | None] = [None] * NUM_SLOTS
    for entry in reply:
        assert isinstance(entry, list), "CLUSTER SLOTS entries are arrays"
        start, end, master = entry[0], entry[1], entry[2]
        assert isinstance(start, int) and isinstance(end, int) and isinstance(master, list)
        host = master[0].decode() if isinstance(master[0], bytes) and master[0] else default_host
        port = master[1]
        assert isinstance(port, int), "CLUSTER SLOTS ports are integers"
        owners[start:end + 1] = [(host, port)] * (end - start + 1)
    return owners

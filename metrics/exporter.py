"""MetricsExporter: a per-instance Prometheus registry over hicache's plain counters, and an
optional HTTP endpoint that serves it.

Usage (the service wires this; core code never imports ``prometheus_client``)::

    exporter = MetricsExporter(controller.stats, cache=tree.stats,
                               pool_usage=controller_pool_usage(controller),
                               service=service_stats, storage=lambda: service.storage,
                               source_lock=service_lock)
    port = exporter.start_http(config.service.metrics_host, config.service.metrics_port)
    ...
    exporter.stop()

Each exporter owns a ``CollectorRegistry`` (never the global one), so two services in one
process export independently. Constructing one opens no socket and starts no thread; only
:meth:`MetricsExporter.start_http` does. The endpoint is ``prometheus_client``'s own
threaded WSGI server and exposition app, answering ``/metrics`` only (404 elsewhere).

One port serves one process: engine workers on one host each need their own
``service.metrics_port`` (one scrape target per worker), or 0 for a free one.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from types import TracebackType

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app

from hicache.interrupts import interrupts_held

from .collector import HiCacheCollector
from .http_server import MetricsServer, only_metrics_path
from .names import DURATION_BUCKETS_S
from .sources import CacheSource, PoolUsageFn, ServiceSource, StorageTierFn, TransferSource

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"


class MetricsExporter:
    """Prometheus export of one hicache instance (arguments as for :class:`HiCacheCollector`).

    ``registry`` holds only this instance's metrics. :meth:`render` returns the text
    exposition; :meth:`start_http` serves it at ``/metrics``.
    """

    def __init__(
        self,
        transfers: TransferSource,
        *,
        cache: CacheSource | None = None,
        pool_usage: PoolUsageFn | None = None,
        service: ServiceSource | None = None,
        storage: StorageTierFn | None = None,
        source_lock: AbstractContextManager[object] | None = None,
        duration_buckets_s: Sequence[float] = DURATION_BUCKETS_S,
    ) -> None:
        self.registry = CollectorRegistry()
        self.collector = HiCacheCollector(
            transfers, cache=cache, pool_usage=pool_usage, service=service, storage=storage,
            source_lock=source_lock, duration_buckets_s=duration_buckets_s,
        )
        self.registry.register(self.collector)
        self._server: MetricsServer | None = None
        self._thread: threading.Thread | None = None

    def refresh(self) -> int:
        """Drain measured transfer durations into the histogram (see
        :meth:`HiCacheCollector.refresh`); returns how many were drained."""
        return self.collector.refresh()

    def render(self) -> bytes:
        """The current metrics in the Prometheus text format (UTF-8)."""
        return generate_latest(self.registry)

    # ---- HTTP endpoint ------------------------------------------------------------------

    def start_http(self, host: str = DEFAULT_HOST, port: int = 0) -> int:
        """Serve the metrics over HTTP from a daemon thread.

        Args:
            host: address to bind; the default serves this machine only.
            port: TCP port; 0 picks a free one.
        Returns:
            the bound port.
        Raises:
            RuntimeError: already serving (call :meth:`stop` first).
            ValueError: ``port`` outside 0..65535.
            MetricsBindError: an ``OSError``: the address cannot be bound (the port is
                taken, the host does not resolve or is no address of this machine); the
                message names ``host:port`` and the fix (a port per worker, or
                ``metrics_port: 0``; another ``metrics_host``), the original ``errno`` is
                kept and the original error is the ``__cause__``. Nothing is left serving.
        """
        if self._server is not None:
            raise RuntimeError(f"metrics endpoint already serving on port {self.port}; "
                               f"call stop() before starting it again")
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port {port} is not a TCP port; use 0..65535 "
                             f"(0 picks a free port)")
        self._server = server = _bind(host, port)  # from here stop() closes it
        try:
            server.set_app(only_metrics_path(make_wsgi_app(self.registry)))
            thread = threading.Thread(target=server.serve_until_stopped,
                                      name="hicache-metrics-http", daemon=True)
            # recorded iff it runs: stop() joins exactly the thread that runs
            with interrupts_held():
                thread.start()
                self._thread = thread
        except BaseException:
            self.stop()
            raise
        logger.info("serving metrics on http://%s/metrics", host_port(host, server.server_port))
        return server.server_port

    @property
    def port(self) -> int | None:
        """The bound port while serving, else ``None``."""
        return None if self._server is None else self._server.server_port

    @property
    def address(self) -> tuple[str, int] | None:
        """The bound ``(host, port)`` while serving, else ``None``."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def stop(self) -> None:
        """Stop serving, join the thread and close the socket (no-op when not serving).

        A Ctrl-C part-way is raised once that is done; a stop cut short anyway (a second
        Ctrl-C) goes on where it was when called again.
        """
        try:
            self._stop_serving()
        except KeyboardInterrupt:
            self._stop_serving()  # no thread left serving and the port closed, then raise
            raise

    def _stop_serving(self) -> None:
        # Each step is forgotten only once done, so that a second call finishes the first.
        server = self._server
        if server is None:
            return
        server.stop_requested = True
        thread = self._thread  # read once: a stop on another thread may clear it
        if thread is not None:
            thread.join()  # within the server's poll interval (0.1 s)
            self._thread = None
        server.server_close()
        server.close_requests()  # a scrape accepted before stop is not answered after it
        self._server = None

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class MetricsBindError(OSError):
    """The metrics endpoint's address cannot be bound; ``strerror`` is one line naming the
    config key to change (``service.metrics_host`` or ``service.metrics_port``)."""


def probe_bind(host: str, port: int) -> None:
    """Bind ``host:port`` as :meth:`MetricsExporter.start_http` would, and close it again.

    Raises:
        MetricsBindError: what ``start_http`` would raise for this address.
    """
    _bind(host, port).server_close()


def _bind(host: str, port: int) -> MetricsServer:
    """The server bound to ``host:port``, or a :class:`MetricsBindError` that says what to
    change."""
    try:
        return MetricsServer(host, port)
    except socket.gaierror as exc:
        raise MetricsBindError(exc.errno, f"metrics endpoint: host {host!r} does not resolve "
                                          f"({exc.strerror}); set service.metrics_host to an "
                                          f"address of this machine") from exc
    except OSError as exc:
        raise MetricsBindError(exc.errno, _bind_message(host, port, exc)) from exc


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (as a URL writes it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind_message(host: str, port: int, exc: OSError) -> str:
    address = host_port(host, port)
    reason = exc.strerror or "cannot bind"
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"metrics endpoint: cannot bind {address} ({reason}: {host} is no address of "
                f"this machine); set service.metrics_host to one of its addresses, e.g. "
                f"127.0.0.1, or 0.0.0.0 for all of them")
    if exc.errno == errno.EADDRINUSE:
        reason += (": another process, or another engine worker on this host, has it; "
                   f"give each worker its own port, e.g. {port} + its rank")
    return (f"metrics endpoint: cannot bind {address} ({reason}); set service.metrics_port to "
            f"a free port, or 0 to pick one")


def port_is_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound; ``False`` when another has the port; raises
    :class:`MetricsBindError` for every other reason (the host is the problem)."""
    try:
        probe_bind(host, port)
    except MetricsBindError as exc:
        if exc.errno == errno.EADDRINUSE and port != 0:
            return False
        raise
    return True

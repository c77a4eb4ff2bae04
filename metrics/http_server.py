"""The metrics endpoint's HTTP server: ``prometheus_client``'s threaded WSGI server, answering
``/metrics`` only, whose request threads end with it.

A request runs on a thread of its own. ``socketserver`` leaves those threads running when
the server closes, so a scrape accepted just before :meth:`MetricsExporter.stop` was answered
after it, once the service had closed its store: every L3 counter read 0, which Prometheus
takes for a counter reset. :meth:`MetricsServer.close_requests` shuts their connections and
joins them.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client.exposition import ThreadingWSGIServer

logger = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
SHUTDOWN_POLL_S = 0.1
REQUEST_TIMEOUT_S = 5.0  # seconds a request connection may stay silent
CLOSE_WAIT_S = 1.0  # how long a stop waits for the requests it shut to end


WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def only_metrics_path(app: WSGIApp) -> WSGIApp:
    """``app`` at :data:`METRICS_PATH`; 404 with a one-line hint on any other path."""

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == METRICS_PATH:
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"hicache serves its metrics at {METRICS_PATH} only\n".encode()]

    return serve


class QuietHandler(WSGIRequestHandler):
    """Logs each request at DEBUG instead of writing it to stderr. A connection that sends
    nothing for :data:`REQUEST_TIMEOUT_S` is closed (a TCP health check, a hung scraper):
    each would hold a thread and a socket, past ``stop``."""

    timeout = REQUEST_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("metrics request from %s: " + format, self.address_string(), *args)


class MetricsServer(ThreadingWSGIServer):  # type: ignore[misc]
    """``prometheus_client``'s threaded WSGI server bound to ``(host, port)``, IPv4 or IPv6
    as ``host`` resolves."""

    timeout = SHUTDOWN_POLL_S  # how long handle_request() waits: how soon a stop is seen

    def __init__(self, host: str, port: int) -> None:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        self.address_family = infos[0][0]
        super().__init__((host, port), QuietHandler)
        self.stop_requested = False
        self._requests: dict[Any, threading.Thread] = {}  # a TCP server: sockets
        self._requests_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve ``request`` on a thread of its own, tracked until it ends."""
        thread = threading.Thread(target=self._serve, args=(request, client_address),
                                  daemon=True, name="hicache-metrics-request")
        with self._requests_lock:
            self._requests[request] = thread
        thread.start()

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._requests_lock:
                self._requests.pop(request, None)

    def close_requests(self) -> None:
        """Shut the connections of the requests being served, so that none is answered
        after this returns, and give their threads :data:`CLOSE_WAIT_S` in all to end (a
        request collecting its metrics finishes that, then finds its connection shut). One
        still running then (waiting for a lock this caller holds) ends by itself."""
        with self._requests_lock:
            requests = list(self._requests.items())
        for request, _ in requests:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for _, thread in requests:
            thread.join(max(0.0, deadline - time.monotonic()))

    def serve_until_stopped(self) -> None:
        """Serve requests until :attr:`stop_requested`. Not ``serve_forever()``: its
        ``shutdown()`` waits on a ``threading.Event``, which a Ctrl-C landing inside can turn
        into ``RuntimeError: release unlocked lock``; a flag and ``join()`` cannot."""
        while not self.stop_requested:
            self.handle_request()



"""Starting and stopping a :class:`~hicache.service.HiCacheService`, and ``with service``.

``start`` brings up the metrics endpoint, then the background thread
(:class:`~hicache.background_poller.BackgroundPoller`); ``stop`` joins the thread, closes
the endpoint, drains every op in flight and applies its ack under the service lock, closes
the host pools, and raises a background failure that no scheduler call raised. After
``stop`` every scheduler call and ``start`` refuse to run (:class:`~hicache.call_gate.CallGate`).

Plain functions of the service (its methods of the same names call them), usually on the
thread that owns the service; ``stop`` blocks until the ops in flight finish. A ``start``
and a ``stop`` (or two ``stop`` calls) on different threads take turns
(``CallGate.lifecycle``): a ``stop`` closes whatever a ``start`` before it started, and a
``start`` after a ``stop`` began is refused.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .service import HiCacheService

logger = logging.getLogger(__name__)


def start(service: HiCacheService) -> None:
    """Start the background thread (and the metrics endpoint); no-op when running.

    Raises:
        ServiceError: the background thread failed.
        RuntimeError: the service was stopped (build a new one).
        OSError: the metrics address cannot be bound (the port is taken, the host does not
            resolve); the message names ``host:port`` and the fix, ``errno`` is kept.
            Nothing is started: ``start`` may be called again once the port is free, and
            ``stop`` works as usual.
    """
    gate = service._gate
    gate.raise_if_failed()
    with gate.lifecycle:  # a stop on another thread waits, then closes what this started
        if gate.stopped:
            raise RuntimeError("the service was stopped; build a new one")
        if service._poller.is_running:
            return
        exporter, address = service.exporter, service._metrics_address
        if exporter is not None and address is not None:
            port = exporter.start_http(*address)
            logger.info("hicache metrics on %s:%d", address[0], port)
        service._poller.start()


def stop(service: HiCacheService, *, surface: bool = True) -> None:
    """Join the thread, close the metrics endpoint, drain every op in flight and apply its
    ack, close the shared store's tier (finishing its prefetches and backups), close the host
    pools.

    Idempotent. A Ctrl-C part-way is raised once the rest is done (nothing else would call
    ``stop`` again: it unwinds through ``with`` and the command's handler); one cut short
    anyway (a second Ctrl-C) goes on where it was when called again. Raises the background
    thread's error (``ServiceError``) if no scheduler call did, unless ``surface`` is off
    (``with`` leaving on the body's own exception).
    """
    gate = service._gate
    gate.stopped = True  # first: a call made while this drains is refused, not run after it
    with gate.lifecycle:  # one stop at a time (a second waits, then finds it closed)
        try:
            if not gate.closed:
                _close(service)
        except KeyboardInterrupt:
            if not gate.closed:
                _close(service)  # no thread left running and the port closed, then raise
            raise
    if surface:
        gate.raise_if_unsurfaced()


def _close(service: HiCacheService) -> None:
    gate = service._gate
    service._poller.stop()
    if service.exporter is not None:
        service.exporter.stop()
    with gate.lock:
        service.tree.issue_queued_backups()  # queued with no step after them
        acks = service._poller.drain() + service.controller.drain()
        agreement = service._poller.agreement
        if agreement is not None:  # every op has finished, on every rank that stops here
            agreement.hold(acks)
            acks = agreement.take_all()
        service._poller.apply(acks)
        if service.storage is not None:  # after the acks: their backups are queued first
            service.storage.close()  # kept: its stats (and the metrics) stay readable
        for pool in service._host_pools:
            pool.close()
        gate.closed = True


def enter(service: HiCacheService) -> None:
    """``with service``: :func:`start`, and :func:`stop` again if ``start`` is interrupted
    (a Ctrl-C inside it), since ``__exit__`` will not run then."""
    try:
        service.start()
    except BaseException:
        stop(service, surface=False)  # what start raised is the news, not an older failure
        raise


def leave(service: HiCacheService, exc: BaseException | None) -> None:
    """Leaving ``with service``: :func:`stop`. On the body's own exception a background
    failure no call raised is not raised over it (``with`` would replace the engine's error
    by the cache's); it goes with it as a note (it was logged and counted already), and a
    later ``stop`` does not raise it again."""
    stop(service, surface=exc is None)
    failure = service._gate.unsurfaced
    if exc is not None and failure is not None:
        add_note = getattr(exc, "add_note", None)  # Python 3.11+ (the log has it anyway)
        if add_note is not None:
            add_note(f"hicache background thread had failed too: {failure!r}")
        service._gate.surfaced()

"""An interrupt (a Ctrl-C's KeyboardInterrupt) that lands anywhere in a scheduler call leaves
the service lock and the ack queue free, so that ``stop()``, which runs while the interrupt
propagates, never waits for either. A timer signal raises an exception at a random point of
thousands of calls. (What the interrupted call itself had half done is not promised to be
consistent: the service is being stopped.)"""

from __future__ import annotations

import random
import signal
import sys
import threading

import pytest
from test_service import make_config, put

from hicache.factory import build_service

pytestmark = pytest.mark.skipif(sys.platform == "win32" or not hasattr(signal, "setitimer"),
                                reason="needs POSIX interval timers")


class Interrupt(Exception):
    """What the timer's handler raises, as a Ctrl-C raises KeyboardInterrupt."""


def _raise_interrupt(*_: object) -> None:
    raise Interrupt


def test_an_interrupt_anywhere_in_a_call_leaves_the_lock_free() -> None:
    service = build_service(make_config())
    lock = service.service_lock
    rng = random.Random(0)
    previous = signal.signal(signal.SIGALRM, _raise_interrupt)
    interrupted = 0
    try:
        assert put(service, [1, 1, 2, 2])
        for _ in range(3000):
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(5e-6, 3e-4))
                while True:  # short calls: their entries and exits are much of the time
                    service.step()
                    service.match([1, 1, 2, 2])
            except Interrupt:
                interrupted += 1
                # the interrupt's traceback is alive here, as while stop() runs under it
                assert not lock.locked(), "an interrupted call left the service lock held"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupted == 3000
    stopper = threading.Thread(target=service.stop, daemon=True)
    stopper.start()
    stopper.join(timeout=60)
    assert not stopper.is_alive(), "stop() waited for a lock an interrupted call left held"

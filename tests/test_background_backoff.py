"""The background thread stays out of a busy scheduler's way: a pass that finds the scheduler
busy (calls with nothing in flight, its own polls with transfers in flight) does nothing and
doubles the next sleep; a quiet scheduler gets the thread back at one interval."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from test_service import make_config, put, wait_for

from hicache.background_poller import BUSY_WAKE_S
from hicache.factory import build_service
from hicache.service import HiCacheService


def busy_for(seconds: float, call: Callable[[], object]) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        call()


def test_a_busy_scheduler_with_nothing_in_flight_backs_the_thread_off() -> None:
    """Calls for 1.5 s at a 10 ms check interval: the sleeps double (10, 20, ... 640 ms,
    then the 1 s cap), so about 8 passes, not 150, none polls and no check runs; once the
    calls stop, the idle check comes within the cap and an interval."""
    with build_service(make_config(interval_s=0.01)) as service:
        wait_for(lambda: service.stats.background_passes >= 1)
        busy_for(1.5, lambda: service.match([1, 1]))
        stopped = time.monotonic()
        passes = service.stats.background_passes
        assert 3 <= passes <= 16, passes
        assert service.stats.polls == 0 and service.stats.integrity_checks == 0
        wait_for(lambda: service.stats.integrity_checks > 0, timeout_s=5.0)
        assert time.monotonic() - stopped < BUSY_WAKE_S + 0.5


def test_a_quiet_pass_starts_the_sleeps_again_from_one_interval() -> None:
    """After the backoff, a scheduler quiet for longer than the thread's sleep gets the
    thread back every interval: it checks about every 10 ms again."""
    with build_service(make_config(interval_s=0.01)) as service:
        busy_for(0.5, lambda: service.match([1, 1]))
        time.sleep(BUSY_WAKE_S + 0.2)  # the longest sleep ends in a quiet pass
        checks = service.stats.integrity_checks
        time.sleep(0.3)
        assert service.stats.integrity_checks - checks >= 5


def stepping_scheduler(service: HiCacheService, seconds: float) -> None:
    """Queue a backup, then step (the scheduler acknowledges it itself), over and over."""
    tokens = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        tokens += 1
        assert put(service, [tokens % 7, tokens % 5])
        service.step()
        service.evict(2)


def test_a_scheduler_that_polls_its_transfers_backs_the_thread_off() -> None:
    """Transfers in flight, and the scheduler steps after each: the thread's passes find
    its polls and back off from the 1 ms poll interval to the 1 s cap, so over 1.5 s it
    passes about 11 times, not 1500, and never polls; once the scheduler is quiet, a queued
    transfer is polled by the thread within the cap."""
    with build_service(make_config()) as service:
        scheduler = threading.Thread(target=stepping_scheduler, args=(service, 1.5))
        scheduler.start()
        scheduler.join()
        # about 11 (10 to reach the cap, then one a second); a loaded machine's stalls may
        # end the backoff now and then
        assert service.stats.background_passes <= 40, service.stats
        assert service.stats.polls <= service.stats.background_passes
        passes = service.stats.background_passes
        wait_for(lambda: service.stats.background_passes > passes)  # a quiet pass
        polls = service.stats.polls
        assert put(service, [9, 9])
        wait_for(lambda: service.stats.polls > polls and not service.controller.num_in_flight)
        assert service.step() == 1  # the thread's ack
        service.check_integrity()

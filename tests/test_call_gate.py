"""An interrupt (a Ctrl-C's KeyboardInterrupt) that lands anywhere in a scheduler call leaves
the service lock and the ack queue free, so that ``stop()``, which runs while the interrupt
propagates, never waits for either. A timer signal raises an exception at a random point of
thousands of calls. (What the interrupted call itself had half done is not promised to be
consistent: the service is being stopped.)

Some library code swallows an exception raised inside it: numpy's ``np.dtype`` runs a Python
helper (``npy_ctypes_check``) and clears whatever it raises, so an interrupt that lands there
never reaches the caller, as a Ctrl-C there would be lost. The loop therefore notes each
interrupt its handler raised and stops on one that was swallowed, instead of waiting for an
exception that will not come (a one-shot timer fires once: the old loop then ran forever)."""

from __future__ import annotations

import random
import signal
import sys
import threading
from types import FrameType

import pytest
import torch
from test_service import make_config, put

from hicache.factory import build_service
from hicache.pools.row_records import row_records

pytestmark = pytest.mark.skipif(sys.platform == "win32" or not hasattr(signal, "setitimer"),
                                reason="needs POSIX interval timers")


class Interrupt(Exception):
    """What the timer's handler raises, as a Ctrl-C raises KeyboardInterrupt."""


class _Timer:
    """The handler of SIGALRM: raises :class:`Interrupt` and notes that it did."""

    def __init__(self) -> None:
        self.raised = False

    def arm(self, delay_s: float) -> None:
        self.raised = False
        signal.setitimer(signal.ITIMER_REAL, delay_s)

    def __call__(self, *_: object) -> None:
        self.raised = True
        raise Interrupt


def test_an_interrupt_anywhere_in_a_call_leaves_the_lock_free() -> None:
    service = build_service(make_config())
    lock = service.service_lock
    rng = random.Random(0)
    timer = _Timer()
    previous = signal.signal(signal.SIGALRM, timer)
    interrupted = swallowed = 0
    try:
        assert put(service, [1, 1, 2, 2])
        for _ in range(3000):
            try:
                timer.arm(rng.uniform(5e-6, 3e-4))
                while not timer.raised:  # short calls: their entries and exits are much of it
                    service.step()
                    service.match([1, 1, 2, 2])
                swallowed += 1  # raised inside library code that cleared it
            except Interrupt:
                interrupted += 1
                # the interrupt's traceback is alive here, as while stop() runs under it
            assert not lock.locked(), "an interrupted call left the service lock held"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupted + swallowed == 3000
    assert interrupted >= 2900, f"only {interrupted} of 3000 interrupts reached the test"
    stopper = threading.Thread(target=service.stop, daemon=True)
    stopper.start()
    stopper.join(timeout=60)
    assert not stopper.is_alive(), "stop() waited for a lock an interrupted call left held"


def test_row_records_run_no_numpy_helper_that_loses_exceptions() -> None:
    """The record views of a CPU pool's rows (made at its first copy) do not run numpy's
    ``npy_ctypes_check``, a Python helper whose exceptions numpy clears:
    ``np.dtype((np.void, n))`` ran it, so an interrupt landing there was lost (the loop of
    the test above saw that about once in eight runs, after other tests)."""
    rows = torch.zeros(8, 6, dtype=torch.bfloat16)
    called: list[str] = []

    def profile(frame: FrameType, event: str, _: object) -> None:
        if event == "call" and "numpy" in frame.f_code.co_filename:
            called.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        records = row_records(rows)
    finally:
        sys.setprofile(None)
    assert "npy_ctypes_check" not in called, called
    rows[5] = 1.5
    records[2] = records[5]  # the records are the pool's rows, 12 bytes each
    assert torch.equal(rows[2], torch.full((6,), 1.5, dtype=torch.bfloat16))
    assert torch.equal(rows[1], torch.zeros(6, dtype=torch.bfloat16))  # only that row

"""A Ctrl-C held back while a thread starts, so that it lands before or after, never inside.

``Thread.start()`` cannot be interrupted safely. A ``KeyboardInterrupt`` raised in the main
thread after the thread was put in ``threading``'s table but before it was launched leaves
a thread that never runs and is listed forever; one raised after the launch but before the
new thread ran leaves a thread that runs although its caller saw ``start()`` fail (so a
``stop()`` does not join it: it goes on serving); one raised inside the wait for it to run
can come out as ``RuntimeError: release unlocked lock`` (``threading.Condition.wait``). So
the service starts its threads inside :func:`interrupts_held`: a Ctrl-C that comes meanwhile
is delivered when the block ends, when the thread runs and is recorded, and ``stop()``
joins exactly the threads that run.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold a SIGINT (a Ctrl-C, ``_thread.interrupt_main()``) that arrives inside the block
    and call the handler it was meant for when the block ends (``KeyboardInterrupt`` with
    Python's). For short blocks that do not wait on anything but a thread starting.

    Only the main thread of the main interpreter has signal handlers: elsewhere no
    ``KeyboardInterrupt`` can be raised, and the block runs as it is.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield  # a default or ignored SIGINT raises nothing in Python code
        return
    held: list[tuple[int, FrameType | None]] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append((signum, frame))

    try:
        signal.signal(signal.SIGINT, hold)
    except ValueError:  # a subinterpreter's main thread: it gets no signals either
        installed = False
    else:
        installed = True
    if not installed:
        yield
        return
    # A SIGINT already pending when the handler changed is run by the new one: held too.
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            previous(*held[0])

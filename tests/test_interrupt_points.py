"""A Ctrl-C at the points of ``start`` and ``stop`` where a service thread is launched or
joined: ``with service`` raises it, and by then no service thread runs and the metrics port
is closed (what ``hicache demo`` relies on to exit with 130 and nothing left behind).

The Ctrl-C is a real one for the interpreter, ``_thread.interrupt_main()`` (SIGINT's
handler raises ``KeyboardInterrupt`` at the main thread's next check), sent from a
monkeypatched call at the chosen point, so no test depends on timing.
"""

from __future__ import annotations

import _thread
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
from test_lifecycle_audit import A, can_bind, free_port, make_config
from thread_helpers import service_thread_names

from hicache import build_service
from hicache.interrupts import interrupts_held

THREADS = ["hicache-service", "hicache-metrics-http"]


def test_a_ctrl_c_inside_the_block_is_raised_when_it_ends() -> None:
    """``interrupts_held``: the block runs to its end, then ``KeyboardInterrupt``."""
    reached = []
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        _thread.interrupt_main()
        for step in range(100):  # calls and loops: where a Ctrl-C would land
            reached.append(step)
    assert reached == list(range(100))


def test_where_no_handler_can_be_installed_the_block_runs_as_it_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A main thread that may not take a SIGINT handler (a subinterpreter's: ``ValueError``)
    runs the block unchanged: one attempt to install, nothing to restore afterwards."""
    attempts = []

    def refused(signum: int, handler: object) -> None:
        attempts.append(handler)
        raise ValueError("signal only works in main thread of the main interpreter")

    monkeypatch.setattr(signal, "signal", refused)
    ran = []
    with interrupts_held():
        ran.append("body")
    assert ran == ["body"] and len(attempts) == 1


@pytest.mark.parametrize("name", THREADS)
def test_a_ctrl_c_as_a_thread_is_launched_leaves_nothing_running(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C right after ``name`` was launched, before it ran a line (where a thread
    would run unjoined, or a listed thread never run): all joined, the port closed."""
    launch = threading._start_new_thread  # type: ignore[attr-defined]

    def launch_then_interrupt(function: Callable[..., Any], args: tuple[Any, ...]) -> int:
        ident = int(launch(function, args))
        thread = getattr(function, "__self__", None)  # Thread._bootstrap, bound
        if isinstance(thread, threading.Thread) and thread.name == name:
            _thread.interrupt_main()
        return ident

    port = free_port()
    service = build_service(make_config(metrics_port=port))
    monkeypatch.setattr(threading, "_start_new_thread", launch_then_interrupt)
    with pytest.raises(KeyboardInterrupt), service:
        pytest.fail("the body ran: the Ctrl-C was lost")
    monkeypatch.undo()
    assert not service_thread_names(), service_thread_names()
    assert can_bind(port)


@pytest.mark.parametrize("name", THREADS)
def test_a_ctrl_c_as_stop_joins_a_thread_finishes_the_stop(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C as ``stop`` starts joining ``name`` (leaving ``with`` normally, where
    nothing calls ``stop`` again): ``stop`` finishes, then raises it."""
    join = threading.Thread.join
    armed = [True]

    def interrupt_then_join(thread: threading.Thread, timeout: float | None = None) -> None:
        if armed and thread.name == name:
            armed.clear()
            _thread.interrupt_main()
        join(thread, timeout)

    port = free_port()
    service = build_service(make_config(metrics_port=port))
    with pytest.raises(KeyboardInterrupt), service:
        monkeypatch.setattr(threading.Thread, "join", interrupt_then_join)
    monkeypatch.undo()
    assert not armed, f"{name} was not joined"
    assert not service_thread_names(), service_thread_names()
    assert can_bind(port)
    with pytest.raises(RuntimeError, match="stopped"):
        service.match(A)

"""The circuit breaker of one storage server: closed until a failure, then open for a backoff
that doubles with each failure in a row up to its cap; one trial call once the backoff has
passed; a success closes it and resets the backoff."""

from __future__ import annotations

import time

import pytest

from hicache.storage.circuit import Circuit

LONG_S = 30.0  # a backoff no test outlives
SHORT_S = 0.02  # one a test sleeps past


@pytest.mark.parametrize("base, cap", [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_backoffs_must_be_positive_and_base_at_most_the_cap(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="need 0 < base_backoff_s <= max_backoff_s"):
        Circuit(base, cap)


def test_a_failure_opens_it_for_its_backoff() -> None:
    circuit = Circuit(LONG_S, LONG_S)
    assert circuit.allow() and not circuit.is_open
    assert circuit.failed() is True  # it was closed
    assert circuit.is_open
    assert not circuit.allow() and not circuit.allow()
    assert circuit.failed() is False  # open already


def test_one_trial_once_the_backoff_has_passed() -> None:
    circuit = Circuit(SHORT_S, LONG_S)
    circuit.failed()
    time.sleep(3 * SHORT_S)
    assert circuit.allow()  # the trial
    assert not circuit.allow()  # the others wait while it tries
    assert circuit.succeeded() is True  # it was open
    assert not circuit.is_open and circuit.allow() and circuit.allow()
    assert circuit.succeeded() is False


def test_the_backoff_doubles_up_to_its_cap_and_a_success_resets_it() -> None:
    circuit = Circuit(0.5, 3.0)
    seen = []
    for _ in range(5):
        circuit.failed()
        seen.append(circuit._backoff_s)  # the next failure's
    assert seen == [1.0, 2.0, 3.0, 3.0, 3.0]
    circuit.succeeded()
    assert circuit._backoff_s == 0.5
    before = time.monotonic()
    circuit.failed()
    assert circuit._open_until is not None
    assert before + 0.5 <= circuit._open_until <= time.monotonic() + 0.5

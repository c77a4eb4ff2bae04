"""The side-stream context of an op's issue (``side_streams._on_stream``) on a CPU, with the
CUDA calls it makes recorded instead of run: with the side stream's device current it sets
the side stream and sets the caller's back, also when the issue raises; with another device
current it leaves both to ``torch.cuda.stream()``, which switches the device too. (The GPU
tests run the first branch on a real stream; the second needs two GPUs.)"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from hicache.controller import side_streams


class Callers:
    """What ``_on_stream`` reads of a :class:`~hicache.pools.current_streams.CurrentStreams`:
    the device index and the caller's current stream."""

    def __init__(self, index: int, previous: object) -> None:
        self.index, self.previous = index, previous

    def current(self) -> object:
        return self.previous


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    log: list[tuple[str, object]] = []

    @contextmanager
    def stream_context(stream: object) -> Iterator[None]:
        log.append(("enter", stream))
        try:
            yield
        finally:
            log.append(("exit", stream))

    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: log.append(("set", stream)))
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    monkeypatch.setattr(side_streams, "_GET_DEVICE", lambda: 0)
    return log


def test_the_side_stream_is_set_and_the_callers_set_back(calls: list[tuple[str, object]]
                                                         ) -> None:
    side, previous = object(), object()
    with side_streams._on_stream(side, Callers(0, previous)):  # type: ignore[arg-type]
        calls.append(("issue", None))
    assert calls == [("set", side), ("issue", None), ("set", previous)]


def test_the_callers_stream_is_set_back_when_the_issue_raises(
        calls: list[tuple[str, object]]) -> None:
    side, previous = object(), object()
    context = side_streams._on_stream(side, Callers(0, previous))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="copy refused"), context:
        raise RuntimeError("copy refused")
    assert calls == [("set", side), ("set", previous)]


def test_another_device_current_goes_through_torchs_context(
        calls: list[tuple[str, object]]) -> None:
    side = object()
    with side_streams._on_stream(side, Callers(1, object())):  # type: ignore[arg-type]
        calls.append(("issue", None))
    assert calls == [("enter", side), ("issue", None), ("exit", side)]


def test_a_cpu_pool_has_no_stream_to_set(calls: list[tuple[str, object]]) -> None:
    with side_streams._on_stream(None, None):
        calls.append(("issue", None))
    assert calls == [("issue", None)]

"""A stream waits once per event record (``StreamWaits``, behind ``wait_until``): a new
record of the same event, or another stream, waits again; repeated asks and the layers
following one group's event cost one wait. Run under compute-sanitizer by
``scripts/gpu_check.sh``."""

from __future__ import annotations

import pytest
import torch

from hicache.controller.events import Event, StreamWaits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLEEP_CYCLES = 20_000_000  # ~10 ms: a reader that does not wait reads the old value


def fill_late(side: torch.cuda.Stream, value: torch.Tensor, number: float, event: Event
              ) -> None:
    """On ``side``: sleep, write ``number`` into ``value``, record ``event``."""
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        value.fill_(number)
        event.record(side)


def test_a_new_record_of_the_same_event_is_waited_on_again() -> None:
    waits, event = StreamWaits(torch.device("cuda")), Event(torch.device("cuda"))
    side, reader = torch.cuda.Stream(), torch.cuda.Stream()
    value = torch.zeros(1, device="cuda")
    seen = []
    for number in (1.0, 2.0):
        side.wait_stream(reader)  # the previous read is over before the next write
        fill_late(side, value, number, event)
        with torch.cuda.stream(reader):
            waits.wait(event)
            waits.wait(event)  # asked again (set_kv, then key_buffer): no second wait
            seen.append(value.clone())
    reader.synchronize()
    assert [float(s) for s in seen] == [1.0, 2.0]


def test_a_wait_on_one_stream_does_not_stand_for_another() -> None:
    waits, event = StreamWaits(torch.device("cuda")), Event(torch.device("cuda"))
    side, first, second = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    value = torch.zeros(1, device="cuda")
    fill_late(side, value, 7.0, event)
    seen = []
    for reader in (first, second):
        with torch.cuda.stream(reader):
            waits.wait(event)
            seen.append(value.clone())
    torch.cuda.synchronize()
    assert [float(s) for s in seen] == [7.0, 7.0]


def test_followers_and_repeats_cost_one_wait_per_record(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    device = torch.device("cuda")
    waits, leader, follower = StreamWaits(device), Event(device), Event(device)
    calls = []
    assert leader._cuda is not None
    real_wait = leader._cuda.wait
    monkeypatch.setattr(leader._cuda, "wait",
                        lambda stream=None: (calls.append(stream), real_wait(stream)))
    leader.record()
    follower.follow(leader)
    for event in (leader, follower, follower, leader):
        waits.wait(event)
    assert len(calls) == 1
    leader.record()  # a new point: waited on once more, through the leader or a follower
    waits.wait(leader)
    waits.wait(follower)
    follower.follow(leader)
    waits.wait(follower)
    assert len(calls) == 2
    torch.cuda.synchronize()

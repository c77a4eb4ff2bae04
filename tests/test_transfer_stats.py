"""TransferStats folds acknowledgements lazily: the scheduler's ``poll`` only appends an
ack; the counters take it when read or every ``FOLD_EVERY`` acks. A metrics reader that
folds and drains on another thread while acks keep coming loses none and counts none twice."""

from __future__ import annotations

import sys
import threading

from hicache.controller import Ack, Direction
from hicache.controller.stats import TransferStats


def ack(number: int) -> Ack:
    return Ack(number, Direction.DEVICE_TO_HOST, [], {"full": 2}, {"full": 64}, 0.5, "torch")


def test_counters_read_the_appended_acks() -> None:
    stats = TransferStats()
    for number in range(3):
        stats.on_ack(ack(number))
    assert stats.ops_acknowledged["device_to_host"] == 3
    assert stats.tokens[("device_to_host", "full")] == 6
    assert stats.bytes[("device_to_host", "full")] == 192
    assert stats.drain_durations() == [("device_to_host", 0.5)] * 3
    assert stats.durations == []


def test_a_reader_on_another_thread_loses_and_doubles_nothing() -> None:
    stats = TransferStats()
    total, drained = 20_000, []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            assert stats.ops_acknowledged["device_to_host"] <= total
            drained.extend(stats.drain_durations())

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for number in range(total):
            stats.on_ack(ack(number))
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(switch)
    drained.extend(stats.drain_durations())
    assert stats.ops_acknowledged["device_to_host"] == total
    assert stats.tokens[("device_to_host", "full")] == 2 * total
    assert len(drained) == total

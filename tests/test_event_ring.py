"""The ring of per-layer event sets on a CPU: it needs two sets at least, and hands its
sets out in turn, each once per turn, at every size the configuration allows."""

from __future__ import annotations

import pytest
import torch

from hicache.controller.events import LayerEventRing

CPU = torch.device("cpu")


def test_a_ring_needs_two_sets() -> None:
    with pytest.raises(ValueError, match="at least 2 sets, got 1"):
        LayerEventRing(1, 4, CPU)


@pytest.mark.parametrize("num_sets", [2, 3, 4, 8])
def test_the_sets_are_handed_out_in_turn(num_sets: int) -> None:
    ring = LayerEventRing(num_sets, 4, CPU)
    taken = []
    for _ in range(2 * num_sets + 1):
        index, events = ring.acquire()
        assert len(events) == 4
        taken.append(index)
    assert taken == [*range(num_sets), *range(num_sets), 0]

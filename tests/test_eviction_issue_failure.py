"""An eviction whose write-back's issue raised (a Ctrl-C inside the copy, a staging
allocation out of memory) freed the device slots it had released but did not count them in
``evicted_device_tokens`` (the metric ``hicache_evicted_tokens{tier="device"}``)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from test_service import make_config, put

from hicache.controller import Direction, TorchBackend
from hicache.controller.base import MovedTransfer
from hicache.factory import build_service


class InterruptedWrite(TorchBackend):
    """The torch backend; a write's copy call is interrupted after its first layer."""

    armed = False

    def copy(self, moved: MovedTransfer, local_layers: Sequence[int], direction: Direction,
             keep_alive: list[torch.Tensor]) -> None:
        if self.armed and direction is Direction.DEVICE_TO_HOST:
            self.armed = False
            super().copy(moved, local_layers[:1], direction, keep_alive)
            raise KeyboardInterrupt
        super().copy(moved, local_layers, direction, keep_alive)


def test_an_eviction_whose_write_back_raised_counts_the_device_tokens_it_freed() -> None:
    service = build_service(make_config("write_back"))
    try:
        backend = service.controller.backend = InterruptedWrite()
        a, b = [1, 2, 3, 4], [5, 6, 7, 8]
        assert put(service, a)
        service.evict(10**6)  # written back, freed at the ack
        service.step()
        match = service.match(a)
        assert service.load_back(match, 16).queued  # back on the device, backed up
        service.start_loading()
        service.step()
        assert put(service, b)  # never backed up
        free_before = service.controller.device_allocator.num_free_tokens
        evicted_before = service.tree.stats.evicted_device_tokens
        backend.armed = True
        with pytest.raises(KeyboardInterrupt):
            service.evict(10**6)  # frees a's device copy, writes b back: that write raises
        freed = service.controller.device_allocator.num_free_tokens - free_before
        assert freed == len(a)
        service.check_integrity()
        assert service.tree.stats.evicted_device_tokens - evicted_before == freed
    finally:
        service.stop()

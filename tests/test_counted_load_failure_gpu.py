"""A counted layer-wise load (the kernel backend: layer 0, then every other layer in one
launch that counts per layer) whose issue raised after a launch had gone: a Ctrl-C landing
just after the launch, or a hybrid model's SWA launch failing after the full pool's. The CPU
kept no count of that launch, so the GPU's counters ran one launch ahead of what the CPU
expected, and every later load's ``wait_until(layer)`` returned before its rows were in
place (the forward read stale rows). The counters are read back after such an error."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import (
    SENTINEL,
    device_rows,
    make_controller,
    make_hybrid,
    written_and_wiped,
)

from hicache.controller import KernelBackend
from hicache.controller.layer_counters import counters_enabled

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or not counters_enabled(),
    reason="needs CUDA and the driver's stream wait on a value")]


def read_behind_busy_caller(ctrl, target, layer, local):  # type: ignore[no-untyped-def]
    """start_loading() with the caller's stream busy (the load waits for it), then on
    another stream wait_until(layer) and read the target's rows of pool-local ``local``."""
    index, forward = target.cuda(), torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    ctrl.start_loading()
    with torch.cuda.stream(forward):
        ctrl.wait_until(layer)
        return local[:, :, index].clone()


@pytest.mark.parametrize("interrupt", [False, True])
def test_wait_until_after_a_counted_load_interrupted_past_its_launch(interrupt):  # type: ignore[no-untyped-def]
    ctrl = make_controller(KernelBackend(16), device="cuda", page_size=2, num_layers=8)
    host, rows = written_and_wiped(ctrl, 32)
    assert ctrl.load(host, "first") is not None
    real, armed = KernelBackend.copy_counted, [1] if interrupt else []

    def interrupted(self, moved, layers, counters):  # type: ignore[no-untyped-def]
        per_layer = real(self, moved, layers, counters)  # launched ...
        if armed:  # ... and a Ctrl-C lands before the call returns
            armed.clear()
            raise KeyboardInterrupt
        return per_layer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KernelBackend, "copy_counted", interrupted)
        if interrupt:
            with pytest.raises(KeyboardInterrupt):
                ctrl.start_loading()
        ctrl.start_loading()  # the retry
    ctrl.drain()
    ctrl.device_pool.data.fill_(SENTINEL)
    second = ctrl.load(host, "second")
    got = read_behind_busy_caller(ctrl, second.tensor, 3, ctrl.device_pool.data)
    torch.cuda.synchronize()
    assert torch.equal(got[:, 3].permute(1, 0, 2).cpu(), rows[:, :, 3])




@pytest.mark.parametrize("fail", [False, True])
def test_wait_until_after_a_hybrid_load_whose_swa_launch_raised(fail):  # type: ignore[no-untyped-def]
    """Model layers 0 and 2 full, 1 and 3 SWA: the counted launch of the full pool goes,
    the SWA pool's raises before it launches; the retry and later loads must still make
    wait_until(2) wait for layer 2's rows."""
    ctrl = make_hybrid(KernelBackend(16), device="cuda")
    pool = ctrl.hybrid_pool
    full = pool.try_alloc(8)
    rows = device_rows(pool.full)[full.tensor]
    host = ctrl.write(full)
    ctrl.drain()
    ctrl.evict_device(full)
    assert ctrl.load(host.full, host.swa, 4) is not None
    real, armed = KernelBackend.copy_counted, [1] if fail else []

    def swa_fails(self, moved, layers, counters):  # type: ignore[no-untyped-def]
        if armed and moved.source.device_pool is pool.swa:
            armed.clear()
            raise RuntimeError("the SWA pool's launch failed")
        return real(self, moved, layers, counters)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KernelBackend, "copy_counted", swa_fails)
        if fail:
            with pytest.raises(RuntimeError, match="SWA"):
                ctrl.start_loading()
        ctrl.start_loading()
    ctrl.drain()
    pool.full.data.fill_(SENTINEL)
    back = ctrl.load(host.full, host.swa, 4)
    got = read_behind_busy_caller(ctrl, back.full.tensor, 2, pool.full.data)
    torch.cuda.synchronize()
    assert torch.equal(got[:, 1].permute(1, 0, 2).cpu(), rows[:, :, 1])  # model layer 2

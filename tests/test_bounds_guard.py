"""BoundsGuard: immediate checks on the CPU, and the deferred protocol CUDA uses, run on the
CPU (``deferred=True``) so every path of it is tested without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

from hicache.pools import DEBUG_CHECKS_ENV, BoundsError, BoundsGuard
from hicache.pools.bounds import RING_ROWS
from hicache.pools.bounds_kernel import kernel_check_available

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def _path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs the deferred check through the Triton kernel (in the interpreter, as
    CI runs it) and through the torch ops; the debug flag is off (it makes checks
    immediate)."""
    monkeypatch.delenv(DEBUG_CHECKS_ENV, raising=False)
    if request.param == "kernel":
        if request.node.get_closest_marker("ring_only"):
            pytest.skip("ring bookkeeping: the torch path covers it (the interpreter is slow)")
        if os.environ.get("TRITON_INTERPRET") != "1" or not kernel_check_available(
                torch.zeros(1)):
            pytest.skip("the kernel path runs on a CPU only under TRITON_INTERPRET=1")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def _deferred() -> BoundsGuard:
    return BoundsGuard("swa", CPU, deferred=True)


def test_immediate_check_returns_the_tensor() -> None:
    """In range: the same tensor comes back, nothing is recorded."""
    guard = BoundsGuard("full", CPU)
    tensor = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert guard.check(tensor, bound=8, op="op") is tensor
    assert guard.num_unread == 0


def test_immediate_check_raises_at_once() -> None:
    """A CPU check names the op, the pool, the value and the range."""
    guard = BoundsGuard("full", CPU)
    with pytest.raises(BoundsError, match=r"^op: slot 8 is out of range for pool 'full' "
                                          r"\(valid slots are 0\.\.7\)"):
        guard.check(torch.tensor([1, 8]), bound=8, op="op")


def test_deferred_check_redirects_offenders_to_padding() -> None:
    """Negative and too-large entries become 0, the rest keep their value, as int64; the
    caller's tensor is not changed."""
    guard = _deferred()
    tensor = torch.tensor([5, -1, 8, 7, -8], dtype=torch.int32)
    safe = guard.check(tensor, bound=8, op="set_kv(layer=1)")
    assert safe.dtype == torch.int64
    assert safe.tolist() == [5, 0, 0, 7, 0]
    assert tensor.tolist() == [5, -1, 8, 7, -8]


def test_deferred_error_surfaces_once_naming_op_value_and_bound() -> None:
    """The first bad check is raised by raise_if_tripped, once; a clean one raises nothing."""
    guard = _deferred()
    guard.check(torch.tensor([1, 2]), bound=8, op="first")
    guard.check(torch.tensor([1, -3, 9]), bound=8, op="set_kv(layer=1)")
    with pytest.raises(BoundsError, match=r"^set_kv\(layer=1\): slot -3 is negative for pool "
                                          r"'swa' \(valid slots are 0\.\.7\).*redirected to "
                                          r"the padding slot 0"):
        guard.raise_if_tripped()
    guard.raise_if_tripped()
    assert guard.num_unread == 0


def test_deferred_error_names_a_value_past_the_end() -> None:
    """Only a too-large value: the error names it exactly (from its excess)."""
    guard = _deferred()
    guard.check(torch.tensor([[3, 12]]), bound=7, op="translate_page_table", unit="page")
    with pytest.raises(BoundsError, match=r"translate_page_table: page 12 is out of range for "
                                          r"pool 'swa' \(valid pages are 0\.\.6\)"):
        guard.raise_if_tripped()


def test_every_bad_check_is_reported_in_order() -> None:
    """Two bad checks give two errors, oldest first."""
    guard = _deferred()
    guard.check(torch.tensor([9]), bound=8, op="a")
    guard.check(torch.tensor([-2]), bound=8, op="b")
    with pytest.raises(BoundsError, match=r"^a: slot 9"):
        guard.raise_if_tripped()
    with pytest.raises(BoundsError, match=r"^b: slot -2"):
        guard.raise_if_tripped()
    guard.raise_if_tripped()


def test_pending_record_is_not_read() -> None:
    """A record the device has not written yet (both words still pending, or only one of
    them) stops the reader; it is read once written."""
    guard = _deferred()
    guard.check(torch.tensor([9]), bound=8, op="late")
    assert guard._records is not None
    written = guard._records[0].copy()
    guard._records[0] = (1, -1)
    guard.raise_if_tripped()
    guard._records[0] = (0, -1)  # one word landed, the other not yet
    guard.raise_if_tripped()
    guard._records[0] = (1, written[1])  # the other order
    guard.raise_if_tripped()
    assert guard.num_unread == 1
    guard._records[0] = written
    with pytest.raises(BoundsError, match=r"^late: slot 9"):
        guard.raise_if_tripped()


@pytest.mark.ring_only
def test_ring_wraps_and_reads_every_check() -> None:
    """More checks than ring rows, read as they go: the bad one after the wrap is found."""
    guard = _deferred()
    for _ in range(RING_ROWS + 5):
        guard.check(torch.tensor([1]), bound=8, op="clean")
        guard.raise_if_tripped()
    guard.check(torch.tensor([8]), bound=8, op="wrapped")
    with pytest.raises(BoundsError, match=r"^wrapped: slot 8"):
        guard.raise_if_tripped()


@pytest.mark.ring_only
def test_full_ring_reads_before_reusing_a_row() -> None:
    """A full ring of unread checks is read before a row is reused, so no bad check is lost
    (the error is raised by the check that needed the row)."""
    guard = _deferred()
    guard.check(torch.tensor([-1]), bound=8, op="oldest")
    for _ in range(RING_ROWS - 1):
        guard.check(torch.tensor([1]), bound=8, op="clean")
    with pytest.raises(BoundsError, match=r"^oldest: slot -1"):
        guard.check(torch.tensor([1]), bound=8, op="clean")


@pytest.mark.ring_only
def test_a_check_reads_the_ring_only_when_it_is_full() -> None:
    """Checks read back as they go never fill the ring, however many were made: a later
    check with room in the ring neither waits nor raises an earlier check's error (on CUDA
    that wait is a synchronisation); the poll does."""
    guard = _deferred()
    for _ in range(RING_ROWS // 2 + 1):
        guard.check(torch.tensor([1]), bound=8, op="clean")
    guard.raise_if_tripped()
    guard.check(torch.tensor([8]), bound=8, op="bad")
    guard.check(torch.tensor([1]), bound=8, op="clean")
    assert guard.num_unread == 2
    with pytest.raises(BoundsError, match=r"^bad: slot 8"):
        guard.raise_if_tripped()
    guard.raise_if_tripped()
    assert guard.num_unread == 0


def test_empty_input_is_a_no_op() -> None:
    """Nothing to check: no record, the tensor comes back."""
    guard = _deferred()
    empty = torch.empty(0, dtype=torch.int64)
    assert guard.check(empty, bound=8, op="op") is empty
    assert guard.num_unread == 0


def test_debug_flag_makes_deferred_checks_immediate(monkeypatch: pytest.MonkeyPatch) -> None:
    """HICACHE_DEBUG_CHECKS=1 raises at the offending call instead of at the next poll."""
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "1")
    guard = _deferred()
    with pytest.raises(BoundsError, match=r"^op: slot 8"):
        guard.check(torch.tensor([8]), bound=8, op="op")


# ---- where deferred errors surface: the controller's poll() and the service's step() -------


def test_controller_poll_raises_a_deferred_error_and_keeps_its_acks() -> None:
    """A bad slot in set_kv raises nothing at the call (deferred, as on CUDA); poll() raises
    it naming the op, and the next poll() returns the acks it held back."""
    from controller_helpers import make_controller

    from hicache.controller import TorchBackend
    from hicache.pools import IndexSpace, Indices

    ctrl = make_controller(TorchBackend())
    pool = ctrl.device_pool
    pool.guard = BoundsGuard("full", CPU, deferred=True)
    slots = ctrl.device_allocator.try_alloc(2)
    assert slots is not None and ctrl.write(slots) is not None
    ctrl.start_writing()
    rows = torch.zeros(2, 2, 4)
    before = pool.data.clone()
    bad = Indices(torch.tensor([5, -1]), IndexSpace.DEVICE_FULL)
    pool.set_kv(0, bad, rows, rows)
    expected = before.clone()
    expected[:, 0, 5] = 0  # the valid row; -1 went to the padding row, which was cleared
    expected[:, 0, 0] = 0
    assert torch.equal(pool.data, expected)  # the last slot (-1) untouched
    with pytest.raises(BoundsError, match=r"set_kv\(layer=0\): slot -1 is negative for pool "
                                          r"'full'"):
        ctrl.poll()
    assert len(ctrl.poll()) == 1
    ctrl.raise_if_tripped()


def test_service_step_raises_a_deferred_error_not_the_background_thread() -> None:
    """The background poller never raises a bounds error (the service stays usable); step()
    raises it once, and the next step() works."""
    from test_service import full_pool, make_config, put, wait_for

    from hicache.factory import build_service
    from hicache.pools import IndexSpace, Indices

    with build_service(make_config(interval_s=0.01)) as service:
        pool = full_pool(service)
        pool.guard = BoundsGuard("full", CPU, deferred=True)
        rows = torch.zeros(1, 1, 2)
        pool.set_kv(1, Indices(torch.tensor([pool.num_slots]), IndexSpace.DEVICE_FULL),
                    rows, rows)
        assert put(service, [1, 1])  # a backup in flight: the thread polls it
        wait_for(lambda: service.stats.polls >= 1 and not service.controller.num_in_flight)
        assert service.stats.background_errors == 0
        with pytest.raises(BoundsError, match=rf"slot {pool.num_slots} is out of range"):
            service.step()
        assert service.step() == 1  # the backup's ack, which the thread queued
        service.check_integrity()

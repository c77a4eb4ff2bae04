"""hicache's own streams on a GPU: none is ever a stream that ``torch.cuda.Stream()`` hands
an engine, they never wait for the legacy default stream, one controller's are distinct,
and the pool hands them out round robin."""

from __future__ import annotations

import time

import pytest
import torch
from test_layouts import controller, random_pages

from hicache.controller import stream_pool
from hicache.controller.staged import StagedBackend
from hicache.controller.stream_pool import POOL_SIZE, StreamPool, cache_stream
from hicache.pools import HostLayout

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def torch_pool_handles(count: int = 3 * 32) -> set[int]:
    """Handles of ``count`` streams from torch's pool (its 32 of the default priority come
    round more than once), as an engine making its own streams gets them."""
    return {torch.cuda.Stream().cuda_stream for _ in range(count)}


@pytest.mark.gpu
@needs_gpu
def test_a_controllers_streams_are_distinct_and_none_is_torchs() -> None:
    """Side, auxiliary and copy streams of a staged controller that moved pages both ways:
    all distinct, none an engine's torch stream (made before and after the controller) nor
    the default stream."""
    before = torch_pool_handles()
    backend = StagedBackend(staging_tokens=16)
    ctrl = controller(backend, HostLayout.PAGE_FIRST_DIRECT, 16, device="cuda")
    host = ctrl.write(random_pages(ctrl, 5, seed=1))
    assert host is not None
    ctrl.start_writing()
    ctrl.drain()
    assert ctrl.load(host) is not None
    ctrl.start_loading()
    ctrl.drain()
    torch.cuda.synchronize()
    lanes = list(backend._lanes.values())
    assert lanes, "the round trip made no staging lane"
    handles = [ctrl.write_stream.cuda_stream, ctrl.load_stream.cuda_stream]
    for lane in lanes:
        handles += [lane.aux.cuda_stream, *(c.cuda_stream for c in lane.copiers)]
    after = torch_pool_handles()
    assert len(set(handles[:2])) == 2
    for lane_start in range(2, len(handles), 3):
        assert len(set(handles[lane_start:lane_start + 3])) == 3
    default = torch.cuda.default_stream().cuda_stream
    for handle in handles:
        assert handle not in before | after | {default}


@pytest.mark.gpu
@needs_gpu
def test_pool_hands_out_round_robin() -> None:
    """A fresh pool: POOL_SIZE distinct streams, then the first again; a second device
    index would have its own (one device here)."""
    pool = StreamPool()
    device = torch.device("cuda", torch.cuda.current_device())
    first = [pool.stream(device) for _ in range(POOL_SIZE)]
    assert len({s.cuda_stream for s in first}) == POOL_SIZE
    again = [pool.stream(device) for _ in range(POOL_SIZE)]
    assert [s.cuda_stream for s in again] == [s.cuda_stream for s in first]
    assert not {s.cuda_stream for s in first} & torch_pool_handles()


@pytest.mark.gpu
@needs_gpu
def test_a_cache_stream_never_waits_for_the_default_stream() -> None:
    """A cache stream's copy finishes while a long kernel still runs on the legacy default
    stream (a blocking stream would wait for it)."""
    stream = cache_stream(torch.device("cuda"))
    src = torch.ones(1 << 16, device="cuda")
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.default_stream()):
        torch.cuda._sleep(2_000_000_000)  # about a second of spinning
        busy = torch.cuda.Event()
        busy.record()
    copied = torch.cuda.Event()
    with torch.cuda.stream(stream):
        dst.copy_(src)
        copied.record()
    deadline = time.monotonic() + 0.5
    while not copied.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert copied.query(), "the cache stream's copy waited for the default stream"
    assert not busy.query(), "the default stream's kernel ended too soon to tell"
    torch.cuda.synchronize()
    assert torch.equal(dst, src)


def test_cpu_device_is_refused() -> None:
    """A CPU device has no streams: a clear error (runs without CUDA)."""
    pool = StreamPool()
    with pytest.raises(ValueError, match="CUDA device"):
        pool.stream(torch.device("cpu"))
    assert not pool._streams and not pool._turns  # nothing made, no turn taken


@pytest.mark.gpu
@needs_gpu
def test_without_a_runtime_library_torchs_streams_serve_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No CUDA runtime library found (a build that links it statically): the pool falls back
    to torch's streams and says what that risks."""
    monkeypatch.setattr(stream_pool, "cuda_runtime", lambda: None)
    with caplog.at_level("WARNING", logger=stream_pool.__name__):
        stream = StreamPool().stream(torch.device("cuda"))
    assert not isinstance(stream, torch.cuda.ExternalStream)
    assert "torch's stream pool" in caplog.text


class _RefusingRuntime:
    """A runtime whose stream creation fails as an exhausted device's does."""

    def __init__(self) -> None:
        self.cudaStreamCreateWithFlags = lambda handle, flags: 2  # cudaErrorMemoryAllocation


@pytest.mark.gpu
@needs_gpu
def test_a_refused_stream_creation_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The error names the call, its status and the device; the pool is as it was, so the
    next stream, once the runtime makes them again, is its first."""
    pool = StreamPool()
    monkeypatch.setattr(stream_pool, "cuda_runtime", _RefusingRuntime)
    with pytest.raises(RuntimeError, match="cudaStreamCreateWithFlags failed with error 2"):
        pool.stream(torch.device("cuda"))
    monkeypatch.undo()
    first = pool.stream(torch.device("cuda"))
    assert [pool.stream(torch.device("cuda")) for _ in range(POOL_SIZE - 1)][-1] is not first
    assert pool.stream(torch.device("cuda")) is first

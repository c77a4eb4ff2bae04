"""Index uploads through reused pinned buffers (``PinnedUploads``): the values arrive (by the
copy engine up to ``INLINE_BYTES``, by the upload kernel beyond), a buffer is reused only
once the copy that read it is done, a busy one is never written, the kept buffers stay
bounded, and an upload issued while a staged load's copies are queued does not wait for
them. Run under compute-sanitizer by ``scripts/gpu_check.sh``."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from gpu_shapes import scaled, under_sanitizer

from hicache.controller import CacheController
from hicache.controller.staged import StagedBackend
from hicache.pools import (
    AttentionKind,
    DeviceKVPool,
    HostKVPool,
    HostLayout,
    IndexSpace,
    PageAllocator,
    RowGeometry,
)
from hicache.pools.pinned_uploads import MAX_BUFFERS, MIN_ELEMS, PinnedUploads
from hicache.pools.upload_kernel import INLINE_BYTES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# ~25 ms on the stream before a copy, so its buffer stays busy; ~1 s under the sanitizer,
# where each upload's launch alone can take longer than 25 ms
SLEEP_CYCLES = scaled(50_000_000, 2_000_000_000)
CUDA = torch.device("cuda")


def test_parts_arrive_one_after_another_as_int64() -> None:
    uploads = PinnedUploads()
    host = np.arange(5, dtype=np.int32) + 7
    device = np.array([2**40, 3], dtype=np.int64)
    got = uploads.upload((host, device), CUDA)
    assert got.device.type == "cuda" and got.dtype == torch.int64
    assert got.cpu().tolist() == [7, 8, 9, 10, 11, 2**40, 3]


def test_a_done_buffer_is_reused_and_a_large_upload_gets_a_larger_one() -> None:
    uploads = PinnedUploads()
    first = uploads.upload((np.arange(10),), CUDA)
    torch.cuda.synchronize()
    assert uploads.pinned_bytes() == MIN_ELEMS * 8
    second = uploads.upload((np.arange(20) * 2,), CUDA)
    torch.cuda.synchronize()
    assert uploads.pinned_bytes() == MIN_ELEMS * 8  # the same buffer again
    big = uploads.upload((np.arange(3 * MIN_ELEMS),), CUDA)
    torch.cuda.synchronize()
    assert first.cpu().tolist() == list(range(10))
    assert second.cpu().tolist() == [2 * i for i in range(20)]
    assert big.cpu().tolist() == list(range(3 * MIN_ELEMS))
    assert uploads.pinned_bytes() == (MIN_ELEMS + 4 * MIN_ELEMS) * 8


def test_buffers_are_pinned_powers_of_two_and_an_exact_fit_is_reused() -> None:
    """A buffer of exactly the upload's size is reused; a new one is the smallest power of
    two that holds the upload (one element past a power of two doubles it); every buffer
    is page-locked (a pageable one would make the copy wait for the stream)."""
    uploads = PinnedUploads()
    for count, kept in [(MIN_ELEMS, MIN_ELEMS), (MIN_ELEMS, MIN_ELEMS),
                        (2 * MIN_ELEMS, 3 * MIN_ELEMS), (2 * MIN_ELEMS + 1, 7 * MIN_ELEMS)]:
        values = np.arange(count, dtype=np.int64) * 5 + count
        got = uploads.upload((values,), CUDA)
        torch.cuda.synchronize()
        assert np.array_equal(got.cpu().numpy(), values)
        assert uploads.pinned_bytes() == kept * 8
    assert all(buffer.tensor.is_pinned() for buffer in uploads._buffers)


def test_a_buffer_whose_copy_has_not_run_is_not_written() -> None:
    """The stream sleeps before the first copy, so its buffer is busy when the second
    upload comes: the second takes a new buffer, and the first copy still reads its own
    values."""
    uploads = PinnedUploads()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        first = uploads.upload((np.full(100, 1),), CUDA)
        second = uploads.upload((np.full(100, 2),), CUDA)
    assert not stream.query(), "the sleep ended before the second upload: raise SLEEP_CYCLES"
    stream.synchronize()
    assert first.cpu().tolist() == [1] * 100
    assert second.cpu().tolist() == [2] * 100
    assert uploads.pinned_bytes() == 2 * MIN_ELEMS * 8


def test_kept_buffers_stay_bounded_when_every_one_is_busy() -> None:
    uploads = PinnedUploads()
    stream = torch.cuda.Stream()
    results = []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        for value in range(3 * MAX_BUFFERS):
            results.append(uploads.upload((np.full(64, value),), CUDA))
    stream.synchronize()
    assert [r.cpu().tolist() for r in results] == [[v] * 64 for v in range(3 * MAX_BUFFERS)]
    assert uploads.pinned_bytes() <= MAX_BUFFERS * MIN_ELEMS * 8


def test_threads_uploading_at_once_each_get_their_values() -> None:
    uploads = PinnedUploads()
    failures: list[str] = []

    def worker(seed: int) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for step in range(50):
                values = np.arange(300) + seed * 1000 + step
                got = uploads.upload((values[:100], values[100:]), CUDA)
                if got.cpu().tolist() != values.tolist():
                    failures.append(f"thread {seed} step {step}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


@pytest.mark.parametrize("count", [INLINE_BYTES // 8 + 1, 3 * MIN_ELEMS + 5, 40_000])
def test_uploads_beyond_the_inline_size_arrive_through_the_kernel(count: int) -> None:
    uploads = PinnedUploads()
    values = np.arange(count, dtype=np.int64) * 3 - 2**40
    values[:7] = np.arange(7) - 3  # an int32 part first, then int64 values beyond int32
    got = uploads.upload((values[:7].astype(np.int32), values[7:]), CUDA)
    assert got.device.type == "cuda" and got.dtype == torch.int64
    assert np.array_equal(got.cpu().numpy(), values)


def test_a_busy_buffer_is_not_written_by_a_large_upload_either() -> None:
    """As the small-buffer test, at a size the kernel carries: the kernel reads the
    buffer on the stream after the sleep, so the second upload must take another one."""
    uploads = PinnedUploads()
    count = 2 * INLINE_BYTES // 8
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        first = uploads.upload((np.full(count, 1),), CUDA)
        second = uploads.upload((np.full(count, 2),), CUDA)
    assert not stream.query(), "the sleep ended before the second upload: raise SLEEP_CYCLES"
    stream.synchronize()
    assert first.cpu().tolist() == [1] * count
    assert second.cpu().tolist() == [2] * count


@pytest.mark.skipif(under_sanitizer(), reason="the sanitizer serialises the GPU's work")
def test_an_upload_does_not_wait_for_a_queued_load() -> None:
    """A 1 GiB staged load (32 copies queued on the copy engine, about 20 ms) is issued,
    then 128 KiB of indices are uploaded on the caller's stream: the upload is done while
    the load is still in flight. Through the copy engine it finished with the load."""
    geometry = RowGeometry(AttentionKind.MHA, 8, 128, 0, torch.bfloat16)
    tokens, page, layers = 8192, 16, 32
    allocator = PageAllocator(2 * tokens // page + 1, page, IndexSpace.DEVICE_FULL, "full")
    device_pool = DeviceKVPool(name="full", space=IndexSpace.DEVICE_FULL, num_layers=layers,
                               num_slots=allocator.num_slots, geometry=geometry, device=CUDA)
    host_pool = HostKVPool(name="full", space=IndexSpace.HOST_FULL, num_layers=layers,
                           num_pages=tokens // page + 1, page_size=page, geometry=geometry,
                           layout=HostLayout.PAGE_FIRST_DIRECT)
    controller = CacheController(device_pool=device_pool, device_allocator=allocator,
                                 host_pool=host_pool, backend=StagedBackend(1024))
    try:
        source = allocator.try_alloc(tokens)
        assert source is not None
        host = controller.write(source)
        assert host is not None
        controller.start_writing()
        controller.drain()
        controller.evict_device(source)
        loaded = controller.load(host)
        assert loaded is not None
        controller.start_loading()
        values = np.arange(4 * INLINE_BYTES // 8)
        got = PinnedUploads().upload((values,), CUDA)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        controller.poll()
        assert controller.num_in_flight == 1, "the load finished before the upload"
        controller.drain()
        assert np.array_equal(got.cpu().numpy(), values)
    finally:
        torch.cuda.synchronize()
        host_pool.close()

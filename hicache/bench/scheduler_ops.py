"""``hicache bench scheduler``'s figures of the pools and the controller: one-page and
many-page allocations, a controller op's bookkeeping (with its CPU copy timed apart) and
the poll that acknowledges it. Tree-free: each runs on a fresh allocator or service."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hicache.controller import CacheController
from hicache.pools import IndexSpace, Indices, PageAllocator

from .scheduler import PAGE, few_calls, make_service, timed


def measure_allocator(repeats: int) -> dict[str, list[float]]:
    """One-page allocations from a 1M-token pool, fresh and fragmented (every other page
    free), and a 2048-page one from the fragmented pool (2048 runs of one page)."""
    fresh = PageAllocator(65_536, PAGE, IndexSpace.DEVICE_FULL, "full")
    holey = PageAllocator(65_536, PAGE, IndexSpace.DEVICE_FULL, "full")
    every = holey.try_alloc(65_536 * PAGE)
    assert every is not None
    holey.free(Indices(every.tensor.view(-1, 2 * PAGE)[:, :PAGE].reshape(-1),
                       IndexSpace.DEVICE_FULL))

    def one(allocator: PageAllocator) -> Callable[[], None]:
        def call() -> None:
            got = allocator.try_alloc(PAGE)
            assert got is not None
            allocator.free(got)
        return call

    def many() -> None:  # a 32k-token load into a fragmented pool: 2048 one-page holes
        got = holey.try_alloc(2048 * PAGE)
        assert got is not None
        holey.free(got)

    return {"allocate + free 1 page, 1M-token pool": timed(one(fresh), repeats),
            "the same, pool fragmented": timed(one(holey), repeats),
            "allocate + free 2048 pages, fragmented": timed(many, few_calls(repeats, 5))}


def measure_controller(repeats: int) -> dict[str, list[float]]:
    """Controller bookkeeping of one write op (1 and 256 pages: write, start_writing, the
    poll that acknowledges it; rows of 8 bytes) and the poll per acknowledged op.

    A CPU pool's "transfer" is a synchronous row copy inside ``start_writing``; the issue's
    figure is the bookkeeping with the copy excluded, so the backend's copies are timed too
    (:class:`CopyClock`) and each op's are subtracted from its time. The op with its copy
    is reported beside it."""
    service = make_service(capacity_tokens=1 << 16, host_ratio=1.0)
    controller = service.controller
    assert isinstance(controller, CacheController), "the benchmark's model has no SWA layers"
    clock = CopyClock(controller)
    out: dict[str, list[float]] = {}
    try:
        for num_pages in (1, 256):
            device = controller.device_allocator.try_alloc(num_pages * PAGE)
            assert device is not None
            host: list[Indices] = []
            copies: list[float] = []

            def cycle(device: Indices = device, host: list[Indices] = host,
                      copies: list[float] = copies) -> None:
                before = clock.ns
                slots = controller.write(device)
                assert slots is not None
                controller.start_writing()
                assert controller.poll()
                host.append(slots)
                copies.append((clock.ns - before) / 1e3)

            def release(host: list[Indices] = host) -> None:
                while host:
                    controller.evict_host(host.pop())

            whole = timed(cycle, repeats, before=release)
            release()
            out[f"controller op, {num_pages} page(s), with its copy"] = whole
            out[f"controller op, {num_pages} page(s), copy excluded"] = [
                total - copy for total, copy in zip(whole, copies, strict=True)]
        device = controller.device_allocator.try_alloc(PAGE)
        assert device is not None
        polls = []
        for _ in range(repeats):
            slots = controller.write(device)
            assert slots is not None
            controller.start_writing()
            start = time.perf_counter_ns()
            assert len(controller.poll()) == 1
            polls.append((time.perf_counter_ns() - start) / 1e3)
            controller.evict_host(slots)
        out["poll() per acknowledged op"] = polls
        return out
    finally:
        service.stop()


class CopyClock:
    """Nanoseconds ``controller``'s backend spent in ``copy`` (the row copies), summed in
    :attr:`ns`: the backend's ``copy`` is wrapped, for this benchmark's service only."""

    def __init__(self, controller: CacheController) -> None:
        self.ns = 0
        copy = controller.backend.copy

        def timed_copy(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter_ns()
            try:
                copy(*args, **kwargs)
            finally:
                self.ns += time.perf_counter_ns() - start

        controller.backend.copy = timed_copy  # type: ignore[method-assign]

"""The scheduler's turns while the store works: the last figures of ``hicache bench storage``.

A store's worker threads share the interpreter with the engine's scheduler thread: whatever
Python they run between their I/O, the scheduler waits for. A loop stands for the scheduler
(a turn: a 0.5 ms wait that releases the GIL, as a wait for the GPU's step does, then about
0.1 ms of Python, timed together) and runs alone, then while a worker thread puts, gets and
deletes a host pool's pages through a store (the file store, Redis), as the store tier's
jobs do (:func:`hicache.storage.host_page_views` of the pool, checksums on). Per host
layout: a ``layer_first`` page is one segment per component and layer (64 for this 32-layer
model), a ``page_first_direct`` page is one.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

from ..pools import AttentionKind, HostKVPool, HostLayout, IndexSpace, Indices, RowGeometry
from ..storage import Namespace, PageStatus, chain_page_hashes, host_page_views, open_store
from .scheduler_thread import p99
from .storage import HEAD_DIM, HEADS, LAYERS, Row

LAYOUTS = (HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST_DIRECT)
WAIT_S = 0.0005
PYTHON_STEPS = 2000  # about 0.1 ms of bytecode on a current x86 core
REFERENCE = "the same turn, the store idle"


def scheduler_turns(count: int) -> list[float]:
    """``count`` turns' times in microseconds."""
    times = []
    for _ in range(count):
        started = time.perf_counter_ns()
        time.sleep(WAIT_S)
        total = 0
        for step in range(PYTHON_STEPS):
            total += step
        times.append((time.perf_counter_ns() - started) / 1e3)
    return times


def measure_turns(store_name: str, location: str, layout: HostLayout, page_tokens: int,
                  num_pages: int, turns: int) -> list[Row]:
    """The turn's mean, median and 99th percentile alone and while the store at
    ``location`` (``open_store``'s: a directory or a Redis URL, opened with its defaults)
    moves ``num_pages`` pages of a ``layout`` host pool, as three rows (the value with the
    store working, the reference alone; their ratio is 1.00 when the store costs the
    scheduler nothing), and a fourth: the bytes the store put and got a second meanwhile
    (whole rounds of a put and a get of every page). The namespace is cleared after."""
    pool = _pool(layout, page_tokens, num_pages)
    namespace = Namespace.for_host_pool(pool, model_id="bench/model",
                                        model_revision=f"turns-{layout.value}")
    slots = Indices(torch.arange(pool.num_slots), IndexSpace.HOST_FULL)
    tokens = torch.randint(0, 100_000, (pool.num_slots,),
                           generator=torch.Generator().manual_seed(1))
    keys = chain_page_hashes(tokens, page_tokens)
    stop = threading.Event()
    errors: list[str] = []
    rounds = [0]
    with open_store(location, namespace) as store:
        def work() -> None:
            while not stop.is_set():
                for result in (store.put(keys, host_page_views(pool, slots), timeout_s=60),
                               store.get(keys, host_page_views(pool, slots), timeout_s=60)):
                    if any(s is not PageStatus.OK for s in result.statuses):
                        errors.append(result.error or "a page was not moved")
                        return
                store.delete(keys)
                rounds[0] += 1

        alone = scheduler_turns(turns)
        worker = threading.Thread(target=work, name="hicache-bench-store", daemon=True)
        started, first = time.perf_counter(), 0
        worker.start()
        try:
            # its first round (connections made, files opened) before the window: a short
            # window could otherwise hold no whole round, and the figure read 0
            warm = time.perf_counter() + 30
            while rounds[0] == 0 and not errors and time.perf_counter() < warm:
                time.sleep(0.001)
            started, first = time.perf_counter(), rounds[0]
            working = scheduler_turns(turns)
        finally:
            stop.set()
            elapsed = time.perf_counter() - started
            done = rounds[0] - first  # the rounds the window holds: not one ending after it
            worker.join()
        store.clear()
    if errors:
        raise RuntimeError(f"{store_name} store, {layout.value}: {errors[0]}")
    kib = namespace.page_bytes >> 10
    moved = 2 * done * len(keys) * namespace.page_bytes / 1e9 / elapsed
    return [*(Row(store_name, kib, f"turn {name} us, {layout.value}", pick(working),
                  pick(alone), REFERENCE) for name, pick in (("mean", statistics.fmean),
                                                             ("p50", statistics.median),
                                                             ("p99", p99))),
            Row(store_name, kib, f"put+get GB/s, {layout.value}", moved, None, "")]


def _pool(layout: HostLayout, page_tokens: int, num_pages: int) -> HostKVPool:
    """A host pool of the bench's model with random rows."""
    geometry = RowGeometry(kind=AttentionKind.MHA, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                           latent_dim=0, dtype=torch.bfloat16)
    pool = HostKVPool(name="full", space=IndexSpace.HOST_FULL, num_layers=LAYERS,
                      num_pages=num_pages, page_size=page_tokens, geometry=geometry,
                      layout=layout, pin=False)
    data = pool.data.view(torch.int16)
    data.copy_(torch.randint(-2**15, 2**15, data.shape, dtype=torch.int16,
                             generator=torch.Generator().manual_seed(0)))
    return pool

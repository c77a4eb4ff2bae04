"""Benchmark workloads: pools, random page-granular device slots, and ops driven through the
real :class:`~hicache.controller.CacheController`.

Device slots are whole pages in random order (``Slots``): writes read a random set of pages;
loads land in another, disjoint random set, which is all the device allocator has free, so
``load()`` allocates exactly those pages. Host slots are what the controller's host allocator
hands out (in a fresh pool: runs of consecutive pages). Pools hold two transfers' worth of
slots plus a little, so a write and a load can run at once.

Runs on a CPU too (synchronous moves, no timings), which is how the tests exercise it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hicache.controller import (
    CacheController,
    Direction,
    TransferBackend,
    TransferOp,
    TransferStats,
)
from hicache.pools import (
    AttentionKind,
    DeviceKVPool,
    HostKVPool,
    HostLayout,
    IndexSpace,
    Indices,
    PageAllocator,
    RowGeometry,
)

DTYPE = torch.bfloat16
MAX_BATCH_OPS = 48


class BenchmarkError(RuntimeError):
    """A backend moved wrong bytes, or the setup cannot run. Aborts the benchmark."""


@dataclass(frozen=True)
class Shape:
    """What moves: ``tokens`` tokens of ``layers`` layers of K and V rows of ``heads`` x
    ``head_dim`` bf16 (MHA). ``max_page_size``: pools are whole pages of it."""

    tokens: int
    layers: int
    heads: int
    head_dim: int
    max_page_size: int

    @property
    def geometry(self) -> RowGeometry:
        return RowGeometry(AttentionKind.MHA, self.heads, self.head_dim, 0, DTYPE)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token over every layer, K and V."""
        return self.geometry.token_bytes(self.layers)

    @property
    def transfer_bytes(self) -> int:
        return self.tokens * self.token_bytes

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of a transfer (what layer 0 of a load waits for)."""
        return self.tokens * self.geometry.token_bytes(1)

    @property
    def pool_pages(self) -> int:
        """Usable pages of ``max_page_size`` per pool: two transfers plus 1/32 spare."""
        pages = -(-self.tokens // self.max_page_size)
        return 2 * pages + max(1, pages // 32)


def make_device_pool(shape: Shape, device: torch.device | str) -> DeviceKVPool:
    """The device pool every session shares (``DEVICE_FULL``, ``shape.pool_pages`` pages)."""
    return DeviceKVPool(
        name="bench", space=IndexSpace.DEVICE_FULL, num_layers=shape.layers,
        num_slots=(shape.pool_pages + 1) * shape.max_page_size, geometry=shape.geometry,
        device=device,
    )


def make_host_pool(shape: Shape, layout: HostLayout, pin: bool,
                   page_size: int | None = None) -> HostKVPool:
    """A host pool of ``layout`` with as many usable tokens as the device pool, in pages of
    ``page_size`` (default ``shape.max_page_size``, a divisor of it)."""
    page = shape.max_page_size if page_size is None else page_size
    if shape.max_page_size % page:
        raise BenchmarkError(f"host page size {page} does not divide {shape.max_page_size}")
    return HostKVPool(
        name="bench", space=IndexSpace.HOST_FULL, num_layers=shape.layers,
        num_pages=shape.pool_pages * (shape.max_page_size // page), page_size=page,
        geometry=shape.geometry, layout=layout, pin=pin,
    )


def host_page_sizes(layout: HostLayout, page_sizes: list[int]) -> list[tuple[int, list[int]]]:
    """``(host page size, case page sizes)`` per host pool a layout is measured with: one pool
    of the largest page size for every case, except ``page_first_direct``, whose bytes depend
    on the host page size (one layer of a page is one block): one pool per page size."""
    if layout is HostLayout.PAGE_FIRST_DIRECT:
        return [(page, [page]) for page in page_sizes]
    return [(max(page_sizes), list(page_sizes))]


@dataclass
class Slots:
    """Device slots of one page size.

    ``allocator``: the device allocator with every page allocated except the load
    destinations (random pages). ``write_source``: ``[tokens]`` int64 CPU slots, random whole
    pages in random order, disjoint from the load destinations.
    """

    page_size: int
    allocator: PageAllocator
    write_source: torch.Tensor


def make_slots(device_pool: DeviceKVPool, page_size: int, tokens: int,
               gen: torch.Generator, runs: bool = False) -> Slots:
    """Random page-granular write sources and load destinations of ``tokens`` each; with
    ``runs``, each one run of consecutive pages instead (what a fresh allocation is: the
    direct backend's case)."""
    if tokens % page_size:
        raise BenchmarkError(f"{tokens} tokens are not whole pages of {page_size}")
    allocator = PageAllocator(device_pool.num_slots // page_size - 1, page_size,
                              IndexSpace.DEVICE_FULL, "bench")
    if 2 * tokens > allocator.capacity_tokens:
        raise BenchmarkError(f"device pool too small for 2 x {tokens} tokens")
    allocator.try_alloc(allocator.capacity_tokens)  # everything; free the destinations below
    num_pages = tokens // page_size
    if runs:  # a random place for the two runs, one after the other
        first = int(torch.randint(0, allocator.num_pages - 2 * num_pages + 1, (1,),
                                  generator=gen))
        pages = torch.arange(first + 1, first + 1 + 2 * num_pages)
    else:
        pages = torch.randperm(allocator.num_pages, generator=gen)[: 2 * num_pages] + 1
    offsets = torch.arange(page_size)
    source = (pages[:num_pages, None] * page_size + offsets).flatten()
    destinations = (pages[num_pages:].sort().values[:, None] * page_size + offsets).flatten()
    allocator.free(Indices(destinations, IndexSpace.DEVICE_FULL))
    return Slots(page_size, allocator, source.contiguous())


@dataclass
class OpRecorder(TransferStats):
    """Controller stats that also remember the op submitted last, and the last of each
    direction (their events are what the benchmark times)."""

    last: TransferOp | None = None
    last_by_direction: dict[Direction, TransferOp] = field(default_factory=dict)

    def on_submit(self, op: TransferOp) -> None:
        self.last = op
        self.last_by_direction[op.direction] = op
        super().on_submit(op)


@dataclass
class Issued:
    """One submitted op and the slots it allocated (host for writes, device for loads)."""

    op: TransferOp
    slots: Indices


class Session:
    """One backend over the shared pools: a fresh controller with one page size's slots.

    ``stored``: host slots holding the rows of the last verified write; loads read them.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, slots: Slots,
                 backend: TransferBackend) -> None:
        self.ctrl = CacheController(
            device_pool=device_pool, device_allocator=slots.allocator, host_pool=host_pool,
            backend=backend, event_ring_size=MAX_BATCH_OPS + 2,
        )
        self.recorder = OpRecorder()
        self.ctrl.stats = self.recorder
        self.slots = slots
        self.stored: Indices | None = None

    @property
    def tokens(self) -> int:
        return int(self.slots.write_source.numel())

    def max_batch(self, num_tokens: int) -> int:
        """Most ops of ``num_tokens`` one batch may issue (slots and event sets allow)."""
        return max(1, min(MAX_BATCH_OPS, self.tokens // num_tokens))

    def write_ops(self, count: int, num_tokens: int) -> list[Issued]:
        """Issue ``count`` writes of ``num_tokens`` (consecutive slices of the write source),
        one op each, without waiting."""
        issued = []
        for i in range(count):
            part = self.slots.write_source[i * num_tokens: (i + 1) * num_tokens]
            host = self.ctrl.write(Indices(part, IndexSpace.DEVICE_FULL))
            if host is None:
                raise BenchmarkError(f"host pool full: cannot write {num_tokens} tokens")
            self.ctrl.start_writing()
            issued.append(Issued(self._last_op(), host))
        return issued

    def load_ops(self, count: int, num_tokens: int) -> list[Issued]:
        """Issue ``count`` layer-wise loads of ``num_tokens`` of the stored rows."""
        if self.stored is None:
            raise BenchmarkError("load before any verified write")
        issued = []
        for i in range(count):
            part = self.stored.tensor[i * num_tokens: (i + 1) * num_tokens]
            device = self.ctrl.load(Indices(part, IndexSpace.HOST_FULL))
            if device is None:
                raise BenchmarkError(f"device allocator full: cannot load {num_tokens} tokens")
            self.ctrl.start_loading()
            issued.append(Issued(self._last_op(), device))
        return issued

    def both_ops(self, num_tokens: int) -> list[Issued]:
        """Queue a write and a load of ``num_tokens`` each (as :meth:`write_ops` and
        :meth:`load_ops` would) and issue them together (``start_transfers``): the write,
        then the load."""
        if self.stored is None:
            raise BenchmarkError("load before any verified write")
        host = self.ctrl.write(Indices(self.slots.write_source[:num_tokens],
                                       IndexSpace.DEVICE_FULL))
        device = self.ctrl.load(Indices(self.stored.tensor[:num_tokens], IndexSpace.HOST_FULL))
        if host is None or device is None:
            raise BenchmarkError(f"pools full: cannot write and load {num_tokens} tokens")
        self.ctrl.start_transfers()
        ops = self.recorder.last_by_direction
        return [Issued(ops[Direction.DEVICE_TO_HOST], host),
                Issued(ops[Direction.HOST_TO_DEVICE], device)]

    def finish(self, issued: list[Issued], keep: bool = False) -> None:
        """Wait for ``issued``, acknowledge them and free the slots they allocated (unless
        ``keep``)."""
        for item in issued:
            assert item.op.finish_event is not None
            item.op.finish_event.synchronize()
        self.ctrl.poll()
        if self.ctrl.num_in_flight:
            raise BenchmarkError(f"{self.ctrl.num_in_flight} ops still in flight after waiting")
        if keep:
            return
        for item in issued:
            if item.slots.space is IndexSpace.HOST_FULL:
                self.ctrl.evict_host(item.slots)
            else:
                self.ctrl.evict_device(item.slots)

    def close(self) -> None:
        """Free the stored host slots (the pools outlive the session)."""
        if self.stored is not None:
            self.ctrl.evict_host(self.stored)
            self.stored = None

    def _last_op(self) -> TransferOp:
        op = self.recorder.last
        assert op is not None, "the controller submitted no op"
        return op

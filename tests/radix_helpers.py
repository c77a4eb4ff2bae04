"""Builders shared by the radix tree tests: small CPU pools and recognisable KV rows.

Every token's rows hold values derived from its whole prefix (``prefix_code``), so a row
that belongs to another sequence, another position or another pool never compares equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.config import EvictionPolicy, WritePolicy
from hicache.controller import CacheController, HybridCacheController, TorchBackend
from hicache.pools import (
    AttentionKind,
    DeviceKVPool,
    HostKVPool,
    HostLayout,
    HybridSWAPool,
    IndexSpace,
    Indices,
    PageAllocator,
    RowGeometry,
)
from hicache.radix import HiRadixCache, TreeNode
from hicache.radix.key import key_bytes

GEOMETRY = RowGeometry(AttentionKind.MHA, 1, 2, 0, torch.float32)  # rows of 2 elements
NUM_LAYERS = 3
SENTINEL = -7.0


def prefix_codes(tokens: Sequence[int]) -> list[int]:
    """One code per position, a rolling hash of the prefix ending there (< 2**16)."""
    codes, code = [], 0
    for token in tokens:
        code = (code * 31 + int(token) + 1) % 65521
        codes.append(code)
    return codes


def expected_rows(tokens: Sequence[int], num_layers: int, offset: float = 0.0) -> torch.Tensor:
    """``[n, components, layers, row]`` rows the engine writes for ``tokens``; exact in fp32."""
    codes = torch.tensor(prefix_codes(tokens), dtype=torch.float32)
    c, r = GEOMETRY.num_components, GEOMETRY.row_elems
    grid = (torch.arange(c)[:, None, None] * 16 + torch.arange(num_layers)[None, :, None] * 4
            + torch.arange(r)[None, None, :]).to(torch.float32)
    return codes[:, None, None, None] * 64 + grid[None] + offset


def write_rows(pool: DeviceKVPool, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``[n, C, L, R]`` CPU rows at CPU ``slots`` of ``pool`` (on the current stream)."""
    index = slots.to(pool.device)
    pool.data[:, :, index] = rows.permute(1, 2, 0, 3).to(pool.device)


def read_rows(pool: DeviceKVPool, slots: torch.Tensor) -> torch.Tensor:
    """``[n, C, L, R]`` rows at CPU ``slots`` of ``pool``, copied to the CPU."""
    return pool.data[:, :, slots.to(pool.device)].permute(2, 0, 1, 3).cpu()


def full_indices(slots: Sequence[int]) -> Indices:
    return Indices(torch.tensor(list(slots), dtype=torch.int64), IndexSpace.DEVICE_FULL)


class _RigBase:
    """Engine steps shared by the plain and the hybrid rig."""

    page_size: int
    controller: CacheController
    tree: HiRadixCache
    full_pool: DeviceKVPool
    num_full_layers: int

    def try_alloc(self, num_tokens: int) -> Indices | None:
        raise NotImplementedError

    def write(self, tokens: Sequence[int], slots: Indices) -> None:
        """Write the rows of ``tokens`` at ``slots`` (``len(slots) >= len(tokens)``)."""
        rows = expected_rows(tokens, self.num_full_layers)
        write_rows(self.full_pool, slots.tensor[:len(tokens)], rows)

    @property
    def allocator(self) -> PageAllocator:
        return self.controller.device_allocator

    def alloc(self, num_tokens: int) -> Indices:
        """Slots for ``num_tokens`` rounded up to pages; fails the test when full."""
        rounded = -(-num_tokens // self.page_size) * self.page_size
        slots = self.try_alloc(rounded)
        assert slots is not None, f"device pool full ({rounded} tokens wanted)"
        return slots

    def put(self, tokens: Sequence[int]) -> tuple[int, Indices]:
        """Engine step: allocate, write recognisable rows, insert, free the partial tail.

        Returns (tokens already cached, the slots given to the tree).
        """
        return self.insert_slots(tokens, self.alloc(len(tokens)))

    def insert_slots(self, tokens: Sequence[int], slots: Indices) -> tuple[int, Indices]:
        """:meth:`put` with slots the caller allocated."""
        self.write(tokens, slots)
        cached = self.tree.insert(tokens, slots)
        whole = len(tokens) // self.page_size * self.page_size
        tail = Indices(slots.tensor[whole:], IndexSpace.DEVICE_FULL)
        if len(tail):
            self.controller.evict_device(tail)
        return cached, Indices(slots.tensor[:whole], IndexSpace.DEVICE_FULL)

    def ack(self) -> int:
        """Apply every finished op (all of them on a CPU); returns how many acks."""
        acks = self.controller.poll()
        self.tree.apply_acks(acks)
        return len(acks)

    def device_rows_ok(self, tokens: Sequence[int], slots: Indices) -> bool:
        """The full-pool rows at ``slots`` are those of the first ``len(slots)`` tokens."""
        expected = expected_rows(tokens[:len(slots)], self.num_full_layers)
        return torch.equal(read_rows(self.full_pool, slots.tensor), expected)


class Rig(_RigBase):
    """A tree over small CPU pools (plain full attention, 3 layers).

    ``device_pages`` / ``host_pages`` usable pages of ``page_size`` tokens; the device pool
    starts filled with the sentinel.
    """

    def __init__(
        self,
        *,
        write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
        eviction_policy: EvictionPolicy = EvictionPolicy.LRU,
        page_size: int = 2,
        device_pages: int = 12,
        host_pages: int = 24,
        threshold: int = 0,
        hits: int = 2,
    ) -> None:
        self.page_size = page_size
        self.num_full_layers = NUM_LAYERS
        allocator = PageAllocator(device_pages, page_size, IndexSpace.DEVICE_FULL, "full")
        self.pool = self.full_pool = DeviceKVPool(
            name="full", space=IndexSpace.DEVICE_FULL, num_layers=NUM_LAYERS,
            num_slots=allocator.num_slots, geometry=GEOMETRY, device="cpu",
        )
        self.host = HostKVPool(
            name="full", space=IndexSpace.HOST_FULL, num_layers=NUM_LAYERS,
            num_pages=host_pages, page_size=page_size, geometry=GEOMETRY,
            layout=HostLayout.LAYER_FIRST, pin=False,
        )
        self.pool.data.fill_(SENTINEL)
        self.controller = CacheController(
            device_pool=self.pool, device_allocator=allocator, host_pool=self.host,
            backend=TorchBackend(),
        )
        self.tree = HiRadixCache(
            self.controller, write_policy=write_policy, eviction_policy=eviction_policy,
            write_through_hits=hits, load_back_threshold_tokens=threshold,
        )

    def try_alloc(self, num_tokens: int) -> Indices | None:
        return self.allocator.try_alloc(num_tokens)


class HybridRig(_RigBase):
    """A hybrid tree: 3 layers (layer 1 sliding-window), window of 3 tokens, pages of 2;
    the SWA host pool has ``swa_host_pages`` pages (default: ``host_pages``)."""

    WINDOW = 3

    def __init__(
        self,
        *,
        write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
        full_pages: int = 16,
        swa_pages: int = 8,
        host_pages: int = 32,
        keep_swa_history: bool = True,
        swa_host_pages: int | None = None,
    ) -> None:
        self.page_size = 2
        self.num_full_layers = 2
        self.pool = HybridSWAPool(
            num_layers=3, swa_layers=[1], full_pages=full_pages, swa_pages=swa_pages,
            page_size=self.page_size, geometry=GEOMETRY, device="cpu",
        )
        self.full_pool = self.pool.full
        self.pool.full.data.fill_(SENTINEL)
        self.pool.swa.data.fill_(SENTINEL)
        swa_host = host_pages if swa_host_pages is None else swa_host_pages
        hosts = [
            HostKVPool(name=name, space=space, num_layers=layers, num_pages=pages,
                       page_size=self.page_size, geometry=GEOMETRY,
                       layout=HostLayout.PAGE_FIRST, pin=False)
            for name, space, layers, pages in (("full", IndexSpace.HOST_FULL, 2, host_pages),
                                               ("swa", IndexSpace.HOST_SWA, 1, swa_host))
        ]
        self.controller = HybridCacheController(
            hybrid_pool=self.pool, host_full=hosts[0], host_swa=hosts[1], backend=TorchBackend(),
        )
        self.tree = HiRadixCache(
            self.controller, write_policy=write_policy, load_back_threshold_tokens=0,
            window_tokens=self.WINDOW, keep_swa_history=keep_swa_history,
        )

    def try_alloc(self, num_tokens: int) -> Indices | None:
        return self.pool.try_alloc(num_tokens)

    def write(self, tokens: Sequence[int], slots: Indices) -> None:
        """Full rows of every token and SWA rows (offset by 0.5) where a slot has one."""
        super().write(tokens, slots)
        swa = self.pool.swa_slots_of(slots).tensor[:len(tokens)]
        has = swa != 0
        rows = expected_rows(tokens, 1, offset=0.5)[has]
        write_rows(self.pool.swa, swa[has], rows)


def host_only(rig: Rig, tokens: list[int]) -> None:
    """Cache ``tokens``, back them up and evict them from the device: a host hit."""
    rig.put(tokens)
    rig.ack()
    rig.tree.evict(len(tokens))
    assert rig.tree.match_prefix(tokens).host_hit_tokens == len(tokens)


def find(tree: HiRadixCache, tokens: Sequence[int]) -> TreeNode:
    """The node whose key ends exactly after ``tokens`` (no split, no side effect)."""
    node, pos = tree.root, 0
    while pos < len(tokens):
        child = node.children.get(key_bytes(tokens[pos:pos + tree.page_size], "find"))
        assert child is not None, f"no node for {list(tokens[:pos + tree.page_size])}"
        node, pos = child, pos + child.num_tokens
    assert pos == len(tokens), f"no node ends after {len(tokens)} tokens"
    return node


def ids(indices: Indices | None) -> list[int]:
    """Slot ids as a list (fails the test on ``None``)."""
    assert indices is not None
    return [int(slot) for slot in indices.tensor.tolist()]

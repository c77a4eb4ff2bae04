"""Paged attention in torch: the reference engine's KV access through the device pools.

Each request of a forward has a row in the batch page table (full-pool page ids; 0 is the
padding page). A new token at position ``p`` of the request in row ``r`` reads::

    full layer   keys 0 .. p         slot = page_table[r, pos // P] * P + pos % P
    SWA layer    keys p-W+1 .. p     slot = swa_page_table[r, pos // P] * P + pos % P

``swa_page_table`` is ``HybridSWAPool.translate_page_table(page_table)``: SWA layers never
see a full-space index. New rows are written with ``set_kv`` at ``out_cache_loc`` (full
layers) or at its SWA translation (SWA layers). The pool's ``key_buffer(layer)`` /
``value_buffer(layer)`` run the layer waiter first, so a layer-wise load into this batch's
slots is waited on before the layer reads or writes anything.

Decode steps use :class:`DecodeBuffers`: preallocated int32 buffers, as a CUDA graph needs,
filled for the live rows and zeroed past them, so padded rows point at slot 0 (page 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.pools import DeviceKVPool, HybridSWAPool, IndexSpace, Indices

from .model import ModelSpec

KVPool = HybridSWAPool | DeviceKVPool


@dataclass(frozen=True)
class ForwardBatch:
    """Where one forward's new tokens go and which pages their requests read.

    ``rows[i]`` / ``positions[i]``: page-table row and position of new token ``i``.
    ``out_cache_loc``: ``[n]`` (or ``[max_batch]`` padded) int32 ``DEVICE_FULL`` slots on
    the pool's device. ``swa_out_cache_loc``: its SWA translation (hybrid pools only).
    ``page_table`` / ``swa_page_table``: ``[rows, max_pages]`` int32 page ids on the device.
    """

    rows: list[int]
    positions: list[int]
    out_cache_loc: Indices
    swa_out_cache_loc: Indices | None
    page_table: torch.Tensor
    swa_page_table: torch.Tensor | None


def page_table_cpu(page_rows: list[list[int]], num_rows: int, max_pages: int) -> torch.Tensor:
    """``[num_rows, max_pages]`` int32 CPU table; rows and entries past the data are 0."""
    table = torch.zeros(num_rows, max_pages, dtype=torch.int32)
    for r, pages in enumerate(page_rows):
        if len(pages) > max_pages:
            raise ValueError(f"page table row {r}: {len(pages)} pages > max_pages {max_pages}")
        table[r, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return table


def exact_batch(
    pool: KVPool, locs: list[int], rows: list[int], positions: list[int],
    page_rows: list[list[int]], max_pages: int,
) -> ForwardBatch:
    """A forward of any shape (prefill chunks and decodes); unpadded tensors.

    For a hybrid pool this calls ``begin_forward``: the caller calls ``end_forward`` after.
    """
    device = pool.device
    full = Indices(torch.tensor(locs, dtype=torch.int32).to(device), IndexSpace.DEVICE_FULL)
    table = page_table_cpu(page_rows, len(page_rows), max_pages).to(device)
    if not isinstance(pool, HybridSWAPool):
        return ForwardBatch(rows, positions, full, None, table, None)
    swa = pool.begin_forward(full)
    return ForwardBatch(rows, positions, full, swa, table, pool.translate_page_table(table))


class DecodeBuffers:
    """Preallocated decode-step buffers (fixed addresses, as CUDA-graph replay needs).

    Args:
        max_batch: rows of every buffer.
        max_pages: page-table columns (the longest sequence in pages).
        device: the pool's device.
    """

    def __init__(self, max_batch: int, max_pages: int, device: torch.device) -> None:
        self.max_batch = max_batch
        self.max_pages = max_pages
        self.out_cache_loc = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.swa_out_cache_loc = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device)

    def fill(
        self, pool: KVPool, locs: list[int], positions: list[int], page_rows: list[list[int]]
    ) -> ForwardBatch:
        """One new token per live row; rows ``len(locs):`` become padding (slot 0, page 0).

        Stale values from a larger earlier batch are overwritten, never left behind.
        """
        n = len(locs)
        if n > self.max_batch:
            raise ValueError(f"decode batch of {n} rows > max_batch {self.max_batch}")
        self.out_cache_loc[:n].copy_(torch.tensor(locs, dtype=torch.int32))
        self.out_cache_loc[n:].zero_()
        self.page_table.copy_(page_table_cpu(page_rows, self.max_batch, self.max_pages))
        full = Indices(self.out_cache_loc, IndexSpace.DEVICE_FULL)
        rows = list(range(n))
        if not isinstance(pool, HybridSWAPool):
            return ForwardBatch(rows, positions, full, None, self.page_table, None)
        live = Indices(self.out_cache_loc[:n], IndexSpace.DEVICE_FULL)
        swa = pool.fill_decode_buffer(self.swa_out_cache_loc, live)
        return ForwardBatch(rows, positions, full, swa, self.page_table,
                            pool.translate_page_table(self.page_table))


class PagedKV:
    """:class:`~hicache.engine.model.KVAccess` over the pools for one :class:`ForwardBatch`.

    Args:
        pool: the engine's device pool (hybrid SWA or full attention only).
        batch: this forward's locations and page tables.
        spec: the model (which layers slide, the window).
        page_size: tokens per page.
    """

    def __init__(self, pool: KVPool, batch: ForwardBatch, spec: ModelSpec, page_size: int) -> None:
        self.pool = pool
        self.batch = batch
        self.spec = spec
        self.page_size = page_size
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=pool.device)
        self._slots: dict[tuple[bool, int], torch.Tensor] = {}
        self._buffers: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``[n, heads, D]`` rows at ``out_cache_loc`` (padded rows: zeros, slot 0)."""
        pool, batch = self.pool, self.batch
        # The accessors wait on this layer's load before anything touches the layer.
        keys, values = pool.key_buffer(layer), pool.value_buffer(layer)
        pad = len(batch.out_cache_loc) - k.shape[0]
        if pad:
            k = torch.cat([k, k.new_zeros(pad, *k.shape[1:])])
            v = torch.cat([v, v.new_zeros(pad, *v.shape[1:])])
        if isinstance(pool, HybridSWAPool) and pool.is_swa_layer(layer):
            assert batch.swa_out_cache_loc is not None, "hybrid batch without SWA locations"
            sub_pool, local = pool.pool_of(layer)
            sub_pool.set_kv(local, batch.swa_out_cache_loc, k, v)
        else:
            pool.set_kv(layer, batch.out_cache_loc, k, v)
        self._buffers = (layer, keys, values)

    def gather(self, layer: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows new token ``token`` attends to in ``layer`` (after :meth:`write` of it)."""
        assert self._buffers is not None and self._buffers[0] == layer, "write the layer first"
        _, keys, values = self._buffers
        position = self.batch.positions[token]
        is_swa = layer in self.spec.swa_layers
        slots = self._row_slots(is_swa, self.batch.rows[token])
        wanted = slots[self.spec.first_key(layer, position):position + 1]
        return keys[wanted], values[wanted]

    def _row_slots(self, is_swa: bool, row: int) -> torch.Tensor:
        """int64 slot of every position of a page-table row (full or SWA space)."""
        key = (is_swa, row)
        if key not in self._slots:
            table = self.batch.swa_page_table if is_swa else self.batch.page_table
            assert table is not None, "SWA layer without an SWA page table"
            pages = table[row].to(torch.int64)
            self._slots[key] = (pages[:, None] * self.page_size + self._offsets).reshape(-1)
        return self._slots[key]
